"""Liveness from the process itself: a file the service rewrites while it runs.

A liveness probe that asks over NATS fails whenever the bus does, and a bus outage
longer than the probe's patience would then restart every pod of the fleet at once,
though each process is fine and reconnects by itself. So the service writes its
liveness (`ServiceHealth.health()`: its own checks, nothing about the bus) to a file
every `EVERY_S`, and `--check health` reads that file: live when it is fresh and
says ok. A blocked event loop stops the writes, and the file goes stale. Readiness
still goes over the bus (services/probe.py). Imports nothing heavy.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import os
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, Callable

EVERY_S = 5.0  # how often the service rewrites its file
STALE_S = 30.0  # a file older than this is a process that stopped making progress
_writes = itertools.count()


def live_path(service: str, instance: str = "", directory: str | Path | None = None) -> Path:
    """Where `service` (and the configured `instance` id, when there is one) keeps its
    liveness: in the temporary directory, which the pod mounts writable at /tmp."""
    name = f"{service}.{instance}.live" if instance else f"{service}.live"
    return Path(directory or tempfile.gettempdir()) / name


def live_file(service: str, config: Any) -> Path:
    """The file of `service` in this process: named by the id the settings give it
    (TENSORBUS_WORKER_ID, TENSORBUS_SCHEDULER_ID; the manifests set them to the pod's
    name), which the probe, run in the same pod with the same settings, reads too."""
    ids = {"tensorbus-worker": config.worker_id, "tensorbus-scheduler": config.scheduler_id,
           "tensorbus-orchestrator": config.scheduler_id}
    return live_path(service, ids.get(service, ""))


def write_live(path: Path, health: Callable[[], tuple[bool, dict[str, Any]]]) -> bool:
    """Write one answer of `health` with the time, atomically; returns its ok."""
    ok, body = health()
    # A name of this write's own: services of one process (the tests' stacks, one per
    # thread) may write the same file at once, and a shared temporary name let one
    # writer's rename take the other's file away (FileNotFoundError).
    tmp = path.with_name(f"{path.name}.{os.getpid()}.{threading.get_ident()}.{next(_writes)}.tmp")
    try:
        tmp.write_text(json.dumps({"ok": ok, "at": time.time(), **body}, default=str))
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    return ok


async def keep_live(path: Path, health: Callable[[], tuple[bool, dict[str, Any]]],
                    every: float = EVERY_S) -> None:
    """Rewrite `path` every `every` seconds until cancelled (the first write is the
    caller's, so the file exists as soon as the service answers probes)."""
    while True:
        await asyncio.sleep(every)  # a period, not a wait for anything
        try:
            write_live(path, health)
        except OSError:
            pass  # a full or missing /tmp: the file goes stale and the probe says so


def is_live(path: Path, stale_s: float = STALE_S, now: float | None = None) -> bool:
    """Whether the file at `path` says ok and was written within `stale_s`."""
    try:
        body = json.loads(path.read_text())
    except (OSError, ValueError):
        return False
    at = body.get("at") if isinstance(body, dict) else None
    if not isinstance(at, (int, float)):
        return False
    return body.get("ok") is True and (time.time() if now is None else now) - at <= stale_s
