"""Admission by work: the queue bound and Retry-After are in estimated compute (tokens x
the model's measured cost per token), a request that cannot finish before its own
deadline is refused at once instead of timing out in the queue, and several
schedulers share one bound. Engines that do no math with a known cost per token or
per batch (bench.nomath), a real nats-server, the services in one event loop."""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections import Counter

import msgspec
import nats
import pytest

from services.gateway.service import Gateway
from services.scheduler.service import Scheduler
from shared import catalog, subjects
from bench.support.load import LOST, one
from bench.support.mock_encoder import MockEncoder
from tests.support.stack import running_stack, wait_until
from tests.support.bus import connect as bus_connect


@contextlib.asynccontextmanager
async def second_gateway(url: str, config, front=None):
    """Another gateway on the same bus (`front(nc, config)`: its own Frontend), stopped
    however the test ends: one left running would answer the next tests' requests."""
    nc = await bus_connect(url, name="gateway-2")
    gw = Gateway(nc, config, front(nc, config) if front else None, http=False)
    ready = asyncio.Event()
    task = asyncio.create_task(gw.run(ready))
    try:
        await ready.wait()
        yield gw
    finally:
        gw.stop()
        await asyncio.gather(task, return_exceptions=True)
        await nc.close()


def patient_reserves(monkeypatch) -> None:
    """Gateways wait for a Reserve's answer as long as the test may take. A scheduler
    that does not answer in 1 s lets the request go on unreserved (decided at its
    submit), by design; the in-process scheduler shares this process's event loop,
    which a loaded machine stalls past that second, and these tests are about the
    reservation."""
    from services.gateway import admission

    monkeypatch.setattr(admission, "RESERVE_TIMEOUT_S", 30.0)

MODEL = catalog.ENCODER
SLOW = "slow-encoder"  # the same tokenizer, a slower engine


def body(model: str = MODEL, inputs: int = 1) -> bytes:
    return msgspec.json.encode({"model": model, "input": ["hello world"] * inputs})  # 4 tokens each


async def call(nc, model: str = MODEL, inputs: int = 1, timeout_s: float | None = None):
    headers = {"Tensorbus-Timeout": f"{timeout_s:g}"} if timeout_s else None
    return await one(nc, subjects.EMBEDDINGS, body(model, inputs), (timeout_s or 30) + 5, headers)


async def measured(st, model: str = MODEL, sizes: tuple[int, ...] = (1,)) -> float:
    """Requests of `sizes` inputs, one at a time, until the scheduler has timed each
    size once; its mean cost per token."""
    for inputs in sizes * 2:
        assert (await call(st.client, model, inputs)).status == 200
    await wait_until(lambda: st.scheduler.admission.costs.per_token(model))
    return st.scheduler.admission.costs.per_token(model)


class Held:
    """Wraps a real engine; `gate` holds its batches (the warm-up's timing runs first)."""

    def __init__(self, inner) -> None:
        self.inner = inner
        self.gate = threading.Event()
        self.gate.set()

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def embed(self, inputs):
        self.gate.wait()
        return self.inner.embed(inputs)


async def test_the_first_burst_after_a_start_is_served_whole(nats_server, minilm):
    """Both workers timed the engine at warm-up, so the scheduler knows the model's
    cost before any request: a burst that arrives before any batch has finished is
    admitted by its work (all of it fits), not refused by a count of batches (two of
    64 inputs per worker: 144 of these 400 were refused so)."""
    engine = Held(minilm)
    async with running_stack(nats_server.url) as st:
        for wid in ("enc-fresh-1", "enc-fresh-2"):
            await st.add_worker(engine, wid, time_warmup=True)
        assert st.scheduler.admission.costs.cost(MODEL) is not None  # before any request
        engine.gate.clear()  # no batch finishes until every request is admitted or refused
        tasks = [asyncio.create_task(call(st.client)) for _ in range(400)]
        await wait_until(lambda: sum(t.done() for t in tasks) + len(st.scheduler.outstanding)
                         == len(tasks))
        engine.gate.set()
        outcomes = await asyncio.gather(*tasks)
        assert Counter(o.status for o in outcomes) == {200: 400}


async def test_a_burst_far_above_capacity_is_answered_with_no_504(nats_server):
    engine = MockEncoder(max_batch=16, per_batch_s=0.2)  # 16 inputs per 200 ms
    async with running_stack(nats_server.url, max_batch=16) as st:
        await st.add_worker(engine, "enc-burst")
        await measured(st, sizes=(1, 16))  # a batch costs 200 ms whatever its size
        # 150 requests of 4 inputs, each with 2 s to live: the engine finishes about 40.
        # The in-process stack runs gateway, scheduler and worker on one event loop,
        # whose work per request the engine's measured cost does not hold: a slow
        # engine and a burst of 150 (not 300 of a 50 ms engine) keep that share small
        # on a loaded machine, where the larger burst met 504s.
        outcomes = await asyncio.gather(*(call(st.client, inputs=4, timeout_s=2.0)
                                          for _ in range(150)))
        codes = Counter(o.status for o in outcomes)
        assert set(codes) <= {200, 429} and LOST not in codes, codes  # no 504, nothing lost
        assert codes[200] >= 8 and codes[429] >= 80, codes
        refused = [o for o in outcomes if o.status == 429]
        assert all(o.retry_after and o.retry_after > 0 for o in refused)
        # Refusals are decided on arrival, not after waiting in a queue.
        assert max(o.took for o in refused) < 0.5 * 2.0
        after = await call(st.client, inputs=4, timeout_s=1.0)  # normal service at once
        assert after.status == 200


async def test_the_bound_follows_the_measured_cost(nats_server):
    fast = MockEncoder(MODEL, per_token_s=0.001)
    slow = MockEncoder(SLOW, per_token_s=0.004)
    models = {SLOW: str(catalog.bundled_dir(MODEL))}
    async with running_stack(nats_server.url, models=models, max_queue_s=0.5) as st:
        await st.add_worker(fast, "enc-fast")
        await st.add_worker(slow, "enc-slow")
        cost = {m: await measured(st, m) for m in (MODEL, SLOW)}
        # 4x by their sleeps; a busy machine adds a fixed overhead to each request,
        # which narrows the measured ratio: the bounds below follow what was measured.
        assert 1.5 < cost[SLOW] / cost[MODEL] < 6, cost
        fast.gate.clear()
        slow.gate.clear()
        tasks = [asyncio.create_task(call(st.client, m)) for m in (MODEL, SLOW) for _ in range(200)]
        done = [t for t in tasks]

        def settled() -> bool:  # every request refused or dispatched
            refused = sum(1 for t in done if t.done())
            return refused + len(st.scheduler.outstanding) == len(tasks)

        await wait_until(settled)
        admitted = Counter(o.work.model for o in st.scheduler.outstanding.values())
        # About 0.5 s of work each: 125 fast requests, 31 slow ones (quiet machine).
        assert admitted[SLOW] < admitted[MODEL] / 1.5, admitted
        for m in (MODEL, SLOW):
            expect = 0.5 / (4 * cost[m])
            assert 0.7 * expect <= admitted[m] <= expect + 2, (m, admitted, cost)
        fast.gate.set()
        slow.gate.set()
        codes = Counter(o.status for o in await asyncio.gather(*tasks))
        assert codes[200] == sum(admitted.values()) and set(codes) == {200, 429}, codes


async def test_a_request_that_cannot_meet_its_deadline_is_refused_at_once(nats_server):
    engine = MockEncoder(per_token_s=0.01)  # 40 ms per 4-token request
    async with running_stack(nats_server.url) as st:
        await st.add_worker(engine, "enc-deadline")
        await measured(st)
        engine.gate.clear()
        queued = [asyncio.create_task(call(st.client)) for _ in range(10)]  # ~0.4 s of work
        await wait_until(lambda: len(st.scheduler.outstanding) == 10)
        late = await call(st.client, timeout_s=0.3)
        assert late.status == 429 and late.retry_after and late.retry_after >= 0.1
        assert not engine.gate.is_set()  # refused while the work ahead was still held
        fits = asyncio.create_task(call(st.client, timeout_s=10))
        await wait_until(lambda: len(st.scheduler.outstanding) == 11)
        engine.gate.set()
        assert [o.status for o in await asyncio.gather(*queued, fits)] == [200] * 11


async def test_two_schedulers_share_one_bound(nats_server):
    engine = MockEncoder(per_token_s=0.001)  # 4 ms per request
    async with running_stack(nats_server.url, max_queue_s=0.2) as st:
        nc = await bus_connect(nats_server.url, name="scheduler-2")
        second = Scheduler(nc, st.config, scheduler_id="second")
        ready = asyncio.Event()
        task = asyncio.create_task(second.run(ready))
        try:
            await ready.wait()
            await st.add_worker(engine, "enc-shared")
            await wait_until(lambda: second.fleet.available(MODEL))
            both = (st.scheduler, second)
            # The gateway refuses early from its own count of what it sent; with it off,
            # what is admitted is the schedulers' doing alone.
            st.gateway.front.admission.shed_by_work = lambda model, deadline, *size: None
            for _ in range(60):  # both have timed the model (directly or from the other)
                await call(st.client)
                if all(s.admission.costs.per_token(MODEL) for s in both):
                    break
            engine.gate.clear()
            # 300 requests at 200/s: one load interval (heartbeat_s = 0.1) is 20 arrivals.
            rate, n = 200.0, 300
            tasks = []
            for i in range(n):
                tasks.append(asyncio.create_task(call(st.client)))
                await asyncio.sleep(1 / rate)  # the arrival rate, not synchronisation
            await wait_until(lambda: sum(t.done() for t in tasks)
                             + sum(len(s.outstanding) for s in both) == n)
            admitted = [len(s.outstanding) for s in both]
            bound = max(0.2 / (4 * s.admission.costs.per_token(MODEL)) for s in both)
            one_interval = rate * st.config.heartbeat_s
            assert all(admitted), admitted  # both took traffic
            # One bound for both, not two: exceeded by at most one interval's arrivals.
            assert sum(admitted) <= bound + one_interval + 2, (admitted, bound)
            engine.gate.set()
            codes = Counter(o.status for o in await asyncio.gather(*tasks))
            assert codes[200] == sum(admitted) and set(codes) == {200, 429}, codes
        finally:
            engine.gate.set()
            second.stop()
            await asyncio.gather(task, return_exceptions=True)
            await nc.close()


async def test_the_schedulers_load_reaches_the_gateways_as_it_moves(nats_server):
    """Gateways count the schedulers' work from their load reports. One heartbeat
    interval apart, they are too old for a burst: a gateway that has not heard one
    lets through what a scheduler then refuses (a round trip each, and with several
    gateways most of a burst), and after an overload refuses for up to an interval
    after room came back. A scheduler reports within EARLY_REPORT_S of its load
    moving, either way."""
    from shared.config import Config
    from shared.messages import (EmbedWork, WorkDone, WorkError, encode, result_decoder,
                                 sched_load_decoder)
    from shared.telemetry import Heartbeat
    from shared.telemetry import encode as encode_record

    # Reports every 30 s: any report within this test came early.
    config = Config.from_env({}, nats_url=nats_server.url, heartbeat_s=30.0,
                             worker_expiry_s=120.0, max_queue_per_worker=2)
    snc = await bus_connect(nats_server.url, name="scheduler-early")
    nc = await bus_connect(nats_server.url, name="gateway-and-worker")
    sched = Scheduler(snc, config, scheduler_id="early")
    ready = asyncio.Event()
    task = asyncio.create_task(sched.run(ready))
    try:
        await ready.wait()
        counts, answers, dispatched = [], [], []

        async def report(msg):
            for m in sched_load_decoder.decode(msg.data).models:
                if m.model == MODEL:
                    counts.append(m.requests)

        async def answer(msg):
            answers.append(result_decoder.decode(msg.data))

        async def work(msg):  # this test plays the worker too
            dispatched.append(msg)

        await nc.subscribe(subjects.SCHED_LOAD, cb=report)
        await nc.subscribe(subjects.worker_work("w-early"), cb=work)
        inbox = nc.new_inbox()
        await nc.subscribe(inbox, cb=answer)
        hb = Heartbeat(worker_id="w-early", model=MODEL, kind="encoder", state="ready",
                       versions=["local"], queue_depth=0, in_flight=0, max_batch=32,
                       batch_occupancy=0.0, steps=1, rss_bytes=0, device="cpu",
                       sent_at=time.time())  # fmt: skip
        await nc.publish(subjects.TELEMETRY_WORKERS, encode_record(hb))
        await wait_until(lambda: sched.fleet.available(MODEL))
        for i in range(3):  # the bound is two: the third is refused
            w = EmbedWork(f"early-{i}", MODEL, "", [[101, 7592, 102]], time.time() + 30, inbox)
            await nc.publish(subjects.SCHED_SUBMIT, encode(w))
        await wait_until(lambda: answers and len(dispatched) == 2)
        [refused] = answers
        assert isinstance(refused, WorkError) and refused.status == 429
        await wait_until(lambda: counts and counts[-1] == 2, timeout=10.0)  # not in 30 s
        done = WorkDone("w-early", ["early-0", "early-1"])
        await nc.publish(subjects.sched_done("early"), encode(done))
        await wait_until(lambda: counts[-1] == 0, timeout=10.0)  # room back, said at once
    finally:
        sched.stop()
        await asyncio.gather(task, return_exceptions=True)
        await nc.close()
        await snc.close()


async def test_large_requests_are_refused_while_those_ahead_still_tokenize(nats_server):
    """A body above the inline limit is tokenized off the event loop; meanwhile the
    gateway reads the requests behind it, which must count it as work ahead (its size
    estimated from its characters) and be refused at once, not wait behind the
    tokenizer for the scheduler to refuse them."""
    import threading

    from bench.support.workload import long_inputs

    engine = MockEncoder(per_token_s=0.0002)  # ~0.1 s for 4 inputs of ~120 tokens
    texts = long_inputs(64)
    big = [msgspec.json.encode({"model": MODEL, "input": texts[4 * i:4 * i + 4]})
           for i in range(16)]
    assert min(map(len, big)) > 2_048  # tokenized in a thread
    async with running_stack(nats_server.url, max_queue_s=0.5) as st:
        await st.add_worker(engine, "enc-tokenizing")
        await measured(st)
        front = st.gateway.front
        await wait_until(lambda: any(r.cost.per_token for _, r in front.admission.loads.others(
            MODEL, time.monotonic())))  # the gateway has heard the scheduler's estimate
        entry = await front.models.get(MODEL)
        gate, tokenized = threading.Event(), []
        encode = entry.tokenizer.encode_batch

        def held(texts, *a, **kw):  # the tokenizer, made slow until the test opens it
            gate.wait()
            tokenized.append(len(texts))
            return encode(texts, *a, **kw)

        entry.tokenizer.encode_batch = held
        try:
            tasks = [asyncio.create_task(one(st.client, subjects.EMBEDDINGS, big[i % 16], 35))
                     for i in range(60)]
            # Refused before any of them was tokenized: the work ahead is the estimate.
            await wait_until(lambda: sum(t.done() for t in tasks) >= 45)
            assert not tokenized
            early = [t.result() for t in tasks if t.done()]
            assert {o.status for o in early} == {429}, Counter(o.status for o in early)
            assert all(o.retry_after and o.retry_after > 0 for o in early)
        finally:
            gate.set()
            del entry.tokenizer.encode_batch
        codes = Counter(o.status for o in await asyncio.gather(*tasks))
        assert set(codes) <= {200, 429} and codes[200] >= 1, codes



async def test_two_gateways_bursts_meet_one_bound_before_tokenizing(nats_server, monkeypatch):
    """Two gateways each count their own work ahead; in a burst's first milliseconds
    neither has heard of the other's. A large body is admitted by the scheduler by its
    estimated size before it is tokenized (a reservation), so the excess is refused
    then, and nothing that waited for the tokenizer is refused after it."""
    import threading

    from bench.support.workload import long_inputs

    patient_reserves(monkeypatch)
    engine = MockEncoder(per_token_s=0.0002)  # ~0.1 s for 4 inputs of ~120 tokens
    texts = long_inputs(64)
    big = [msgspec.json.encode({"model": MODEL, "input": texts[4 * i:4 * i + 4]})
           for i in range(16)]
    async with running_stack(nats_server.url, max_queue_s=0.5) as st, \
            second_gateway(nats_server.url, st.config) as second:
        gate, tokenized, held = threading.Event(), [], {}
        try:
            await st.add_worker(engine, "enc-two-gateways")
            await measured(st)
            fronts = (st.gateway.front, second.front)
            await wait_until(lambda: all(f.fleet.ready(MODEL) and any(
                r.cost.per_token for _, r in f.admission.loads.others(MODEL, time.monotonic()))
                for f in fronts))  # both have heard the worker and the scheduler's estimate
            for f in fronts:
                tok = (await f.models.get(MODEL)).tokenizer
                encode = tok.encode_batch

                def slow(texts, *a, _encode=encode, **kw):  # held until the test opens it
                    gate.wait()
                    tokenized.append(len(texts))
                    return _encode(texts, *a, **kw)

                held[id(tok)] = tok
                tok.encode_batch = slow
            tasks = [asyncio.create_task(one(st.client, subjects.EMBEDDINGS, big[i % 16], 35))
                     for i in range(120)]
            sched = st.scheduler
            # Every request refused or given room while no tokenizer has run.
            await wait_until(lambda: sum(t.done() for t in tasks)
                             + len(sched.admission.reservations) == len(tasks))
            assert not tokenized
            early = Counter(t.result().status for t in tasks if t.done())
            assert set(early) == {429}, early
            reserved = len(sched.admission.reservations)
            per_request = sched.admission.costs.cost(MODEL).seconds(4, 4 * 120, 32)
            assert 1 <= reserved <= 0.5 / per_request + 2, (reserved, per_request)
        finally:
            gate.set()
            for tok in held.values():
                del tok.encode_batch
        codes = Counter(o.status for o in await asyncio.gather(*tasks))
        # What was given room was answered: none refused after its tokenizing.
        assert codes[200] == reserved and set(codes) == {200, 429}, codes
        assert not sched.admission.reservations  # each became its work


async def test_a_reserved_request_that_fails_to_tokenize_gives_its_room_back(nats_server):
    from bench.support.workload import long_inputs

    engine = MockEncoder(per_token_s=0.0002)
    texts = long_inputs(4)
    bad = msgspec.json.encode({"model": MODEL, "input": texts[:3] + ["a NUL \x00 here"]})
    assert len(bad) > 2_048  # the large path: reserved, then tokenized in a thread
    async with running_stack(nats_server.url) as st:
        await st.add_worker(engine, "enc-unreserve")
        await measured(st)
        await wait_until(lambda: st.gateway.front.fleet.ready(MODEL))
        made, reserve = [], st.scheduler.admission.reserve
        st.scheduler.admission.reserve = lambda req: made.append(reserve(req)) or made[-1]
        out = await one(st.client, subjects.EMBEDDINGS, bad, 10)
        assert out.status == 400 and made == [st.scheduler.id]  # room taken, then...
        await wait_until(lambda: not st.scheduler.admission.reservations)  # ...given back at once
        assert st.scheduler.admission.tally[MODEL].requests == 0
        assert (await call(st.client)).status == 200


async def test_a_reserved_request_is_not_refused_when_the_estimate_moves(nats_server):
    """Admitted before its tokenizing is admitted: the cost estimate may move while it
    waits for the tokenizer (one slow batch in a burst did), and its submit is not
    checked again. A request arriving after the move is judged by the new estimate."""
    import threading

    from bench.support.workload import long_inputs
    from shared.costs import Cost, CostBook

    engine = MockEncoder(per_token_s=0.0002)
    texts = long_inputs(8)
    big = [msgspec.json.encode({"model": MODEL, "input": texts[4 * i:4 * i + 4]}) for i in range(2)]
    async with running_stack(nats_server.url) as st:
        await st.add_worker(engine, "enc-moved")
        await measured(st)
        front, sched = st.gateway.front, st.scheduler
        await wait_until(lambda: front.fleet.ready(MODEL))
        tok = (await front.models.get(MODEL)).tokenizer
        gate, encode = threading.Event(), tok.encode_batch

        def held(texts, *a, **kw):
            gate.wait()
            return encode(texts, *a, **kw)

        tok.encode_batch = held
        try:
            first = asyncio.create_task(one(st.client, subjects.EMBEDDINGS, big[0], 30))
            await wait_until(lambda: len(sched.admission.reservations) == 1)  # admitted, tokenizing
            # The estimate moves a thousandfold: ~500 s of work for a request of 30 s.
            sched.admission.costs = CostBook()
            sched.admission.costs.learn(MODEL, Cost(0.0, 1.0))
        finally:
            gate.set()
            del tok.encode_batch
        assert (await first).status == 200
        later = await one(st.client, subjects.EMBEDDINGS, big[1], 30)
        assert later.status == 429, later
        assert not sched.admission.reservations


async def test_a_reservation_whose_work_never_comes_expires(nats_server):
    from services.scheduler.admission import RESERVATION_S
    from shared.messages import Reserve

    engine = MockEncoder(per_token_s=0.0002)
    async with running_stack(nats_server.url) as st:
        await st.add_worker(engine, "enc-expiry")
        await measured(st)
        sched = st.scheduler
        # The measuring requests leave the tally when the worker's done reaches the
        # scheduler, which may be after their replies: start from nothing outstanding.
        await wait_until(lambda: sched.admission.ahead(MODEL).requests == 0)
        before = sched.admission.ahead(MODEL).tokens
        rid = sched.admission.reserve(Reserve("gone-gateway", MODEL, "", 4, 400, time.time() + 30))
        assert rid == sched.id and sched.admission.ahead(MODEL).tokens == before + 400
        held = sched.admission.reservations["gone-gateway"]
        assert held.expires - time.monotonic() == pytest.approx(RESERVATION_S, abs=1.0)
        sched.admission.reservations["gone-gateway"] = held._replace(expires=time.monotonic())
        await wait_until(lambda: not sched.admission.reservations)  # housekeeping drops it
        assert sched.admission.ahead(MODEL).tokens == before


async def test_work_whose_reservation_lapsed_is_checked_on_arrival(nats_server):
    """A reservation is room held for RESERVATION_S. Work that arrives after its room
    was dropped (its gateway stalled past it) is judged as any other arrival, not
    dispatched on a promise the scheduler no longer keeps."""
    from shared.costs import Cost, CostBook
    from shared.messages import EmbedWork, Reserve, WorkError, encode, result_decoder

    engine = MockEncoder(per_token_s=0.0002)
    async with running_stack(nats_server.url) as st:
        await st.add_worker(engine, "enc-lapsed")
        await measured(st)
        sched, adm = st.scheduler, st.scheduler.admission
        for rid in ("kept", "lapsed"):
            assert adm.reserve(Reserve(rid, MODEL, "", 1, 3, time.time() + 30)) == sched.id
        adm.reservations["lapsed"] = adm.reservations["lapsed"]._replace(expires=time.monotonic())
        await wait_until(lambda: "lapsed" not in adm.reservations)  # housekeeping
        # From now on any work is far beyond its deadline: ~1,000 s a token.
        sched.admission.costs = CostBook()
        sched.admission.costs.learn(MODEL, Cost(0.0, 1000.0))
        answers: dict[str, object] = {}

        async def answer(msg):
            res = result_decoder.decode(msg.data)
            answers[res.request_id] = res

        inbox = st.client.new_inbox()
        await st.client.subscribe(inbox, cb=answer)
        for rid in ("kept", "lapsed"):
            work = EmbedWork(rid, MODEL, "", [[101, 7592, 102]], time.time() + 30, inbox,
                             reserved=sched.id)
            await st.client.publish(subjects.sched_submit(sched.id), encode(work))
        await wait_until(lambda: len(answers) == 2)
        assert not isinstance(answers["kept"], WorkError), answers["kept"]  # its room held
        assert isinstance(answers["lapsed"], WorkError) and answers["lapsed"].status == 429


async def test_two_gateways_bursts_of_long_prompts_meet_one_count_bound_before_tokenizing(
        nats_server, tmp_path, jax_cache_dir, monkeypatch):
    """Completions are admitted by count. A long prompt (a body above the inline limit)
    is tokenized in a thread, behind others; two gateways each count only their own.
    A scheduler admits it by count before its tokenizing (a reservation), so a burst
    through both gateways meets one bound there, and nothing that waited for the
    tokenizer is refused after it."""
    import threading

    from services.fleet import Fleet
    from services.gateway.frontend import Frontend
    from services.gateway.models import ModelTable
    from tests.support.stack import table_resolver
    from tests.support.tiny_models import serve_tiny

    patient_reserves(monkeypatch)
    _, engine = serve_tiny("gpt2", tmp_path, "tiny-reserved", 1024)
    models = {engine.name: str(tmp_path)}
    prompt = [100 + i % 200 for i in range(600)]  # 600 token ids: a body of ~2.4 KB
    body = msgspec.json.encode({"model": engine.name, "prompt": prompt, "max_tokens": 2})
    assert len(body) > 2_048  # rendered in a thread
    bound = 4  # requests queued per ready worker

    def front(nc, config):
        fleet = Fleet(expiry_s=config.worker_expiry_s)
        return Frontend(nc, config, fleet, ModelTable(fleet, table_resolver(models)))

    async with running_stack(nats_server.url, models=models, max_context=1024,
                             decode_slots=4, max_queue_per_worker=bound) as st, \
            second_gateway(nats_server.url, st.config, front) as second:
        gate, rendered = threading.Event(), []
        fronts = (st.gateway.front, second.front)
        try:
            await st.add_worker(engine, "dec-reserved", kind="decoder")
            await wait_until(lambda: all(f.fleet.ready(engine.name) for f in fronts))
            for f in fronts:
                tokenize = f.tokenize

                async def held(fn, *args, _tokenize=tokenize):
                    def wait_then(*a):  # in the tokenizing thread, until the test opens it
                        gate.wait()
                        rendered.append(1)
                        return fn(*a)

                    return await _tokenize(wait_then, *args)

                f.tokenize = held
            tasks = [asyncio.create_task(one(st.client, subjects.COMPLETIONS, body, 60))
                     for _ in range(24)]
            sched = st.scheduler
            # Every request refused or given room while no prompt has been rendered.
            await wait_until(lambda: sum(t.done() for t in tasks)
                             + len(sched.admission.reservations) == len(tasks))
            assert not rendered
            early = Counter(t.result().status for t in tasks if t.done())
            assert set(early) == {429}, early
            reserved = len(sched.admission.reservations)
            assert 1 <= reserved <= bound, reserved  # one bound, not one per gateway
        finally:
            gate.set()
            for f in fronts:
                del f.tokenize
        codes = Counter(o.status for o in await asyncio.gather(*tasks))
        # What was given room was answered: none refused after its tokenizing.
        assert codes[200] == reserved and set(codes) == {200, 429}, codes
        assert not sched.admission.reservations  # each became its work
        # A prompt longer than the context is found so after its tokenizing: a 400,
        # and the room it was given goes back at once.
        made, reserve = [], sched.admission.reserve
        sched.admission.reserve = lambda req: made.append(reserve(req)) or made[-1]
        too_long = msgspec.json.encode({"model": engine.name, "max_tokens": 2,
                                        "prompt": [100 + i % 200 for i in range(1100)]})
        out = await one(st.client, subjects.COMPLETIONS, too_long, 30)
        assert out.status == 400 and made == [sched.id]
        await wait_until(lambda: not sched.admission.reservations)


async def test_a_completions_burst_to_a_fresh_decoder_is_admitted_by_its_work(
        nats_server, tmp_path, jax_cache_dir, monkeypatch):
    """A decoder worker times a prompt and a decode step at warm-up and its heartbeats
    carry the cost: the first burst of completions, sent the moment it is ready, is
    decided by its work (every decision had a cost to go by), and all of it fits (a
    tiny model's prompts take microseconds), so all of it is served."""
    from shared import admission
    from tests.support.tiny_models import serve_tiny

    _, engine = serve_tiny("gpt2", tmp_path, "tiny-fresh", 1024)
    decided = []
    check = admission.check_generation

    def noted(*args, **kw):
        decided.append(kw["cost"])
        return check(*args, **kw)

    monkeypatch.setattr(admission, "check_generation", noted)
    async with running_stack(nats_server.url, models={engine.name: str(tmp_path)},
                             max_context=1024, decode_slots=4) as st:
        await st.add_worker(engine, "dec-fresh", kind="decoder", time_warmup=True)
        (view,) = st.scheduler.fleet.ready(engine.name)
        # Before any request it carries a decode and a prefill cost. (A tiny model's
        # prompt costs microseconds a token: on a busy machine the fit may charge it
        # all per chunk, which is still a cost to go by.)
        hb = view.hb
        assert hb.decode_per_step > 0 and hb.prefill_per_token + hb.prefill_per_chunk > 0
        body = msgspec.json.encode({"model": engine.name, "prompt": list(range(100, 140)),
                                    "max_tokens": 4, "temperature": 0})
        outcomes = await asyncio.gather(*(one(st.client, subjects.COMPLETIONS, body, 60)
                                          for _ in range(24)))
        assert Counter(o.status for o in outcomes) == {200: 24}
        assert len(decided) == 24 and all(c is not None for c in decided)
