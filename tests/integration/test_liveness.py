"""Liveness answers from the process, readiness from the bus (services/liveness.py).

The probes run as the kubelet runs them, `python -m services.worker --check KIND` in
a child process with the pod's settings, against a service on a real nats-server
that is then stopped: liveness still passes (a bus outage must not restart the
fleet), readiness fails (a pod that cannot reach the bus gets no work).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import sys
import threading
import time

from services.liveness import is_live, keep_live, live_path, write_live
from services.micro import ServiceHealth, add_service
from shared.bus import connect
from shared.config import Config
from shared.natsd import NatsServer

WORKER = "tensorbus-worker"


async def check(kind: str, url: str, tmp: str, worker_id: str = "w-live") -> int:
    env = dict(os.environ, TMPDIR=tmp, TENSORBUS_NATS_URL=url, TENSORBUS_WORKER_ID=worker_id)
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "services.worker", "--check", kind, env=env,
        stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.DEVNULL)
    return await asyncio.wait_for(proc.wait(), 60)


async def test_a_process_whose_nats_is_down_is_still_live_but_not_ready(tmp_path):
    server = NatsServer(tmp_path / "nats").start()
    nc = await connect(server.url, "liveness-test", Config.from_env({}))
    health = ServiceHealth(ready=True)
    health.details = {"instance": "w-live"}
    micro = await add_service(nc, WORKER, "1.0.0", "a worker's probes", health=health,
                              live_file=live_path(WORKER, "w-live", tmp_path))
    try:
        assert await check("ready", server.url, str(tmp_path)) == 0
        assert await check("health", server.url, str(tmp_path)) == 0
        server.stop()  # the bus is gone; the service's client keeps trying to reconnect
        assert await check("health", server.url, str(tmp_path)) == 0
        assert await check("ready", server.url, str(tmp_path)) == 1
        # Another worker's id on the same host has no file of its own: not live.
        assert await check("health", server.url, str(tmp_path), "w-other") == 1
    finally:
        await micro.stop()
        with contextlib.suppress(OSError):  # closing while the server is gone
            await nc.close()
        server.stop()


async def test_the_file_keeps_being_rewritten_and_carries_the_liveness_checks(tmp_path):
    path = live_path(WORKER, "w1", tmp_path)
    health = ServiceHealth()
    progressing = True
    health.add_check("forward_progress", lambda: progressing, liveness=True)
    calls = 0
    rewritten = asyncio.Event()

    def answer():
        nonlocal calls
        calls += 1
        if calls == 3:
            rewritten.set()
        return health.health()

    assert write_live(path, answer) is True
    first = json.loads(path.read_text())["at"]
    task = asyncio.create_task(keep_live(path, answer, every=0.01))
    try:
        await asyncio.wait_for(rewritten.wait(), 10)
    finally:
        task.cancel()
    assert json.loads(path.read_text())["at"] >= first and is_live(path)
    progressing = False  # a stuck engine: the file says so, and the probe fails
    assert write_live(path, health.health) is False
    assert not is_live(path)
    body = json.loads(path.read_text())
    assert body["checks"]["forward_progress"]["ok"] is False


def test_a_stale_missing_or_garbled_file_is_not_live(tmp_path):
    path = live_path(WORKER, "", tmp_path)
    assert path.name == "tensorbus-worker.live"
    assert not is_live(path)  # never written
    write_live(path, lambda: (True, {}))
    assert is_live(path)
    assert not is_live(path, now=time.time() + 31)  # the loop stopped turning
    path.write_text("{not json")
    assert not is_live(path)
    path.write_text(json.dumps({"ok": True}))
    assert not is_live(path)


def test_services_of_one_process_write_one_file_at_once(tmp_path):
    """The tests' stacks run a service per thread (network namespaces), each writing
    the same file: with one temporary name per process, one writer's rename took the
    other's file away and its service failed to start. Each write has its own now."""
    path = live_path(WORKER, "", tmp_path)
    start = threading.Barrier(4)
    failed: list[BaseException] = []

    def writer() -> None:
        start.wait()
        try:
            for _ in range(300):
                write_live(path, lambda: (True, {}))
        except BaseException as exc:  # noqa: BLE001 - reported below
            failed.append(exc)

    threads = [threading.Thread(target=writer) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not failed, failed[:1]
    assert is_live(path)
    assert [p.name for p in tmp_path.iterdir()] == [path.name]  # no temporary left
