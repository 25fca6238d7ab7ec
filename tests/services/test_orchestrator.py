"""The orchestrator actor on a real nats-server with stand-in worker processes (a few
lines of Python that behave by their TENSORBUS_MODEL), so exits, restarts, drains and
the FleetStatus it publishes are checked in seconds, without JAX."""

from __future__ import annotations

import asyncio
import io
import sys
import time

import msgspec
import pytest_asyncio

from services.orchestrator.service import Orchestrator
from shared import subjects
from shared.config import Config
from shared.messages import fleet_status_decoder
from shared.telemetry import ScaleDecision
from shared.telemetry import encode as encode_record

STAND_IN = r"""
import os, signal, sys, time
model = os.environ["TENSORBUS_MODEL"]
signal.signal(signal.SIGTERM, signal.SIG_IGN if model == "stubborn" else lambda *a: sys.exit(0))
print("hello from", model, "threads", os.environ["NPROC"], "engine", os.environ.get("TENSORBUS_ENGINE"), flush=True)
if model == "bad":
    print("bad configuration: TENSORBUS_ENGINE='tpu' for bad: use one of jax, torch", file=sys.stderr, flush=True)
    sys.exit(78)
if model == "crashy":
    sys.exit(3)
while True:
    time.sleep(1)
"""


class Fleet:
    def __init__(self, orch: Orchestrator, nc) -> None:
        self.orch, self.nc = orch, nc
        self.statuses = []

    def latest(self, model: str):
        for st in reversed(self.statuses):
            for m in st.models:
                if m.model == model:
                    return m
        return None

    def starts(self, model: str) -> int:
        return self.orch.launcher._seq.get(model, 0)

    async def until(self, cond, timeout: float = 20.0) -> None:
        end = time.monotonic() + timeout
        while not cond():
            assert time.monotonic() < end, f"condition not met: {self.statuses[-1:]}"
            await asyncio.sleep(0.01)


@pytest_asyncio.fixture
async def orchestrated(nats_server, nc):
    config = Config.from_env({}, nats_url=nats_server.url,
                             fleet="steady=1:3,bad=1:1,crashy=1:1,idle=0:2,stubborn=0:1",
                             local_workers=8, drain_timeout_s=1, worker_threads="split")

    async def catalogue() -> list[str]:
        return ["steady", "bad", "crashy", "idle", "stubborn"]

    out = io.BytesIO()
    env = {"PATH": "/usr/bin:/bin", "TENSORBUS_ENGINE": "jax,bad=tpu"}
    orch = Orchestrator(nc, config, catalogue, env=env, cores=8, interval_s=0.1, status_s=0.2,
                        worker_argv=[sys.executable, "-c", STAND_IN], orchestrator_id="test", out=out)
    fleet = Fleet(orch, nc)

    async def on_status(msg) -> None:
        try:
            fleet.statuses.append(fleet_status_decoder.decode(msg.data))
        except msgspec.DecodeError:
            pass

    sub = await nc.subscribe(subjects.ORCHESTRATOR_STATUS, cb=on_status)
    ready = asyncio.Event()
    task = asyncio.create_task(orch.run(ready))
    await asyncio.wait_for(ready.wait(), 10)
    yield fleet, out
    orch.stop()
    await asyncio.wait_for(task, 15)
    await sub.unsubscribe()


async def test_minimums_start_and_decisions_scale_within_bounds(orchestrated, nc):
    fleet, out = orchestrated
    await fleet.until(lambda: (m := fleet.latest("steady")) is not None and m.running == 1)
    assert fleet.latest("idle").state == "scaled_to_zero"
    await nc.publish(subjects.TELEMETRY_SCALE, encode_record(ScaleDecision(
        "steady", 1, 5, 0, 0, "test", time.time(), scheduler_id="s1", max_replicas=3)))
    await fleet.until(lambda: fleet.latest("steady").running == 3)  # capped at max
    # Output prefixed with the worker's name; per-model settings resolved for each
    # worker; split: 8 cores divided between the 3 workers wanted at the first start.
    for line in (b"steady.1 | hello from steady threads 2 engine jax\n",
                 b"bad.1 | hello from bad threads 2 engine tpu\n",
                 b"bad.1 | bad configuration: TENSORBUS_ENGINE='tpu'"):
        await fleet.until(lambda: line in out.getvalue())
    await nc.publish(subjects.TELEMETRY_SCALE, encode_record(ScaleDecision(
        "idle", 0, 1, 0, 0, "test", time.time(), scheduler_id="s1")))
    await fleet.until(lambda: fleet.latest("idle").running == 1)


async def test_exit_78_fails_the_model_with_the_reason_and_is_not_restarted(orchestrated):
    fleet, _ = orchestrated
    await fleet.until(lambda: (m := fleet.latest("bad")) is not None and m.state == "failed")
    assert fleet.latest("bad").reason == \
        "bad configuration: TENSORBUS_ENGINE='tpu' for bad: use one of jax, torch"
    n = len(fleet.statuses)
    await fleet.until(lambda: len(fleet.statuses) > n + 5)
    assert fleet.starts("bad") == 1
    assert fleet.latest("steady").running == 1  # the others carry on


async def test_a_crashing_worker_is_restarted_with_growing_backoff(orchestrated):
    fleet, _ = orchestrated
    t0 = time.monotonic()
    await fleet.until(lambda: fleet.starts("crashy") >= 4, timeout=30)
    # starts at 0, again at once, then after 1 s and 2 s more
    assert time.monotonic() - t0 >= 3.0
    assert "crashes" in fleet.latest("crashy").reason or fleet.latest("crashy").state == "starting"


async def test_a_worker_that_ignores_sigterm_is_killed_at_the_drain_deadline(orchestrated, nc):
    fleet, out = orchestrated

    async def decide(n: int) -> None:
        await nc.publish(subjects.TELEMETRY_SCALE, encode_record(ScaleDecision(
            "stubborn", 0, n, 0, 0, "test", time.time(), scheduler_id="s1")))

    await decide(1)
    await fleet.until(lambda: (m := fleet.latest("stubborn")) is not None and m.running == 1)
    (wp,) = [p for p in fleet.orch.procs.values() if p.model == "stubborn"]
    await fleet.until(lambda: b"stubborn.1 | hello" in out.getvalue())  # its handler is set
    t0 = time.monotonic()
    await decide(0)
    await fleet.until(lambda: wp.returncode is not None)
    assert wp.returncode == -9 and time.monotonic() - t0 >= 1.0  # SIGKILL after 1 s
    await fleet.until(lambda: fleet.latest("stubborn").state == "scaled_to_zero")
    assert fleet.starts("stubborn") == 1  # asked to stop: not a crash, not restarted
