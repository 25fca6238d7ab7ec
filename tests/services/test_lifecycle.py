"""services.lifecycle: one serve() for every process; a failed task ends the process.

The subprocess tests run the real scheduler through its real `serve()` wiring, with
one housekeeping loop replaced by one that fails when told to (a NATS message)."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from services.lifecycle import running
from services.micro import ready_subject

REPO = Path(__file__).resolve().parents[2]

# The scheduler's `_scaling` loop, replaced: it waits for CRASH_SUBJECT, then raises.
# Seeding is a no-op; an extra task that finishes its job is no failure.
SCRIPT = """
import os, sys
import services.scheduler.__main__ as main
import services.scheduler.service as svc
from services.lifecycle import serve
from shared.scaling import check_settings

async def no_seeding(registry):  # the bundled weights need not reach this registry
    pass

async def failing(self):
    sub = await self.nc.subscribe(os.environ["CRASH_SUBJECT"])
    msg = await sub.next_msg(timeout=120)
    await msg.respond(b"failing now")  # written by the drain on the way out
    raise RuntimeError("housekeeping broke")

svc.Scheduler._scaling = failing
main.seed_registry = no_seeding
serve("scheduler", main.build, check=check_settings)
"""


def _start(nats_url: str, crash_subject: str) -> subprocess.Popen:
    env = {**os.environ, "TENSORBUS_NATS_URL": nats_url, "TENSORBUS_LOG_FORMAT": "json",
           "CRASH_SUBJECT": crash_subject}
    return subprocess.Popen([sys.executable, "-c", SCRIPT], env=env, cwd=REPO,
                            stderr=subprocess.PIPE, text=True)


async def _until_ready(nc, proc: subprocess.Popen) -> None:
    """The scheduler answers its readiness probe (it says it is ready)."""
    async with asyncio.timeout(60):
        while proc.poll() is None:
            try:
                msg = await nc.request(ready_subject("tensorbus-scheduler"), b"", timeout=0.5)
            except Exception:  # noqa: BLE001 - not subscribed yet: ask again
                continue
            if json.loads(msg.data)["status"] == "ok":
                return
    pytest.fail(f"the scheduler exited early: {proc.stderr.read()}")


async def _exit(proc: subprocess.Popen, timeout: float) -> tuple[int, str]:
    """(exit status, the rest of its stderr), read while waiting: a child that logs more
    than a pipe holds (64 KiB) while nobody reads would block on its next line and never
    exit (a busy machine's slower shutdown logs more reconnect warnings). Past
    `timeout` (a hang bound) it is killed and the test fails with what it logged."""
    try:
        _, err = await asyncio.to_thread(proc.communicate, None, timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        _, err = proc.communicate()
        pytest.fail(f"still running {timeout} s later; its log ends:\n{err[-4000:]}")
    return proc.returncode, err


def _events(stderr: str) -> list[dict]:
    return [json.loads(line) for line in stderr.splitlines() if line.startswith("{")]


async def test_a_failed_background_task_ends_the_process_with_an_error(nats_server, nc):
    crash = f"test.crash.{uuid.uuid4().hex}"
    proc = _start(nats_server.url, crash)
    try:
        await _until_ready(nc, proc)
        async with asyncio.timeout(30):  # asked until the loop has subscribed
            while True:
                try:
                    await nc.request(crash, b"", timeout=0.5)
                    break
                except Exception:  # noqa: BLE001 - no responders yet
                    continue
        rc, stderr = await _exit(proc, 90)
        assert rc == 1, stderr
        failed = [e for e in _events(stderr) if e["event"] == "task_failed"]
        assert failed and "housekeeping broke" in json.dumps(failed[0]), stderr
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


async def test_sigterm_still_exits_cleanly(nats_server, nc):
    proc = _start(nats_server.url, f"test.crash.{uuid.uuid4().hex}")
    try:
        await _until_ready(nc, proc)
        proc.send_signal(signal.SIGTERM)
        rc, stderr = await _exit(proc, 30)
        assert rc == 0, stderr
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


@pytest.mark.parametrize("service", ["gateway", "scheduler", "telemetry"])
async def test_a_service_stopped_while_the_bus_is_down_exits_cleanly_at_once(service, tmp_path):
    """nats-server gone, then SIGTERM: exit 0 within seconds. Before, closing the
    connection raised on its closed transport (exit 1 with a traceback), and the
    scheduler, seeding the registry at the time, waited out a timeout per file to
    undo the push (over a minute)."""
    from shared.natsd import NatsServer

    server = NatsServer(tmp_path / "nats").start()
    env = {**os.environ, "TENSORBUS_NATS_URL": server.url, "TENSORBUS_LOG_FORMAT": "json",
           "TENSORBUS_LOG_LEVEL": "info", "TENSORBUS_HTTP_PORT": "0",
           "TENSORBUS_METRICS_PORT": "0", "TENSORBUS_DATA_DIR": str(tmp_path / "data")}
    proc = subprocess.Popen([sys.executable, "-m", f"services.{service}"], env=env, cwd=REPO,
                            stderr=subprocess.PIPE, text=True)
    lines: list[str] = []

    def started() -> bool:  # the service's own line, logged once it runs
        for line in proc.stderr:
            lines.append(line)
            if f'"{service}_started"' in line:
                return True
        return False

    try:
        assert await asyncio.wait_for(asyncio.to_thread(started), 60), "".join(lines)
        server.stop()
        proc.send_signal(signal.SIGTERM)
        rc, rest = await _exit(proc, 20)
        out = "".join(lines) + rest
        assert rc == 0 and "Traceback" not in out, out[-4000:]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        server.stop()


class _Service:
    def __init__(self, fail: bool = False) -> None:
        self.fail = fail
        self.stops = 0
        self._stop = asyncio.Event()

    async def run(self) -> None:
        await self._stop.wait()
        if self.fail:
            raise RuntimeError("run failed")

    def stop(self) -> None:
        self.stops += 1
        self._stop.set()


class _AsyncStop(_Service):
    async def stop(self) -> None:
        await asyncio.sleep(0)
        super().stop()


@pytest.mark.parametrize("cls", [_Service, _AsyncStop])
async def test_running_runs_and_stops(cls):
    svc = cls()
    async with running(svc) as task:
        assert not task.done()
        assert task.get_name() == f"{cls.__name__}.run"
    assert task.done() and svc.stops == 1


async def test_running_reraises_the_failure_of_run():
    with pytest.raises(RuntimeError, match="run failed"):
        async with running(_Service(fail=True)):
            pass


async def test_a_failure_leaving_the_block_wins_over_runs_own():
    svc = _Service(fail=True)
    with pytest.raises(KeyError):
        async with running(svc) as task:
            raise KeyError("the block's")
    assert task.done() and svc.stops == 1
