"""The decoder's step scheduler (services/worker/decode/scheduler.py) as pure logic:
no event loop, no engine thread, times passed in. A mock engine stands in, its
cache room set by the test; each engine call's outcome is written by hand as the
StepResult the runner's loop would hand back."""

from __future__ import annotations

import time

import msgspec
import numpy as np

from services.worker.decode.scheduler import MAX_PARK_S, LaneStep, StepResult, StepScheduler
from shared.messages import GenerateWork, Sampling
from shared.priority import BATCH, INTERACTIVE
from tests.support.mock_engine import MockDecoder

NOW = 100.0  # perf_counter of the test's first schedule


class PoolDecoder(MockDecoder):
    """A MockDecoder whose KV pool holds `room` prompt tokens in all (None: any)."""

    def __init__(self, room: int | None = None, **kw) -> None:
        super().__init__(**kw)
        self.room = room
        self.begun: list[tuple[int, list[int], int]] = []  # (slot, prompt, seed)

    def begin(self, slot: int, prompt: list[int], sampling, seed: int, **kw) -> bool:
        if self.room is not None and len(prompt) > self.room:
            return False  # no room in the pool now
        super().begin(slot, prompt, sampling, seed)
        self.begun.append((slot, list(prompt), seed))
        self.generated = kw.get("generated")  # a constrained re-run's tokens so far
        if self.room is not None:
            self.room -= len(prompt)
        return True


class Versions:
    """What LoadedModels tells the scheduler: the engines, and what prod is."""

    def __init__(self, **engines) -> None:
        self.engines = dict(engines)
        self.prod = next(iter(self.engines))

    def resolve(self, version: str) -> str:
        return version or self.prod


def work(rid: str, prompt_len: int = 2, n: int = 1, version: str = "",
         deadline_in: float = 30.0, priority: int = INTERACTIVE) -> GenerateWork:
    return GenerateWork(rid, "mock-lm", version, list(range(3, 3 + prompt_len)), 8,
                        Sampling(temperature=0), [], n, True, time.time() + deadline_in,
                        f"reply.{rid}", "sched", priority=priority)


def scheduler(per_step: int = 8, chunk: int = 512, riders=lambda n: 0, **engines):
    versions = Versions(**(engines or {"1": PoolDecoder(slots=2)}))
    sched = StepScheduler(versions.resolve, per_step, chunk, riders=riders)
    sched.follow(versions.engines)
    return sched, versions


def ids(seqs) -> list[tuple[str, int]]:
    return [(s.work.request_id, s.index) for s in seqs]


def prefilled(sched: StepScheduler, *seqs, first: int = 7) -> list:
    """Their prompts completed in one engine call that also dispatched a step per
    busy lane (and read none: nothing was in flight before)."""
    lanes = [lane for lane in sched.lanes.values() if lane.busy]
    steps = [LaneStep(lane, object(), None, []) for lane in lanes]
    return sched.update(StepResult([(s, first) for s in seqs], steps))


def test_waiting_sequences_are_admitted_fifo_into_free_slots():
    sched, _ = scheduler()
    for rid in "abc":
        sched.add(work(rid), NOW, seed=10)
    plan, adm = sched.schedule(time.time(), NOW)
    assert ids(adm.admitted) == [("a", 0), ("b", 0)]  # two slots
    assert ids(sched.waiting) == [("c", 0)] and sched.running == 2
    assert [(s.work.request_id, n) for s, n in plan.prefill] == [("a", 2), ("b", 2)]
    # "a" finishes: its slot is the next one "c" takes.
    prefilled(sched, *adm.admitted)
    adm.admitted[0].finish = "length"
    freed = sched.retiring(time.time())
    assert [(slot, s.work.request_id) for _, slot, s in freed] == [(0, "a")]
    closed = sched.retire(freed)
    assert [(r.work.request_id, running) for r, running in closed] == [("a", 1)]
    _, adm = sched.schedule(time.time(), NOW + 1)
    assert ids(adm.admitted) == [("c", 0)] and adm.admitted[0].slot == 0


def test_admissions_per_step_and_the_prompt_token_budget_are_bounded():
    sched, _ = scheduler(per_step=2, chunk=16, **{"1": PoolDecoder(slots=4)})
    for rid in "abc":
        sched.add(work(rid, prompt_len=10), NOW, seed=0)
    plan, adm = sched.schedule(time.time(), NOW)
    assert ids(adm.admitted) == [("a", 0), ("b", 0)]  # at most two per step
    # 16 prompt tokens in all: "a" whole, the first 6 of "b", oldest first.
    assert [(s.work.request_id, n) for s, n in plan.prefill] == [("a", 10), ("b", 6)]


def test_a_full_lane_holds_its_work_while_another_lanes_work_goes():
    prod, canary = PoolDecoder(slots=1), PoolDecoder(slots=1, tag=1)
    sched, _ = scheduler(**{"1": prod, "2": canary})
    sched.add(work("p1"), NOW, seed=0)
    sched.add(work("p2"), NOW, seed=0)  # prod's one slot is taken by p1
    sched.add(work("c1", version="2"), NOW, seed=0)
    _, adm = sched.schedule(time.time(), NOW)
    assert ids(adm.admitted) == [("p1", 0), ("c1", 0)]
    assert ids(sched.waiting) == [("p2", 0)]
    assert [s.lane.version for s in adm.admitted] == ["1", "2"]


def test_a_full_kv_pool_blocks_admission_and_nobody_overtakes():
    engine = PoolDecoder(room=10, slots=4)
    sched, _ = scheduler(**{"1": engine})
    sched.add(work("a", prompt_len=6), NOW, seed=0)
    sched.add(work("b", prompt_len=6), NOW, seed=0)  # 4 tokens of room left: waits
    sched.add(work("c", prompt_len=2), NOW, seed=0)  # would fit, but "b" is first
    plan, adm = sched.schedule(time.time(), NOW)
    assert ids(adm.admitted) == [("a", 0)] and ids(sched.waiting) == [("b", 0), ("c", 0)]
    assert [slot for slot, _, _ in engine.begun] == [0]  # free slots were not the limit
    engine.room = 20  # "a"'s cache came back
    _, adm = sched.schedule(time.time(), NOW + 1)
    assert ids(adm.admitted) == [("b", 0), ("c", 0)]


def test_preempted_sequences_go_back_to_the_front_oldest_first_with_their_tokens():
    engine = PoolDecoder(slots=3)
    sched, _ = scheduler(**{"1": engine})
    for i, rid in enumerate("abc"):
        sched.add(work(rid), NOW + i, seed=0)
    _, first = sched.schedule(time.time(), NOW)  # a, b, c admitted one after another...
    for i, seq in enumerate(first.admitted):
        seq.admitted = NOW + i  # ...at distinct times
    sched.add(work("d"), NOW + 5, seed=0)  # waits: no slot left
    lane = sched.lanes["1"]
    prefilled(sched, *first.admitted)
    for seq in first.admitted:
        seq.tokens.append(7)
    # The engine preempts the two newest ("c" then "b") to find room for the next step.
    sched.requeue(StepResult([], [LaneStep(lane, object(), None, [2, 1])]))
    assert ids(sched.waiting) == [("b", 0), ("c", 0), ("d", 0)]
    assert sched.counters["preemptions"] == 2 and set(lane.active) == {0}
    b = sched.waiting[0]
    assert (b.live, b.slot) == (False, -1)
    _, adm = sched.schedule(time.time(), NOW + 9)
    assert ids(adm.admitted) == [("b", 0), ("c", 0)]
    assert engine.begun[-2][1] == [3, 4, 7]  # its prompt plus its token so far
    assert b.admitted == NOW + 1  # still counted from its first admission


def test_a_constrained_rerun_tells_the_engine_how_many_tokens_it_generated():
    """Its grammar's matcher must be fed them again (engine/decoder/grammar.py); an
    unconstrained sequence's `begin` gets no such argument (engines without
    structured outputs take none)."""
    engine = PoolDecoder(slots=1)
    sched, _ = scheduler(**{"1": engine})
    w = work("json")
    w.sampling = Sampling(temperature=0, grammar='{"grammars": []}')
    sched.add(w, NOW, seed=0)
    _, adm = sched.schedule(time.time(), NOW)
    assert engine.generated == 0
    lane = sched.lanes["1"]
    prefilled(sched, *adm.admitted)
    adm.admitted[0].tokens += [7, 8]
    sched.requeue(StepResult([], [LaneStep(lane, object(), None, [0])]))
    sched.schedule(time.time(), NOW + 1)
    assert engine.begun[-1][1] == [3, 4, 7, 8] and engine.generated == 2
    plain = PoolDecoder(slots=1)
    sched, _ = scheduler(**{"1": plain})
    sched.add(work("plain"), NOW, seed=0)
    sched.schedule(time.time(), NOW)
    assert plain.begun and plain.generated is None


def test_cancelled_and_expired_waiting_work_retires_without_an_engine_step():
    engine = PoolDecoder(slots=1)
    sched, _ = scheduler(**{"1": engine})
    sched.add(work("run"), NOW, seed=0)
    sched.add(work("gone", n=2), NOW, seed=0)
    sched.add(work("late", deadline_in=-1), NOW, seed=0)
    sched.cancel("gone")
    plan, adm = sched.schedule(time.time(), NOW)
    assert ids(adm.admitted) == [("run", 0)]
    assert [r.work.request_id for r in adm.closed] == ["gone", "late"]
    assert [s.work.request_id for s, _ in plan.prefill] == ["run"]
    assert [p for _, p, _ in engine.begun] == [[3, 4]] and not sched.waiting
    assert "gone" not in sched.requests and "late" not in sched.requests


def test_a_running_sequence_cancelled_or_expired_is_freed_before_the_next_step():
    sched, _ = scheduler()
    sched.add(work("a"), NOW, seed=0)
    sched.add(work("b", deadline_in=0.5), NOW, seed=0)
    _, adm = sched.schedule(time.time(), NOW)
    prefilled(sched, *adm.admitted)
    assert sched.retiring(time.time()) == []
    sched.cancel("a")
    freed = sched.retiring(time.time() + 1)  # and "b"'s deadline has passed
    assert [(s.work.request_id, s.finish) for _, _, s in freed] == [
        ("a", "cancelled"), ("b", "cancelled")]
    closed = sched.retire(freed)
    assert [r.cancelled for r, _ in closed] == [True, False] and sched.running == 0


def test_a_started_generation_outlives_its_deadline_until_it_stalls_or_reaches_end_by():
    sched, _ = scheduler()
    t = time.time()
    stalls = msgspec.structs.replace(work("stalls", deadline_in=1), stall_s=5.0)
    bounded = msgspec.structs.replace(work("bounded", deadline_in=1), end_by=t + 10)
    sched.add(stalls, NOW, seed=0)
    sched.add(bounded, NOW, seed=0)
    _, adm = sched.schedule(t, NOW)
    steps = [LaneStep(lane, object(), None, []) for lane in sched.lanes.values() if lane.busy]
    sched.update(StepResult([(s, 7) for s in adm.admitted], steps), now_wall=t)
    assert sched.retiring(t + 4.9) == []  # past the deadline, but both have their first token
    freed = sched.retiring(t + 5)  # no token for 5 s
    assert [(s.work.request_id, s.finish) for _, _, s in freed] == [("stalls", "cancelled")]
    (st, _), = sched.retire(freed)
    assert st.expired == "stall" and not st.cancelled
    assert sched.retiring(t + 9.9) == []  # no stall bound: it runs until its end_by
    freed = sched.retiring(t + 10)
    (st, _), = sched.retire(freed)
    assert st.work.request_id == "bounded" and st.expired == "max_time"


def test_a_sequence_joins_the_step_after_the_one_in_flight():
    sched, _ = scheduler()
    sched.add(work("a"), NOW, seed=0)
    _, adm = sched.schedule(time.time(), NOW)
    (a,) = adm.admitted
    assert prefilled(sched, a, first=7) == [(a, 7)]
    lane = sched.lanes["1"]
    assert (a.joined, lane.dispatched) == (1, 1)  # step 1 includes it
    sched.add(work("b"), NOW, seed=0)
    _, adm = sched.schedule(time.time(), NOW)
    (b,) = adm.admitted
    # b's prompt completes while step 1 is in flight: step 2 is dispatched, step 1 read.
    step1 = np.array([11, 12], np.int32)  # [slots]
    got = sched.update(StepResult([(b, 9)], [LaneStep(lane, object(), step1, [])]))
    assert got == [(b, 9), (a, 11)]  # b's first token; nothing of step 1 for b
    assert (b.joined, lane.dispatched) == (2, 2)
    step2 = np.array([21, 22], np.int32)
    got = sched.update(StepResult([], [LaneStep(lane, object(), step2, [])]))
    assert got == [(a, 21), (b, 22)]
    # A sequence that ended rides one more step; its token from it is ignored.
    a.finish = "length"
    got = sched.update(StepResult([], [LaneStep(lane, None, np.array([31, 32]), [])]))
    assert got == [(b, 32)] and lane.pending is None and lane.dispatched == 3


def test_a_prompt_finished_inside_a_step_gets_its_first_token_from_that_step():
    """A mixed step: b's last chunk rode in step 2, so step 2's result holds b's
    first token beside a's next; nothing of step 1 is b's."""
    sched, _ = scheduler()
    sched.add(work("a"), NOW, seed=0)
    _, adm = sched.schedule(time.time(), NOW)
    (a,) = adm.admitted
    prefilled(sched, a, first=7)
    lane = sched.lanes["1"]
    sched.add(work("b"), NOW, seed=0)
    _, adm = sched.schedule(time.time(), NOW)
    (b,) = adm.admitted
    step1 = np.array([11, 12], np.int32)
    got = sched.update(StepResult([], [LaneStep(lane, object(), step1, [], joined=[b])]))
    assert got == [(a, 11)] and (b.joined, b.live, lane.dispatched) == (2, True, 2)
    assert b not in sched.prefilling
    got = sched.update(StepResult([], [LaneStep(lane, object(), np.array([21, 22]), [])]))
    assert got == [(a, 21), (b, 22)]  # b's first token, from the step it rode in


def test_a_requests_version_is_fixed_when_its_first_choice_is_admitted():
    v1, v2 = PoolDecoder(slots=1), PoolDecoder(slots=1, tag=1)
    sched, versions = scheduler(**{"1": v1})
    sched.add(work("a", n=2), NOW, seed=0)  # unpinned; one slot, so choice 1 waits
    _, adm = sched.schedule(time.time(), NOW)
    assert [s.lane.version for s in adm.admitted] == ["1"]
    versions.engines["2"], versions.prod = v2, "2"  # promote version 2
    sched.follow(versions.engines)
    sched.add(work("b"), NOW, seed=0)  # sent after the switch: prod is 2 for it
    # "a" needs version 1 until its last choice ends; unpinned "b" needs none yet.
    assert sched.uses("1") and not sched.uses("2")
    prefilled(sched, *adm.admitted)
    adm.admitted[0].finish = "stop"
    sched.retire(sched.retiring(time.time()))
    _, adm = sched.schedule(time.time(), NOW + 1)
    assert [(s.work.request_id, s.index, s.lane.version) for s in adm.admitted] == [
        ("a", 1, "1"), ("b", 0, "2")]
    assert sched.requests["a"].version == "1"


def test_a_failed_prompt_fails_its_request_once():
    sched, _ = scheduler()
    sched.add(work("a", n=3), NOW, seed=0)
    _, adm = sched.schedule(time.time(), NOW)
    c0, c1 = adm.admitted  # two slots: choice 2 waits
    assert sched.fail(c0) and not sched.fail(c1)  # one error for the request
    freed = sched.retiring(time.time())
    assert [(s.index, s.finish) for _, _, s in freed] == [(0, "error"), (1, "error")]
    assert sched.retire(freed) == []
    _, adm = sched.schedule(time.time(), NOW)  # its last choice is dropped, never begun
    assert adm.admitted == [] and [r.work.request_id for r in adm.closed] == ["a"]
    assert not sched.prefilling and not sched.busy


def test_a_resumed_request_runs_only_its_unfinished_choices_with_their_own_seeds():
    """A request resumed after its worker was lost names the choices still to
    generate: only those wait, each keeping its index and so its seed (seed + index);
    the request closes when they have retired."""
    sched, versions = scheduler(**{"1": PoolDecoder(slots=4)})
    w = msgspec.structs.replace(work("a", n=3), choices=[0, 2], skips=[3, 5, 1])
    sched.add(w, NOW, seed=10)
    assert ids(sched.waiting) == [("a", 0), ("a", 2)]
    assert [s.seed for s in sched.waiting] == [10, 12]
    assert sched.requests["a"].remaining == 2
    assert [w.skipped(i) for i in range(3)] == [3, 5, 1]
    sched.schedule(time.time(), NOW)
    assert [seed for _, _, seed in versions.engines["1"].begun] == [10, 12]


def _yield_to(sched: StepScheduler, now: float = NOW) -> list:
    """What the runner does before a step: free the yielded slots, park them."""
    out = sched.yielding(now)
    for lane, slot, _ in out:
        lane.engine.free(slot)
    sched.park(out, now)
    return out


def test_batch_sequences_make_way_for_interactive_work_and_resume_where_they_were():
    """A CPU worker (no batch rows ride an interactive step): an interactive request
    arriving at a worker full of batch work takes a slot at once and steps alone;
    the batch work resumes afterwards with its tokens so far, its first admission
    kept."""
    engine = PoolDecoder(slots=3)
    sched, _ = scheduler(**{"1": engine})
    for i, rid in enumerate("abc"):
        sched.add(work(rid, priority=BATCH), NOW + i, seed=0)
    _, first = sched.schedule(time.time(), NOW)
    for i, seq in enumerate(first.admitted):
        seq.admitted, seq.tokens = NOW + i, [7]
    prefilled(sched, *first.admitted)
    assert _yield_to(sched) == []  # batch alone keeps every slot

    sched.add(work("i"), NOW + 5, seed=0)
    yielded = _yield_to(sched)
    assert ids(q for _, _, q in yielded) == [("c", 0), ("b", 0), ("a", 0)]  # newest first
    lane = sched.lanes["1"]
    assert lane.active == {} and not any(q.live for _, _, q in yielded)
    plan, adm = sched.schedule(time.time(), NOW + 6)
    assert ids(adm.admitted) == [("i", 0)]  # the batch work waits behind it
    assert ids(sched.waiting) == [("a", 0), ("b", 0), ("c", 0)]
    prefilled(sched, *adm.admitted)
    _, adm = sched.schedule(time.time(), NOW + 7)
    assert adm.admitted == []  # still none while the interactive one runs

    # It ends: the batch work begins again, oldest first, from where it was.
    (inter,) = lane.active.values()
    assert inter.work.request_id == "i"
    inter.finish = "length"
    sched.retire(sched.retiring(time.time()))
    _, adm = sched.schedule(time.time(), NOW + 8)
    assert ids(adm.admitted) == [("a", 0), ("b", 0), ("c", 0)]
    assert engine.begun[-3][1] == [3, 4, 7]  # its prompt plus its token so far
    assert adm.admitted[0].admitted == NOW  # still counted from its first admission


def test_where_rows_are_cheap_some_batch_rows_ride_with_interactive_ones():
    """A GPU-like worker whose step cost lets 2 batch rows ride beside 1
    interactive row: the 2 oldest stay, the third yields and does not begin
    again while the interactive one runs."""
    engine = PoolDecoder(slots=4)
    sched, _ = scheduler(riders=lambda n: 2 * n, **{"1": engine})
    for i, rid in enumerate("abc"):
        sched.add(work(rid, priority=BATCH), NOW + i, seed=0)
    _, first = sched.schedule(time.time(), NOW)
    prefilled(sched, *first.admitted)
    sched.add(work("i"), NOW + 5, seed=0)
    assert ids(q for _, _, q in _yield_to(sched)) == [("c", 0)]
    _, adm = sched.schedule(time.time(), NOW + 6)
    assert ids(adm.admitted) == [("i", 0)]
    assert ids(sched.waiting) == [("c", 0)]


def test_interactive_prompts_take_the_chunk_budget_before_batch_ones():
    engine = PoolDecoder(slots=4)
    sched, _ = scheduler(chunk=4, riders=lambda n: 8, **{"1": engine})
    sched.add(work("b", prompt_len=4, priority=BATCH), NOW, seed=0)
    sched.add(work("i", prompt_len=4), NOW + 1, seed=0)
    plan, adm = sched.schedule(time.time(), NOW)
    assert ids(adm.admitted) == [("i", 0), ("b", 0)]  # interactive admitted first
    assert [(q.work.request_id, n) for q, n in plan.prefill] == [("i", 4)]


def test_a_batch_sequence_parked_long_enough_rides_beside_interactive_work():
    """Steady interactive traffic cannot starve batch work past its time: once parked
    for MAX_PARK_S in all, a batch sequence is admitted beside interactive work and
    is not parked again."""
    engine = PoolDecoder(slots=3)
    sched, _ = scheduler(**{"1": engine})
    sched.add(work("b", priority=BATCH), NOW, seed=0)
    _, first = sched.schedule(time.time(), NOW)
    prefilled(sched, *first.admitted)
    sched.add(work("i"), NOW + 1, seed=0)
    assert ids(q for _, _, q in _yield_to(sched, NOW + 1)) == [("b", 0)]
    _, adm = sched.schedule(time.time(), NOW + 2)
    assert ids(adm.admitted) == [("i", 0)]
    prefilled(sched, *adm.admitted)
    _, adm = sched.schedule(time.time(), NOW + MAX_PARK_S / 2)
    assert adm.admitted == []  # still parked: the interactive one runs on
    later = NOW + 1 + MAX_PARK_S
    _, adm = sched.schedule(time.time(), later)
    assert ids(adm.admitted) == [("b", 0)]  # parked long enough: it rides
    prefilled(sched, *adm.admitted)
    sched.add(work("j"), later, seed=0)
    assert _yield_to(sched, later + 1) == []  # and is not parked again
