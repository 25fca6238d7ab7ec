"""Worker processes: start one, relay its output, stop it, learn how it ended.

Each worker is `python -m services.worker` with the orchestrator's environment plus
its own: `TENSORBUS_MODEL`, a `TENSORBUS_WORKER_ID`, the per-model settings resolved
for its model, and thread counts (`TENSORBUS_WORKER_THREADS`). Its stdout and stderr go
to the orchestrator's stdout, one line at a time, prefixed with the worker's name
(so `honcho start` shows them). The last line it wrote to stderr is kept: for a
worker that exits 78 it is the reason.

On Linux a worker gets SIGTERM when the orchestrator dies (PR_SET_PDEATHSIG), so a
killed orchestrator leaves no worker behind.
"""

from __future__ import annotations

import asyncio
import ctypes
import re
import signal
import sys
import time
from typing import BinaryIO, Callable, cast

from shared.config import PREFIX, per_model

# Settings written VALUE[,MODEL=VALUE...]: resolved per worker for its model.
PER_MODEL_SETTINGS = ("engine", "dtype", "tensor_parallel", "quant")


def thread_env(threads: int) -> dict[str, str]:
    """Thread counts for one worker. JAX's CPU client sizes its thread pool from
    NPROC (XLA reads it before the core count); OpenMP and MKL (torch) from theirs."""
    n = str(threads)
    return {"NPROC": n, "OMP_NUM_THREADS": n, "MKL_NUM_THREADS": n}


def worker_env(base: dict[str, str], model: str, worker_id: str, threads: int) -> dict[str, str]:
    env = dict(base)
    for name in PER_MODEL_SETTINGS:
        key = PREFIX + name.upper()
        if key in env:
            try:
                env[key] = per_model(env[key], model)
            except ValueError:
                pass  # malformed: the worker itself says so and exits 78
    env.update(thread_env(threads))
    env.update({PREFIX + "MODEL": model, PREFIX + "WORKER_ID": worker_id, "PYTHONUNBUFFERED": "1"})
    return env


def safe_token(text: str) -> str:
    """Usable inside a NATS subject token and a log prefix."""
    return re.sub(r"[^A-Za-z0-9_-]", "-", text)


def _die_with_parent() -> None:
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def describe_exit(code: int) -> str:
    if code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = f"signal {-code}"
        hint = " (the kernel's out-of-memory killer sends this)" if -code == signal.SIGKILL else ""
        return f"killed by {name}{hint}"
    return f"exited with code {code}"


class WorkerProcess:
    """One running `python -m services.worker`."""

    def __init__(self, name: str, model: str, worker_id: str, threads: int,
                 proc: asyncio.subprocess.Process) -> None:
        self.name = name
        self.model = model
        self.worker_id = worker_id
        self.threads = threads
        self.proc = proc
        self.started_at = time.monotonic()
        self.stopping = False
        self.last_stderr = ""
        self.exited = asyncio.Event()
        self.returncode: int | None = None

    @property
    def pid(self) -> int:
        return self.proc.pid

    def terminate(self) -> None:
        """SIGTERM: the worker drains (idempotent)."""
        self.stopping = True
        self._signal(signal.SIGTERM)

    def kill(self) -> None:
        self._signal(signal.SIGKILL)

    def _signal(self, sig: int) -> None:
        if self.returncode is None:
            try:
                self.proc.send_signal(sig)
            except ProcessLookupError:
                pass


class Launcher:
    """Starts worker processes and reports each exit to `on_exit(wp, code)`."""

    def __init__(self, base_env: dict[str, str], on_exit: Callable[[WorkerProcess, int], None],
                 out: BinaryIO | None = None, argv: list[str] | None = None,
                 worker_prefix: str = "") -> None:
        self.base_env = base_env
        self.on_exit = on_exit
        self.out = out or sys.stdout.buffer
        self.argv = argv or [sys.executable, "-m", "services.worker"]
        self.worker_prefix = worker_prefix
        self._seq: dict[str, int] = {}
        self._tasks: set[asyncio.Task] = set()

    async def start(self, model: str, threads: int) -> WorkerProcess:
        n = self._seq[model] = self._seq.get(model, 0) + 1
        name = f"{safe_token(model)}.{n}"
        worker_id = f"{self.worker_prefix}{safe_token(model)}-{n}"
        proc = await asyncio.create_subprocess_exec(
            *self.argv, env=worker_env(self.base_env, model, worker_id, threads),
            stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE, preexec_fn=_die_with_parent)
        wp = WorkerProcess(name, model, worker_id, threads, proc)
        task = asyncio.create_task(self._watch(wp))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return wp

    async def _watch(self, wp: WorkerProcess) -> None:
        # start() opens both as pipes.
        stdout = cast(asyncio.StreamReader, wp.proc.stdout)
        stderr = cast(asyncio.StreamReader, wp.proc.stderr)
        pumps = [asyncio.create_task(self._relay(wp, stdout, False)),
                 asyncio.create_task(self._relay(wp, stderr, True))]
        code = await wp.proc.wait()
        # The pipes close with the process unless it left a child holding them.
        await asyncio.wait(pumps, timeout=2.0)
        for p in pumps:
            p.cancel()
        wp.returncode = code
        wp.exited.set()
        self.on_exit(wp, code)

    async def _relay(self, wp: WorkerProcess, stream: asyncio.StreamReader, is_err: bool) -> None:
        prefix = f"{wp.name} | ".encode()
        while True:
            try:
                line = await stream.readline()
            except ValueError:  # a line over the reader's limit: take what is there
                line = await stream.read(1 << 16)
            if not line:
                return
            if is_err and line.strip():
                wp.last_stderr = line.decode(errors="replace").strip()[:500]
            try:
                self.out.write(prefix + line if line.endswith(b"\n") else prefix + line + b"\n")
                self.out.flush()
            except (OSError, ValueError):
                pass  # our stdout is gone: keep reading so the worker never blocks on a full pipe

    async def wait_all(self, procs: list[WorkerProcess], timeout: float) -> None:
        """Until every one of `procs` exited; SIGKILL those still alive at `timeout`."""
        waits = [asyncio.create_task(p.exited.wait()) for p in procs if not p.exited.is_set()]
        if not waits:
            return
        _, pending = await asyncio.wait(waits, timeout=timeout)
        if pending:
            for p in procs:
                p.kill()
            await asyncio.wait(pending, timeout=5.0)
