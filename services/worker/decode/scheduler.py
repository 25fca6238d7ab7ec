"""The decoder's step scheduler: which sequences are in the next engine call. Host only.

  1. `add()` turns a GenerateWork with `n` choices into `n` sequences waiting FIFO
     (a resumed one: those of `choices` only).
  2. `retiring()` names the slots to free before the next step: sequences that
     finished, were cancelled or ran out of time; `retire()` forgets them once the
     engine freed those slots, and returns the requests whose last choice just
     ended. A request's time (`out_of_time`) is its deadline until its first
     token; after it, its stall timeout since its latest token and its `end_by`.
  3. `schedule()` admits at most `per_step` waiting sequences, FIFO per lane, each
     into a free slot of its lane when the engine's KV pool has room for its prompt
     (`begin` says so; otherwise it and the rest of its lane wait: the pool, not the
     slot count, bounds concurrency). A request's version is fixed when its first choice
     is admitted: the pinned one, else prod at that moment; every choice and every
     token of it then come from that engine. Waiting work that was cancelled or
     expired is dropped there, never computed. The plan it returns is one engine
     call: prompt chunks of the admitted sequences, oldest first, at most `chunk`
     tokens in all, then a decode step for every busy lane.
  4. `update()` reads what the engine call did: a sequence whose prompt is done
     joins the step after the one in flight (`joined`; the one dispatched when its
     last chunk rode in that step's pass, a mixed step), each lane's step count
     moves on, and the tokens of the step read are matched to the sequences that
     were in it (a sequence's extra ride after its end, or a step before it
     joined, yields nothing).
  5. Preemption is this scheduler's policy too: when the pool cannot give every
     live sequence its next block, the engine asks the lane's `victim` which
     sequence gives its cache back: the one that began last (the least work lost,
     and the oldest requests keep going). `requeue()` puts those back at the front
     of the queue, oldest first; they re-run their prompt plus their tokens so far.
  6. Batch work (shared.priority) yields to interactive work. Waiting interactive
     sequences are admitted first, and their prompt chunks go first. While a lane
     has interactive sequences, in it or waiting for it, at most `riders(n)` batch
     sequences stay in it (n: the interactive ones; the worker says how many: none
     on a CPU, where each row adds a large share of the step, every slot on
     an accelerator, where rows are nearly free). `yielding()` names the others,
     newest first; the worker frees their slots and `park()` puts them back to
     wait. Freeing keys their full cache blocks, so resuming re-runs only the last
     partial block (the prefix cache holds the rest).
     A batch request carries no stall bound (the gateway sets none): a pause is
     not a stall; its whole time still bounds it. A batch sequence parked for
     MAX_PARK_S in all rides from then on (admitted beside interactive work, never
     parked again), so steady interactive traffic cannot starve it past its time.

No asyncio and no clocks: the caller passes the times, so the rules are tested as
pure functions over a mock engine (tests/services/test_decode_scheduler.py).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable

from services.worker.decode.sequences import MAX_PARK_S, Lane, Request, Sequence
from shared.errors import ServiceError
from shared.messages import GenerateWork

if TYPE_CHECKING:
    import numpy as np

    from engine.interface import Decoder, PendingStep

__all__ = ["MAX_PARK_S", "Admission", "Lane", "LaneStep", "Request", "Sequence", "StepPlan",
           "StepResult", "StepScheduler"]

# The scheduler's counts since start, named as the heartbeat names them.
COUNTERS = ("prefix_cache_queries", "prefix_cache_hits", "preemptions",
            "spec_decode_drafts", "spec_decode_draft_tokens", "spec_decode_accepted_tokens")


@dataclass
class Admission:
    """What `schedule()` decided besides the plan: work answered without a step."""

    admitted: list[Sequence] = field(default_factory=list)
    refused: list[tuple[GenerateWork, ServiceError]] = field(default_factory=list)
    closed: list[Request] = field(default_factory=list)  # last choice dropped unstarted


@dataclass
class StepPlan:
    """One engine call: prompt chunks, then a decode step per lane."""

    prefill: list[tuple[Sequence, int]]  # (sequence, prompt tokens to compute now)
    lanes: list[Lane]  # busy lanes: make room, dispatch the next step, read the last


@dataclass
class LaneStep:
    """What the engine thread did for one lane."""

    lane: Lane
    dispatched: PendingStep | None  # None when no slot was live
    tokens: np.ndarray | None  # [slots] int32 of the step read (the one before)
    preempted: list[int]  # slots the engine took back to make room
    more: dict[int, list[int]] = field(default_factory=dict)  # slot -> further tokens read
    # Sequences whose prompt the dispatched step finished in its own pass (a mixed
    # step): they are in it, their first token in its result.
    joined: list["Sequence"] = field(default_factory=list)


@dataclass
class StepResult:
    firsts: list[tuple[Sequence, int | BaseException]]  # (sequence, first token | the error)
    lanes: list[LaneStep]


class StepScheduler:
    def __init__(self, resolve: Callable[[str], str], per_step: int, chunk: int,
                 riders: Callable[[int], int] = lambda n: 0) -> None:
        self.resolve = resolve  # a work's version -> the loaded one it runs on now
        self.riders = riders  # interactive rows -> batch rows that may share their steps
        self.per_step = max(1, per_step)  # admissions per step
        self.chunk = max(1, chunk)  # prompt tokens per step, over all sequences
        self.lanes: dict[str, Lane] = {}
        self.waiting: deque[Sequence] = deque()
        self.prefilling: list[Sequence] = []  # holding a slot, prompt not done, oldest first
        self.requests: dict[str, Request] = {}
        # Since start, under the heartbeat's names (services.worker.runner.Gauges).
        self.counters = dict.fromkeys(COUNTERS, 0)

    # ------------------------------------------------------------- versions
    def follow(self, engines: dict[str, Decoder]) -> None:
        """A lane per loaded engine; none for one dropped. A busy lane keeps its
        engine until idle (its sequences finish where they started)."""
        for version, engine in engines.items():
            lane = self.lanes.get(version)
            if lane is None or (lane.engine is not engine and not lane.busy):
                self.lanes[version] = Lane.of(version, engine)
        for version in [v for v in self.lanes if v not in engines]:
            del self.lanes[version]  # dropped only once `uses` said it is idle

    def uses(self, version: str) -> bool:
        lane = self.lanes.get(version)
        if lane is not None and lane.busy:
            return True
        return any(self._version_of(s) == version for s in self.waiting)

    def _version_of(self, seq: Sequence) -> str:
        """The version a waiting sequence is bound to; "" while it may take any prod."""
        st = self.requests.get(seq.work.request_id)
        return (st.version if st is not None else "") or seq.work.version

    @property
    def running(self) -> int:
        return sum(len(lane.active) for lane in self.lanes.values())

    @property
    def busy(self) -> bool:
        return bool(self.waiting) or any(lane.busy for lane in self.lanes.values())

    # ------------------------------------------------------------- requests
    def add(self, work: GenerateWork, now: float, seed: int) -> None:
        """`seed`: the first choice's; choice i draws from seed + i (a resumed
        request's choices keep their index, so their draws too)."""
        choices = work.generated()
        self.requests[work.request_id] = Request(work, now, len(choices))
        for i in choices:
            self.waiting.append(Sequence(work, i, (seed + i) % 2**32, now))

    def cancel(self, request_id: str) -> bool:
        st = self.requests.get(request_id)
        if st is None:
            return False
        st.cancelled = True
        return True

    def fail(self, seq: Sequence) -> bool:
        """Its prompt failed: it ends, and so do its request's other choices. Whether
        the request is newly failed (its error is still to send)."""
        seq.finish = "error"
        st = self.requests.get(seq.work.request_id)
        if st is None or st.cancelled:
            return False
        st.cancelled = True
        return True

    # ------------------------------------------------------------- admission
    def schedule(self, now_wall: float, now: float) -> tuple[StepPlan, Admission]:
        adm = self._admit(now_wall, now)
        left, prefill = self.chunk, []
        for seq in sorted(self.prefilling, key=lambda q: q.batch):  # interactive first
            if left <= 0:
                break
            assert seq.lane is not None  # admitted: a prefilling sequence has its lane
            n = min(left, seq.lane.engine.prefilling(seq.slot))
            left -= n
            prefill.append((seq, n))
        return StepPlan(prefill, [lane for lane in self.lanes.values() if lane.busy]), adm


    def _interactive(self, lane: Lane) -> int:
        """Interactive sequences in `lane` or waiting for it."""
        return (sum(not q.batch for q in lane.active.values())
                + sum(not q.batch and self.resolve(self._version_of(q)) == lane.version
                       for q in self.waiting))

    def _room_for_batch(self, lane: Lane, now: float) -> bool:
        """Whether one more batch sequence that yields may begin in `lane` now (rule 6)."""
        n = self._interactive(lane)
        return not n or sum(q.yields(now) for q in lane.active.values()) < self.riders(n)

    def _admit(self, now_wall: float, now: float) -> Admission:
        adm = Admission()
        kept: list[Sequence] = []
        full: set[Lane] = set()
        if any(q.batch for q in self.waiting):  # interactive first, each lane FIFO
            self.waiting = deque(sorted(self.waiting, key=lambda q: q.batch))
        while self.waiting and len(adm.admitted) < self.per_step:
            seq = self.waiting.popleft()
            st = self.requests.get(seq.work.request_id)
            if st is None or st.cancelled or self.out_of_time(st, now_wall):
                self._drop(seq, st, adm)
                continue
            version = st.version or self.resolve(seq.work.version)
            lane = self.lanes.get(version)
            if seq.yields(now) and lane is not None and (
                    lane in full or not self._room_for_batch(lane, now)):
                full.add(lane)  # batch waits behind interactive work: none goes now
                kept.append(seq)
                continue
            if lane is None:  # pinned to a version dropped meanwhile: cannot happen, but
                self._refuse(seq, st, adm, ServiceError(  # answer, never wait forever
                    503, f"version {version} is not loaded on this worker; retry shortly",
                    code="version_unavailable", retry_after=1.0))
                continue
            slot = lane.free_slot() if lane not in full else None
            if slot is not None and not st.version:
                try:
                    lane.engine.check(seq.work.prompt)  # prod may have changed
                except ValueError as exc:
                    self._refuse(seq, st, adm, ServiceError(400, str(exc)))
                    continue
            prompt = seq.work.prompt + seq.tokens  # a preempted one re-runs its tokens too
            # No engine call runs in begin: it is host bookkeeping, and at most one
            # block copy it dispatches (queued behind the step in flight, blocks.py).
            # A constrained re-run's matcher is fed its tokens so far again.
            again = {"generated": len(seq.tokens)} if seq.work.sampling.grammar else {}
            if slot is None or not lane.engine.begin(slot, prompt, seq.work.sampling,
                                                     seq.seed, **again):
                full.add(lane)  # FIFO per lane: nobody overtakes a sequence that waits
                kept.append(seq)  # work for other lanes may still go
                if all(ln in full or ln.free_slot() is None for ln in self.lanes.values()):
                    break
                continue
            st.version = version
            lane.began += 1
            seq.began = lane.began
            seq.lane, seq.slot = lane, slot
            seq.admitted = seq.admitted or now
            if seq.parked_at:  # back from a pause: its time parked adds up
                seq.parked_s += now - seq.parked_at
                seq.parked_at = 0.0
            lane.active[slot] = seq
            self.prefilling.append(seq)
            adm.admitted.append(seq)
        self.waiting.extendleft(reversed(kept))
        return adm

    @staticmethod
    def out_of_time(st: Request, now_wall: float) -> bool:
        """Whether `st` ran out of time (noted in `st.expired`): its deadline bounds
        the wait for its first token; after it, the stall timeout since its latest
        token and its `end_by` bound it (0 = no such bound)."""
        if not st.expired:
            w = st.work
            if not st.last_token:
                st.expired = "deadline" if w.deadline <= now_wall else ""
            elif w.end_by and w.end_by <= now_wall:
                st.expired = "max_time"
            elif w.stall_s > 0 and st.last_token + w.stall_s <= now_wall:
                st.expired = "stall"
        return bool(st.expired)

    def _drop(self, seq: Sequence, st: Request | None, adm: Admission) -> None:
        seq.finish = "cancelled"
        if st is not None:
            st.remaining -= 1
            if st.remaining == 0:
                self.requests.pop(st.work.request_id, None)
                adm.closed.append(st)

    def _refuse(self, seq: Sequence, st: Request, adm: Admission, err: ServiceError) -> None:
        """The error first, then (once its last choice is dropped) the request closes."""
        st.cancelled = True  # its other choices are dropped at their turn
        adm.refused.append((seq.work, err))
        self._drop(seq, st, adm)

    # ------------------------------------------------------------- after a step
    def update(self, result: StepResult,
               now_wall: float = 0.0) -> list[tuple[Sequence, int | BaseException]]:
        """(sequence, token or prefill exception) in the order to process them:
        first tokens, oldest prompt first, then each lane's step by slot. A request
        with a token notes `now_wall` (UNIX seconds) as its latest token's time."""
        out: list[tuple[Sequence, int | BaseException]] = []
        for seq, first in result.firsts:
            if isinstance(first, BaseException):
                out.append((seq, first))
                continue
            # Queued behind the step in flight: it joins the next one dispatched.
            assert seq.lane is not None  # it was prefilling: admitted to a lane
            seq.joined = seq.lane.dispatched + 1
            self._live(seq)
            out.append((seq, int(first)))
        for ls in result.lanes:
            lane, step_no = ls.lane, ls.lane.dispatched  # the read step's number
            lane.pending = ls.dispatched
            if ls.dispatched is not None:
                lane.dispatched += 1
            for seq in ls.joined:  # its prompt's last chunk rode in the step dispatched
                seq.joined = lane.dispatched
                self._live(seq)
            if ls.tokens is None:
                continue
            for slot, seq in lane.active.items():
                if seq.finish is None and seq.live and seq.joined <= step_no:
                    out.append((seq, int(ls.tokens[slot])))  # tokens: [slots] int32
                    out.extend((seq, t) for t in ls.more.get(slot, ()))  # accepted drafts
        if now_wall:
            for seq, tok in out:
                st = self.requests.get(seq.work.request_id)
                if st is not None and not isinstance(tok, BaseException):
                    st.last_token = now_wall
        return out

    def _live(self, seq: Sequence) -> None:
        seq.live = True
        self.prefilling.remove(seq)

    def requeue(self, result: StepResult) -> None:
        """Preempted sequences (their cache already freed) wait again, at the front,
        oldest first; one that finished on its last token is retired as usual."""
        out = []
        for ls in result.lanes:
            for slot in ls.preempted:
                seq = ls.lane.active.get(slot)
                if seq is None:
                    continue
                self.counters["preemptions"] += 1
                if seq in self.prefilling:
                    self.prefilling.remove(seq)
                if seq.finish is None:  # else `retiring` frees the slot (a no-op in the engine)
                    out.append((ls.lane, slot, seq))
        self._wait_again(out)

    def _wait_again(self, out: list[tuple[Lane, int, Sequence]]) -> None:
        """Sequences taken out of their slots (cache freed) wait again at the front,
        oldest first; they re-run their prompt plus their tokens so far."""
        for lane, slot, seq in out:
            del lane.active[slot]
            seq.live, seq.slot = False, -1
        back = sorted((q for _, _, q in out), key=lambda q: q.admitted)
        self.waiting.extendleft(reversed(back))

    # ------------------------------------------------------------- yielding
    def yielding(self, now: float) -> list[tuple[Lane, int, Sequence]]:
        """Batch sequences to take out of their slots for interactive work (rule 6):
        beyond the `riders` of each lane that has interactive sequences, newest
        first (`now`: perf_counter). The engine frees them; then `park`."""
        out = []
        for lane in self.lanes.values():
            batch = [q for q in lane.active.values() if q.yields(now) and q.finish is None]
            n = self._interactive(lane) if batch else 0
            if n:
                batch.sort(key=lambda q: q.began)
                out += [(lane, q.slot, q) for q in reversed(batch[self.riders(n):])]
        return out

    def park(self, yielded: list[tuple[Lane, int, Sequence]], now: float) -> None:
        """Yielded sequences (their slots freed) wait again as preempted ones do;
        `_admit` puts the interactive ones ahead of them."""
        for _, _, seq in yielded:
            if seq in self.prefilling:
                self.prefilling.remove(seq)
            seq.parked_at = now
        self._wait_again(yielded)

    # ------------------------------------------------------------- retiring
    def retiring(self, now_wall: float) -> list[tuple[Lane, int, Sequence]]:
        """Slots to free: finished sequences, and those cancelled or out of time
        (marked "cancelled" now). The engine frees them; then `retire`."""
        freed = []
        for lane in self.lanes.values():
            for slot, seq in lane.active.items():
                st = self.requests.get(seq.work.request_id)
                if seq.finish is None and st is not None and (
                        st.cancelled or self.out_of_time(st, now_wall)):
                    seq.finish = "cancelled"
                if seq.finish is not None:
                    freed.append((lane, slot, seq))
        return freed

    def retire(self, freed: list[tuple[Lane, int, Sequence]]) -> list[tuple[Request, int]]:
        """Forget freed slots; (request, sequences still running) for each request
        whose last choice this was."""
        closed = []
        for lane, slot, seq in freed:
            del lane.active[slot]
            if seq in self.prefilling:
                self.prefilling.remove(seq)
            st = self.requests.get(seq.work.request_id)
            if st is not None:
                st.remaining -= 1
                if st.remaining == 0:
                    self.requests.pop(st.work.request_id, None)
                    closed.append((st, self.running))
        return closed
