"""The local orchestrator's stacks and scenarios, shared by the tests and bench/.

`Honcho` runs the repository's Procfile (`honcho start`); `zero_stack` runs gateway,
scheduler and orchestrator with no worker yet; `Watch` follows heartbeats and fleet
status; `kill_worker` and `first_request_at_zero` are the scenarios that
tests/integration/test_orchestrator.py asserts on and bench/orchestrator.py times.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from contextlib import asynccontextmanager
from pathlib import Path

import msgspec

from services.supervisor import Supervisor, wait_ready
from shared import catalog, subjects
from shared.bus import connect
from shared.messages import FleetStatus, fleet_status_decoder
from shared.natsd import free_port
from shared.telemetry import heartbeat_decoder
from bench.support import faults
from bench.support.load import one
from bench.support.testcache import default_cache
from bench.support.workload import embed_body

REPO = Path(__file__).resolve().parents[2]
MODEL = catalog.ENCODER
DEMO_LM = catalog.DEMO_LM


def data_dir(workdir: Path, jax_cache: Path) -> Path:
    """A fresh data dir whose compilation cache is `jax_cache` (shared between runs)."""
    data = workdir / "data"
    data.mkdir(parents=True, exist_ok=True)
    jax_cache.mkdir(parents=True, exist_ok=True)
    link = data / "jax-cache"
    if not link.exists():
        link.symlink_to(jax_cache.resolve(), target_is_directory=True)
    return data


def stack_env(workdir: Path, jax_cache: Path, **extra: str) -> dict[str, str]:
    """The fault scenarios' settings (small buckets, fast heartbeats), a private data dir,
    and no worker for a model nobody named (minimum 0)."""
    return {**faults.ENV, "TENSORBUS_DATA_DIR": str(data_dir(workdir, jax_cache)),
            "TENSORBUS_MIN_WORKERS": "0", **extra}


# ----------------------------------------------------------- honcho stack
class Honcho:
    """`honcho start` on the real Procfile, its output in `log_path`."""

    def __init__(self, workdir: Path, env: dict[str, str]) -> None:
        self.port = free_port()
        self.url = f"nats://127.0.0.1:{self.port}"
        self.log_path = workdir / "honcho.log"
        full = {**os.environ, "HF_HUB_OFFLINE": "1", **env, "TENSORBUS_NATS_PORT": str(self.port),
                "TENSORBUS_NATS_URL": self.url}
        self._log = open(self.log_path, "wb")
        self.popen = subprocess.Popen([sys.executable, "-m", "honcho", "start", "-f",
                                       str(REPO / "Procfile")], cwd=REPO, env=full,
                                      stdout=self._log, stderr=subprocess.STDOUT)

    def alive(self) -> bool:
        return self.popen.poll() is None

    def lines(self) -> list[str]:
        return self.log_path.read_text(errors="replace").splitlines()

    def stopped_lines(self) -> list[str]:
        """honcho's own "<name> stopped (rc=N)" lines: a process of the Procfile exited."""
        return [ln for ln in self.lines() if " stopped (rc=" in ln]

    def events(self, event: str) -> list[dict]:
        """The orchestrator's own JSON log lines with `event`."""
        out = []
        for line in self.lines():
            _, sep, rest = line.partition(" orchestrator.1 | ")
            if sep and rest.startswith("{"):
                try:
                    rec = json.loads(rest)
                except ValueError:
                    continue
                if rec.get("event") == event:
                    out.append(rec)
        return out

    def stop(self) -> int:
        if self.alive():
            self.popen.send_signal(signal.SIGTERM)
        try:
            return self.popen.wait(60)
        except subprocess.TimeoutExpired:
            self.popen.kill()
            return self.popen.wait()
        finally:
            self._log.close()


@asynccontextmanager
async def honcho_stack(workdir: Path, env: dict[str, str], workers: int = 2):
    """(honcho, client) once `workers` encoder workers are ready."""
    h = Honcho(workdir, env)
    nc = None
    try:
        nc = await connect(h.url, "bench-client")
        await wait_ready(nc, MODEL, workers, timeout=300)
        yield h, nc
    finally:
        if nc is not None:
            await nc.close()
        h.stop()


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


class Watch:
    """FleetStatus and heartbeats as they arrive, with their arrival times."""

    def __init__(self) -> None:
        self.statuses: list[tuple[float, FleetStatus]] = []
        self.ready_at: dict[str, float] = {}  # worker id -> first `ready` heartbeat
        self._subs = []

    async def start(self, nc) -> "Watch":
        async def on_status(msg) -> None:
            try:
                self.statuses.append((time.monotonic(), fleet_status_decoder.decode(msg.data)))
            except msgspec.DecodeError:
                pass

        async def on_hb(msg) -> None:
            try:
                hb = heartbeat_decoder.decode(msg.data)
            except msgspec.DecodeError:
                return
            if hb.state == "ready":
                self.ready_at.setdefault(hb.worker_id, time.monotonic())

        self._subs = [await nc.subscribe(subjects.ORCHESTRATOR_STATUS, cb=on_status),
                      await nc.subscribe(subjects.TELEMETRY_WORKERS, cb=on_hb)]
        return self

    async def stop(self) -> None:
        for s in self._subs:
            await s.unsubscribe()

    def model(self, model: str):
        """The latest ModelStatus of `model`, or None."""
        for _, st in reversed(self.statuses):
            for m in st.models:
                if m.model == model:
                    return m
        return None

    async def until(self, cond, timeout: float = 120.0) -> None:
        """Until `cond()` holds (checked as statuses and heartbeats arrive)."""
        end = time.monotonic() + timeout
        while not cond():
            if time.monotonic() > end:
                raise TimeoutError("condition not met; last statuses: "
                                   f"{[s for _, s in self.statuses[-2:]]}")
            await asyncio.sleep(0.02)


# ---------------------------------------------------------------- scenarios
async def kill_worker(h: Honcho, nc, clients: int = 8, before: int = 40, after: int = 120) -> dict:
    """SIGKILL one encoder worker under load; its replacement comes up by itself."""
    watch = await Watch().start(nc)
    lg = faults.load(nc, clients).start()
    started = time.monotonic()
    await lg.wait_for(before)
    workers = [e for e in h.events("worker_started") if e["model"] == MODEL and pid_alive(e["pid"])]
    victim, other = workers[0], workers[-1]
    known = set(watch.ready_at) | {w["worker_id"] for w in workers}
    await faults.busy_heartbeat(nc, victim["worker_id"])
    t_kill = time.monotonic()
    os.kill(victim["pid"], signal.SIGKILL)
    await watch.until(lambda: any(w not in known for w in watch.ready_at), timeout=180)
    t_back = min(t for w, t in watch.ready_at.items() if w not in known)
    await lg.wait_for(len(lg.outcomes) + after, timeout=120)
    outcomes = await lg.stop()
    await watch.stop()
    held = faults.in_flight_at(outcomes, t_kill)
    return faults.figures(
        "replace", outcomes, started, clients=clients, in_flight_at_kill=len(held),
        replaced_s=round(t_back - t_kill, 2), honcho_alive=h.alive(),
        procfile_exits=h.stopped_lines(), other_worker_alive=pid_alive(other["pid"]),
        restarts=len([e for e in h.events("worker_exited") if e["outcome"] == "crashed"]))


@asynccontextmanager
async def zero_stack(workdir: Path, env: dict[str, str]):
    """(supervisor, client, watch): gateway, scheduler, orchestrator; no worker yet."""
    with Supervisor(workdir, env=env) as sup:
        sup.start_nats()
        sup.start("gateway", "services.gateway")
        sup.start("scheduler", "services.scheduler")
        sup.start_orchestrator()
        nc = await connect(sup.nats_url, "bench-client")
        watch = await Watch().start(nc)
        try:
            await services_ready(nc, ("gateway", "scheduler", "orchestrator"))
            yield sup, nc, watch
        finally:
            await watch.stop()
            await nc.close()


async def services_ready(nc, names, timeout: float = 60.0) -> None:
    """Until each `tensorbus-<name>` answers its readiness probe without an error."""
    from services.micro import ready_subject
    from shared.errors import HEADER_CODE

    end = time.monotonic() + timeout
    for name in names:
        while True:
            try:
                msg = await nc.request(ready_subject(f"tensorbus-{name}"), b"", timeout=1)
                if not (msg.headers or {}).get(HEADER_CODE):
                    break
            except Exception:  # noqa: BLE001 - not up yet
                pass
            if time.monotonic() > end:
                raise TimeoutError(f"tensorbus-{name} not ready")
            await asyncio.sleep(0.05)


async def first_request_at_zero(nc, watch: Watch, timeout: float = 120.0) -> dict:
    """One request sent with no worker running: the time to its reply."""
    await watch.until(lambda: (m := watch.model(MODEL)) is not None and m.running == 0, 60)
    o = await one(nc, subjects.EMBEDDINGS, embed_body(MODEL, "anyone there"), timeout,
                  {"Tensorbus-Timeout": f"{timeout:g}"})
    return {"status": o.status, "first_reply_s": round(o.took, 2)}
