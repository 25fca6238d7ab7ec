"""The local orchestrator with real processes: `honcho start` on the real Procfile, a
worker SIGKILLed under load, a worker with an invalid configuration, and the way up
from zero (bench/support/orchestration.py scenarios, shortened).

One honcho stack serves the first group of tests: two encoder workers, and the demo LM
configured with an engine that does not exist (its worker exits 78)."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
from pathlib import Path

import msgspec
import pytest_asyncio

from shared import subjects
from shared.config import EX_CONFIG
from shared.errors import HEADER_CODE, HEADER_MESSAGE
from shared.telemetry import RequestRecord, record_decoder
from bench.support import faults
from bench.support import orchestration as fleet
from bench.support.load import Outcome, one
from bench.support.workload import embed_body

MODEL, DEMO_LM = fleet.MODEL, fleet.DEMO_LM
REPLACE_BOUND_S = 60.0  # measured 2.5-4.5 s on 2 busy cores (docs/benchmarks.md)


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def honcho(tmp_path_factory, jax_cache_dir):
    work = tmp_path_factory.mktemp("honcho")
    env = fleet.stack_env(work, Path(jax_cache_dir), TENSORBUS_FLEET=f"{MODEL}=2:2,{DEMO_LM}=1:1",
                          TENSORBUS_ENGINE=f"jax,{DEMO_LM}=tpu")
    async with fleet.honcho_stack(work, env, workers=2) as (h, nc):
        watch = await fleet.Watch().start(nc)
        yield h, nc, watch
        await watch.stop()


async def test_a_worker_with_an_invalid_configuration_fails_its_model_only(honcho):
    h, nc, watch = honcho
    await watch.until(lambda: (m := watch.model(DEMO_LM)) is not None and m.state == "failed")
    lm = watch.model(DEMO_LM)
    assert "TENSORBUS_ENGINE='tpu'" in lm.reason and lm.running == 0, lm
    # Not restarted: two more status rounds later there was still one start only.
    n = len(watch.statuses)
    await watch.until(lambda: len(watch.statuses) >= n + 2)
    assert len([e for e in h.events("worker_started") if e["model"] == DEMO_LM]) == 1
    assert [e["code"] for e in h.events("worker_exited") if e["model"] == DEMO_LM] == [EX_CONFIG]
    enc = watch.model(MODEL)
    assert enc.state == "ready" and enc.running == 2, enc
    assert h.alive() and h.stopped_lines() == []
    # The scheduler reads the same FleetStatus: the model's requests get 503 at once.
    body = msgspec.json.encode({"model": DEMO_LM, "prompt": "hello", "max_tokens": 4})
    msg = await nc.request(subjects.COMPLETIONS, body, timeout=5)
    assert msg.headers[HEADER_CODE] == "503", msg.headers
    assert "TENSORBUS_ENGINE='tpu'" in msg.headers[HEADER_MESSAGE]


async def test_a_killed_worker_under_honcho_loses_nothing_and_comes_back(honcho):
    h, nc, watch = honcho
    res = await fleet.kill_worker(h, nc, clients=8, before=30, after=80)
    assert res["lost"] == 0 and res["failed"] == {}, res
    assert res["succeeded"] == res["sent"]
    assert res["honcho_alive"] and res["procfile_exits"] == [], res
    assert res["other_worker_alive"] and res["restarts"] == 1, res
    assert res["replaced_s"] < REPLACE_BOUND_S, res
    await watch.until(lambda: (m := watch.model(MODEL)).state == "ready" and m.running == 2)


def test_a_malformed_fleet_stops_the_orchestrator_with_exit_78():
    env = {**os.environ, "TENSORBUS_FLEET": f"{MODEL}=2", "TENSORBUS_NATS_URL": "nats://127.0.0.1:1"}
    p = subprocess.run([sys.executable, "-m", "services.orchestrator"], env=env, cwd=fleet.REPO,
                       capture_output=True, text=True, timeout=60)
    assert p.returncode == EX_CONFIG
    assert "TENSORBUS_FLEET" in p.stderr and "MODEL=MIN:MAX" in p.stderr


# ------------------------------------------------------------------ from zero
@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def at_zero(tmp_path_factory, jax_cache_dir):
    """Gateway, scheduler and orchestrator; the encoder at minimum 0 with a short idle
    period and a low per-worker target, so that a few clients ask for a second worker."""
    work = tmp_path_factory.mktemp("zero")
    env = fleet.stack_env(work, Path(jax_cache_dir), TENSORBUS_FLEET=f"{MODEL}=0:2",
                          TENSORBUS_IDLE_TO_ZERO_S="3", TENSORBUS_SCALE_DOWN_S="3",
                          TENSORBUS_TARGET_QUEUE_PER_REPLICA="4", TENSORBUS_REQUEST_TIMEOUT_S="120")
    async with fleet.zero_stack(work, env) as (sup, nc, watch):
        yield sup, nc, watch


def _at_zero(watch) -> bool:
    m = watch.model(MODEL)
    return m is not None and m.running == 0 and m.state == "scaled_to_zero"


async def test_eight_requests_at_zero_all_answer_and_record_their_cold_start_wait(at_zero):
    sup, nc, watch = at_zero
    await watch.until(lambda: _at_zero(watch), timeout=120)
    records: list[RequestRecord] = []

    async def on_rec(msg) -> None:
        try:
            rec = record_decoder.decode(msg.data)
        except msgspec.DecodeError:
            return
        if isinstance(rec, RequestRecord):
            records.append(rec)

    sub = await nc.subscribe(subjects.TELEMETRY_REQUESTS, cb=on_rec)
    body = embed_body(MODEL, "wake up")
    outs: list[Outcome] = await asyncio.gather(*[
        one(nc, subjects.EMBEDDINGS, body, 180, {"Tensorbus-Timeout": "150"}) for _ in range(8)])
    assert [o.status for o in outs] == [200] * 8, outs
    await watch.until(lambda: len(records) >= 8, timeout=30)
    await sub.unsubscribe()
    assert all(r.status == 200 and r.hold_s > 0 for r in records[:8]), records
    # Idle again: back to zero.
    await watch.until(lambda: _at_zero(watch), timeout=120)


async def test_a_load_step_scales_one_two_one_zero_without_failing_a_request(at_zero):
    sup, nc, watch = at_zero
    await watch.until(lambda: _at_zero(watch), timeout=120)
    read = len(watch.statuses)
    running = []  # worker counts in the order they happened, repeats left out

    def seen() -> list[int]:
        nonlocal read
        for _, st in watch.statuses[read:]:
            for m in st.models:
                if m.model == MODEL and (not running or running[-1] != m.running):
                    running.append(m.running)
        read = len(watch.statuses)
        return running

    outcomes = []
    for clients, cond in ((1, lambda: 1 in seen()), (12, lambda: 2 in seen()),
                          (1, lambda: seen()[-1:] == [1])):
        lg = faults.load(nc, clients)
        lg.timeout = 180
        lg.headers = {"Tensorbus-Timeout": "150"}
        lg.start()
        await watch.until(cond, timeout=240)
        await lg.wait_for(len(lg.outcomes) + 20, timeout=240)
        outcomes += await lg.stop()
    await watch.until(lambda: _at_zero(watch) and seen()[-1:] == [0], timeout=120)
    failed = [o for o in outcomes if o.status != 200]
    assert failed == [], failed
    print("worker counts:", running, "requests:", len(outcomes))
    assert 0 in running and 2 in running, running
    # 0 -> 1 -> 2 -> 1 -> 0 with at most a little noise on the way: no flapping.
    assert len(running) <= 7, running


async def test_sigterm_drains_the_workers_and_the_orchestrator_exits_0(at_zero):
    """Last in this module: it stops the stack's orchestrator."""

    sup, nc, watch = at_zero
    o = await one(nc, subjects.EMBEDDINGS, embed_body(MODEL, "stay a while"), 180,
                  {"Tensorbus-Timeout": "150"})
    assert o.status == 200
    orch = sup.procs["orchestrator"]
    orch.signal(signal.SIGTERM)
    assert await asyncio.to_thread(orch.wait, 60) == 0
    log = orch.log_path.read_text()
    assert '"event": "stopped"' in log  # the worker drained and said so
    assert '"outcome": "stopped"' in log and '"outcome": "crashed"' not in log
    last = watch.model(MODEL)
    assert last.running == 0 and last.reason == "orchestrator stopped", last
