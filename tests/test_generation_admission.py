"""Generation admitted by work (shared.admission's GenCost, GenCostBook, check_generation,
through services.scheduler.admission), without NATS: a real Fleet fed decoder
heartbeats that carry a known cost, requests as they arrive on the wire, and the errors
a client would get."""

from __future__ import annotations

import asyncio
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from services.fleet import Fleet
from services.scheduler.admission import Admission
from services.scheduler.holds import Holds
from services.scheduler.loads import LoadReports
from services.worker.generation import DecoderRunner
from services.worker.versions import LoadedModels
from shared.admission import LoadBoard
from shared.costs import Cost, GenCost, GenCostBook
from shared.config import Config
from shared.errors import ServiceError
from shared.messages import GenerateWork, Sampling
from shared.telemetry import Heartbeat
from tests.services.test_worker_runner import Recorder
from tests.services.test_worker_warmup import TimedDecoder
from tests.support.stack import wait_until

M = "lm"
SLOTS = 4
PREFILL_PER_TOKEN = 1e-3  # engine seconds per prompt token
STEP_S = 0.05  # engine seconds of one decode step, whatever it holds (memory-bound)
COST = GenCost(Cost(0.0, PREFILL_PER_TOKEN), Cost(STEP_S, 0.0))


def heartbeat(worker_id: str = "w0", cost: GenCost | None = COST, running: int = 0,
              length: float = 0.0) -> Heartbeat:
    hb = Heartbeat(worker_id=worker_id, model=M, kind="decoder", state="ready", versions=["1"],
                   queue_depth=0, in_flight=running, max_batch=SLOTS, batch_occupancy=0.0,
                   steps=1, rss_bytes=0, device="cpu", sent_at=time.time())
    if cost is not None:
        hb.prefill_per_chunk, hb.prefill_per_token = cost.prefill.per_batch, cost.prefill.per_token
        hb.decode_per_step, hb.decode_per_row = cost.decode.per_batch, cost.decode.per_token
        hb.decode_length = length
    return hb


def scheduler(cost: GenCost | None = COST, **config) -> Admission:
    # 512-token prompt chunks (the figures below count the steps between them); a
    # CPU worker's default, 128, is read from its heartbeat when this is 0.
    cfg = Config.from_env({}, **{"max_queue_per_worker": 256, "max_queue_s": 5.0,
                                 "worker_expiry_s": 60.0, "prefill_chunk": 512, **config})
    fleet = Fleet(expiry_s=60.0)
    fleet.observe(heartbeat(cost=cost))
    return Admission(cfg, "s1", fleet, held=Holds(cfg.max_queue_per_worker).tally)


def gen(rid: str, prompt: int = 100, max_tokens: int = 500, left_s: float = 30.0,
        n: int = 1) -> GenerateWork:
    return GenerateWork(rid, M, "", [1] * prompt, max_tokens, Sampling(), [], n, False,
                        time.time() + left_s, "inbox")


def refused(fn, *args) -> ServiceError:
    with pytest.raises(ServiceError) as err:
        fn(*args)
    return err.value


def test_a_burst_of_long_generations_is_refused_beyond_the_bound_with_seconds_to_wait():
    """Four slots, each of the burst's generations 500 tokens long (25 s of steps): the
    fifth would wait for a slot behind a whole wave of them, far past the 5 s bound
    (the count bound, 256, would have queued it)."""
    adm = scheduler()
    admitted = []
    for i in range(SLOTS):
        work = gen(f"g{i}")
        assert adm.admit(work)
        adm.dispatched(work)
        admitted.append(work)
    err = refused(adm.admit, gen("fifth"))
    assert err.status == 429 and "capacity" in err.message
    # A wave of 500 steps (25 s) ahead, the prompts ahead (0.4 s) and a step between
    # their chunks, its own prompt (0.1 s) and a step beside it, less the 5 s bound.
    assert err.retry_after == pytest.approx(25 + 0.4 + 0.05 + 0.1 + 0.05 - 5, abs=0.1)
    # Once the workers report those sequences running, their prompts are no longer
    # ahead: the wait is the wave's.
    adm.fleet.observe(heartbeat(running=SLOTS))
    err = refused(adm.admit, gen("later", max_tokens=8))
    assert err.retry_after == pytest.approx(25 + 0.1 + 0.05 - 5, abs=0.1)
    adm.finished(admitted[0])  # one finishes: a slot is free, nothing to wait for
    assert adm.admit(gen("now"))


def test_generations_that_stop_early_shorten_the_wait_for_a_slot():
    """The same burst, but the worker's recent sequences generated a tenth of their
    max_tokens: a wave is 2.5 s, and the fifth fits the 5 s bound."""
    adm = scheduler()
    adm.fleet.observe(heartbeat(length=0.1))
    for i in range(SLOTS):
        adm.dispatched(gen(f"g{i}"))
    assert adm.admit(gen("fifth"))
    book = GenCostBook()
    book.learn(COST)
    assert book.cost().length == 1.0  # none finished: max_tokens, the upper bound
    for _ in range(100):
        book.finished(50, 500)
    assert book.cost().length == pytest.approx(0.1)


def test_short_generations_beyond_the_slots_wait_their_turn_within_the_bound():
    """Generations of 16 tokens: a wave of four slots is 0.8 s, so four running and
    five waves waiting (24) fit the 5 s bound; the 25th, six waves behind, does not."""
    adm = scheduler()
    n = 0
    while n < 100:
        work = gen(f"g{n}", prompt=10, max_tokens=16)
        try:
            adm.admit(work)
        except ServiceError as err:
            assert err.status == 429 and err.retry_after > 0
            break
        adm.dispatched(work)
        n += 1
    assert n == 24


def test_a_prompt_that_cannot_be_computed_before_its_deadline_is_refused_at_once():
    adm = scheduler(max_queue_s=60.0)
    err = refused(adm.admit, gen("long", prompt=10_000, left_s=10.0))  # 10 s of prefill, 5 allowed
    assert err.status == 429 and "prompt" in err.message and "deadline" in err.message
    assert err.retry_after == pytest.approx(5.0, abs=0.2)
    assert adm.admit(gen("given-time", prompt=10_000, left_s=30.0))  # 10 s of 15 allowed
    # Behind other prompts: 10 of 1,000 tokens ahead (10 s), a 1 s prompt, 20 s to live.
    for i in range(10):
        adm.dispatched(gen(f"r{i}", prompt=1_000, max_tokens=4))
    err = refused(adm.admit, gen("behind", prompt=1_000, left_s=20.0, max_tokens=4))
    assert err.status == 429 and "deadline" in err.message


def test_before_any_step_is_timed_the_warmup_cost_is_used():
    """A fresh worker's heartbeat carries the cost its warm-up timed: the scheduler
    decides by it at once. A worker that timed nothing leaves the count bound alone."""
    untimed = scheduler(cost=None, max_queue_per_worker=2)
    assert untimed.admit(gen("long", prompt=10_000, left_s=10.0))  # no work bound to apply
    untimed.dispatched(gen("a"))
    untimed.dispatched(gen("b"))
    assert "capacity" in refused(untimed.admit, gen("c")).message
    timed = scheduler()
    assert refused(timed.admit, gen("long", prompt=10_000, left_s=10.0)).status == 429

    # The worker's own book: the warm-up's cost until its steps are timed, then theirs.
    book = GenCostBook()
    assert book.cost() is None
    book.learn(COST)
    assert book.cost().decode.per_batch == pytest.approx(STEP_S)
    assert book.cost().prefill.per_token == pytest.approx(PREFILL_PER_TOKEN)
    for _ in range(40):  # steps cost 20 ms + 5 ms a sequence, at one and at four sequences
        book.observe(0.025, 0, 0, 1)
        book.observe(0.040, 0, 0, 4)
    step = book.cost().decode
    assert step.per_batch + step.per_token * 4 == pytest.approx(0.040, rel=0.1)
    assert step.per_batch + step.per_token == pytest.approx(0.025, rel=0.1)
    for _ in range(40):  # a chunk of 256 tokens beside a step of four: 0.040 + 0.512 s
        book.observe(0.552, 256, 1, 4)
        book.observe(0.040 + 0.128, 64, 1, 4)
    assert book.cost().prefill.per_token == pytest.approx(2e-3, rel=0.15)


def test_the_tokens_to_generate_reach_the_other_schedulers():
    adm = scheduler()
    adm.dispatched(gen("g", max_tokens=300, n=2))
    report = LoadReports(None, "s1", adm, Holds(256), interval_s=0.5).report()
    (load,) = report.models
    assert (load.requests, load.inputs, load.tokens, load.decode) == (1, 2, 100, 600)
    board = LoadBoard("s2")
    board.observe(report, time.monotonic())
    assert board.total(M, time.monotonic()).decode == 600


def test_decode_seconds_are_shared_by_the_sequences_of_a_step():
    cost = GenCost(Cost(0.01, 1e-3), Cost(0.04, 0.01))
    assert cost.step_s(1) == pytest.approx(0.05)
    assert cost.decode_s(100, 1) == pytest.approx(5.0)  # one stream pays every step
    assert cost.decode_s(100, 4) == pytest.approx(100 * 0.08 / 4)  # four share each
    assert cost.prefill_s(1, 1000, 512) == pytest.approx(2 * 0.01 + 1.0)  # two chunks


async def test_the_worker_refits_the_cost_from_its_own_steps():
    """Its warm-up said a step costs twice what its steps then take (20 ms): the cost
    its heartbeats carry follows the steps."""
    engine = TimedDecoder()
    out = Recorder()
    runner = DecoderRunner(LoadedModels(engine, "1", kind="decoder"), out, ThreadPoolExecutor(1),
                           prefill_per_step=4)
    runner.costs.learn(GenCost(Cost(0.005, 1e-3), Cost(0.04, 0.0)))
    task = asyncio.create_task(runner.run())
    try:
        for rid in ("a", "b"):
            runner.submit(GenerateWork(rid, "mock-lm", "", [3] * 8, 40, Sampling(temperature=0),
                                       [], 1, False, time.time() + 30, f"reply.{rid}", "sched"))
        await wait_until(lambda: {"a", "b"} <= set(out.finished), timeout=20)
    finally:
        task.cancel()
    assert runner.costs.cost().step_s(2) == pytest.approx(0.02, rel=0.5)


def test_a_cpu_workers_default_chunk_counts_a_step_per_128_prompt_tokens():
    """TENSORBUS_PREFILL_CHUNK=0: the scheduler counts the chunks a CPU worker computes
    (128 tokens, read from the heartbeat's device): the 400 prompt tokens ahead take
    four decode steps between their chunks, not one."""
    adm = scheduler(prefill_chunk=0)
    for i in range(SLOTS):
        work = gen(f"g{i}")
        assert adm.admit(work)
        adm.dispatched(work)
    err = refused(adm.admit, gen("fifth"))
    assert err.retry_after == pytest.approx(25 + 0.4 + 4 * 0.05 + 0.1 + 0.05 - 5, abs=0.1)

