"""A small local supervisor: run tensorbus services as real processes.

Used by benchmarks and fault tests (which need real processes to SIGKILL), and for
development when honcho is not wanted. Production orchestration is Kubernetes
(deploy/). Readiness is observed on the bus, never guessed with sleeps. On Linux the
processes it starts get SIGTERM (nats-server SIGKILL) when the thread that started
them dies, so a benchmark killed mid-run leaves nothing running; start them from
the thread that outlives them (the main one).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from shared.natsd import NatsServer

REPO = Path(__file__).resolve().parent.parent


def die_with_parent() -> None:
    """In a child before it runs (`preexec_fn`): SIGTERM when its parent's starting
    thread dies (Linux's PR_SET_PDEATHSIG; elsewhere nothing)."""
    if sys.platform.startswith("linux"):
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)


@dataclass
class Proc:
    name: str
    popen: subprocess.Popen
    log_path: Path

    def alive(self) -> bool:
        return self.popen.poll() is None

    def signal(self, sig: int) -> None:
        if self.alive():
            self.popen.send_signal(sig)

    def wait(self, timeout: float = 30.0) -> int:
        return self.popen.wait(timeout)


@dataclass
class Supervisor:
    """Start services against one nats-server; stop everything on exit."""

    workdir: Path
    env: dict[str, str] = field(default_factory=dict)
    nats: NatsServer | None = None
    procs: dict[str, Proc] = field(default_factory=dict)

    def start_nats(self) -> NatsServer:
        self.nats = NatsServer(self.workdir / "nats").start(die_with_parent=True)
        return self.nats

    @property
    def nats_url(self) -> str:
        assert self.nats is not None
        return self.nats.url

    def service_env(self, **overrides: str) -> dict[str, str]:
        env = dict(os.environ)
        env.update({"TENSORBUS_NATS_URL": self.nats_url, "HF_HUB_OFFLINE": "1",
                    "TENSORBUS_DATA_DIR": str(self.workdir / "data"), "TENSORBUS_LOG_FORMAT": "json",
                    "PYTHONUNBUFFERED": "1"})
        env.update(self.env)
        env.update({k: str(v) for k, v in overrides.items()})
        return env

    def start(self, name: str, module: str, **env: str) -> Proc:
        log_path = self.workdir / f"{name}.log"
        log = open(log_path, "ab")
        popen = subprocess.Popen([sys.executable, "-m", module], cwd=REPO,
                                 env=self.service_env(**env), stdout=log, stderr=subprocess.STDOUT,
                                 preexec_fn=die_with_parent)
        proc = Proc(name, popen, log_path)
        self.procs[name] = proc
        return proc

    def start_orchestrator(self, **env: str) -> Proc:
        """The local orchestrator; the workers it starts log into its own log,
        each line prefixed with the worker's name."""
        return self.start("orchestrator", "services.orchestrator", **env)

    def stop_all(self, timeout: float = 20.0) -> None:
        for p in self.procs.values():
            p.signal(signal.SIGTERM)
        end = time.monotonic() + timeout
        for p in self.procs.values():
            try:
                p.wait(max(0.1, end - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.popen.kill()
                p.popen.wait()
        self.procs.clear()
        if self.nats is not None:
            self.nats.stop()

    def __enter__(self) -> "Supervisor":
        self.workdir.mkdir(parents=True, exist_ok=True)
        return self

    def __exit__(self, *exc) -> None:
        self.stop_all()


async def wait_ready(nc, model: str, workers: int = 1, timeout: float = 300.0) -> None:
    """Until `inference.v1.models` lists `model` with `workers` ready workers."""
    import asyncio

    import msgspec

    end = time.monotonic() + timeout
    while True:
        try:
            msg = await nc.request("inference.v1.models", b"", timeout=1)
            cards = msgspec.json.decode(msg.data).get("data", [])
            if any(c["id"] == model and c.get("ready_workers", 0) >= workers for c in cards):
                return
        except Exception:  # noqa: BLE001 - no gateway yet
            pass
        if time.monotonic() > end:
            raise TimeoutError(f"{model} not ready with {workers} workers")
        await asyncio.sleep(0.1)
