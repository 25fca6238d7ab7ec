"""The decoder runner: continuous batching, one decode step per engine per iteration.

  1. `submit()` turns a GenerateWork with `n` choices into `n` sequences waiting FIFO.
  2. Each iteration first retires sequences that finished, were cancelled or expired
     (their slots and cache blocks free within one step), then admits at most
     `prefill_per_step` waiting sequences, FIFO, each into a free slot of its lane
     when the engine's KV pool has room for its prompt (`can_admit`; otherwise it
     waits: the pool, not the slot count, bounds concurrency). A request's version
     is fixed when its first choice is admitted: the pinned one, else prod at that
     moment. Every choice and every token of it then come from that engine, so no
     stream mixes versions.
  3. Each loaded version has a lane: its engine, its slots, its dispatched step. The
     lanes follow `LoadedModels` by callback, so a new prod gets a lane the moment it
     is switched in and no lane keeps an engine the worker dropped. One engine call
     per iteration, on the engine thread: prompt chunks of the admitted sequences,
     oldest first, at most `prefill_chunk` tokens in all (a long prompt takes
     several iterations, so running streams lose at most one chunk's time per
     token); then per lane room in the cache for the next step (`make_room`: the
     newest sequences may be preempted), the next step dispatched (`step_async`),
     and only then the tokens of the step before it read: step n+1 waits on the
     device behind step n, and detokenizing and publishing step n overlap its
     computation. A sequence whose prompt is done joins the step after the one in
     flight; tokens from steps it was not part of are ignored, and so is the one
     extra step a sequence that ended at step n rides in (its slot is freed once
     the host has read step n). A preempted sequence goes back to the front of the
     queue and later re-runs its prompt plus its tokens so far, drawing what it
     would have drawn next (draws are keyed by seed and position).
  4. New tokens are detokenized per sequence (never splitting a UTF-8 character),
     checked against EOS, stop strings, `max_tokens` and the context, and streamed to
     the gateway as GenChunks naming the version (non-streaming requests get one
     chunk per choice at the end). When every choice of a request is done, its slots
     are freed and a GenDone carries usage and timing. Everything one step produced
     (chunks, GenDones, errors) leaves as one message per gateway (`Outbox.held`).
  5. A version no alias names keeps its lane while a sequence runs or waits on it
     (`wait_unused`); then the hot swap drops it, and its lane goes with it.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections import deque
from concurrent.futures import Executor
from dataclasses import dataclass, field

from services.worker.runner import Gauges, Outbox
from services.worker.versions import LoadedModels
from shared.errors import ServiceError, deadline_exceeded, internal
from shared.logging import get_logger
from shared.messages import GenChunk, GenDone, GenerateWork, Timing
from shared.telemetry import itl_bucket, itl_counts

log = get_logger("worker.generation")


@dataclass(eq=False)
class Lane:
    """One loaded version's engine and the sequences in its KV slots."""

    version: str
    engine: object
    eos: frozenset[int]
    active: dict[int, "Sequence"] = field(default_factory=dict)  # slot -> sequence
    pending: object = None  # the dispatched decode step, not yet read
    dispatched: int = 0  # decode steps dispatched so far (the pending one's number)
    seen: tuple[int, int] = (0, 0)  # the engine's prefix-cache queries and hits, counted

    def free_slot(self) -> int | None:
        return next((s for s in range(self.engine.slots) if s not in self.active), None)

    @property
    def busy(self) -> bool:
        return bool(self.active) or self.pending is not None


@dataclass(eq=False)
class Sequence:
    work: GenerateWork
    index: int  # choice index within the request
    seed: int
    arrived: float  # perf_counter
    lane: Lane | None = None
    detok: object = None
    slot: int = -1
    admitted: float = 0.0
    joined: int = 0  # number of the first decode step that includes it
    live: bool = False  # its prompt is computed: it is in decode steps
    tokens: list[int] = field(default_factory=list)  # generated so far (a re-run needs them)
    first_at: float = 0.0
    last_at: float = 0.0
    generated: int = 0
    unsent: int = 0  # tokens generated since its last chunk
    text: list[str] = field(default_factory=list)  # unsent text (non-streaming)
    finish: str | None = None


@dataclass(eq=False)
class RequestState:
    work: GenerateWork
    arrived: float
    remaining: int
    version: str = ""  # fixed when its first choice is admitted
    completion_tokens: int = 0
    cancelled: bool = False
    first_at: float = 0.0
    itl_sum: float = 0.0
    itl_n: int = 0
    admitted: float = 0.0
    itl_counts: list[int] = field(default_factory=itl_counts)  # per-token gaps, bucketed


class DecoderRunner:
    """Continuous batching over a worker's decoder versions (a `runner.Runner`)."""

    work_type = GenerateWork

    def __init__(self, models: LoadedModels, outbox: Outbox, executor: Executor,
                 prefill_per_step: int, prefill_chunk: int = 512) -> None:
        self.models = models
        self.outbox = outbox
        self.executor = executor
        self.per_step = max(1, prefill_per_step)
        self.chunk = max(1, prefill_chunk)
        self.prefilling: list[Sequence] = []  # holding a slot, prompt not done, oldest first
        self.counters = {"prefix_queries": 0, "prefix_hits": 0, "preemptions": 0}
        self.lanes: dict[str, Lane] = {}
        self.waiting: deque[Sequence] = deque()
        self.requests: dict[str, RequestState] = {}
        self.steps = 0
        self._occ_sum = 0
        self._occ_n = 0
        self._wake = asyncio.Event()
        self._idle = asyncio.Event()
        self._idle.set()
        self._stepped = asyncio.Condition()
        self._tasks: set[asyncio.Task] = set()
        models.on_change(self._follow)
        self._follow()

    # ------------------------------------------------------------- versions
    def _follow(self) -> None:
        """LoadedModels changed: a lane per engine it holds, none for one it dropped."""
        for version, engine in self.models.engines.items():
            lane = self.lanes.get(version)
            if lane is None or (lane.engine is not engine and not lane.busy):
                self.lanes[version] = Lane(version, engine, frozenset(engine.eos_token_ids))
        for version in [v for v in self.lanes if v not in self.models.engines]:
            del self.lanes[version]  # dropped only once `wait_unused` said it is idle
        self._wake.set()

    def uses(self, version: str) -> bool:
        lane = self.lanes.get(version)
        if lane is not None and lane.busy:
            return True
        return any(self._version_of(s) == version for s in self.waiting)

    def _version_of(self, seq: Sequence) -> str:
        """The version a waiting sequence is bound to; "" while it may take any prod."""
        st = self.requests.get(seq.work.request_id)
        return (st.version if st is not None else "") or seq.work.version

    async def wait_unused(self, version: str) -> None:
        async with self._stepped:
            await self._stepped.wait_for(lambda: not self.uses(version))

    # ------------------------------------------------------------- accounting
    @property
    def queue_depth(self) -> int:
        return len(self.waiting)

    @property
    def in_flight(self) -> int:
        return sum(len(lane.active) for lane in self.lanes.values())

    def gauges(self) -> Gauges:
        serving = [self.lanes[v] for v in self.models.serving() if v in self.lanes]
        slots = sum(lane.engine.slots for lane in serving) or 1
        used = self.in_flight
        if self._occ_n:
            occ = self._occ_sum / (self._occ_n * slots)
            self._occ_sum = self._occ_n = 0
        else:
            occ = used / slots
        # Cache blocks held, over every loaded engine (a retiring one still holds its).
        stats = [lane.engine.cache_stats() for lane in self.lanes.values()]
        total = sum(c.blocks for c in stats)
        kv = sum(c.held for c in stats) / total if total else 0.0
        return Gauges(queue_depth=self.queue_depth, in_flight=used, capacity=slots,
                      occupancy=min(occ, 1.0), steps=self.steps, slots_total=slots,
                      slots_used=used, kv_usage=kv, running=used, waiting=self.queue_depth,
                      kv_blocks_total=total, kv_blocks_used=sum(c.held for c in stats),
                      prefix_cache_queries=self.counters["prefix_queries"],
                      prefix_cache_hits=self.counters["prefix_hits"],
                      preemptions=self.counters["preemptions"],
                      **self._prefix_summary(serving))

    @staticmethod
    def _prefix_summary(serving: list[Lane]) -> dict:
        """What prod's engine holds, for prefix-aware routing (bounded)."""
        from shared.prefix import SUMMARY_KEYS

        engine = serving[0].engine if serving else None
        block = getattr(engine, "prefix_block", getattr(engine, "block", 0))  # 0: cache off
        if not block:
            return {}
        return {"prefix_block": block, "prefix_keys": engine.held_prefixes(SUMMARY_KEYS)}

    # -------------------------------------------------------------- requests
    def submit(self, work: GenerateWork) -> None:
        now = time.perf_counter()
        engine = self.models.engines.get(self.models.resolve(work.version))
        try:
            engine.check_prompt(work.prompt)
        except ValueError as exc:
            self._spawn(self.outbox.refuse(work, ServiceError(400, str(exc))))
            return
        self.requests[work.request_id] = RequestState(work, now, work.n)
        base = work.sampling.seed if work.sampling.seed is not None else random.getrandbits(32)
        for i in range(work.n):
            self.waiting.append(Sequence(work, i, (base + i) % 2**32, now))
        self._idle.clear()
        self._wake.set()

    def cancel(self, request_id: str) -> None:
        st = self.requests.get(request_id)
        if st is not None:
            st.cancelled = True
            self._wake.set()

    async def drain(self) -> None:
        self._wake.set()
        await self._idle.wait()

    # ------------------------------------------------------------------ loop
    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            async with self.outbox.held():
                await self._retire()  # cancelled or expired meanwhile
            busy = [lane for lane in self.lanes.values() if lane.busy]
            if not busy and not self.waiting:
                self._idle.set()
                self._wake.clear()
                await self._notify()
                await self._wake.wait()
                continue
            self._admissions()
            busy = [lane for lane in self.lanes.values() if lane.busy]
            firsts, tokens, preempted = await loop.run_in_executor(
                self.executor, self._engine_step, list(self.prefilling), busy)
            self.steps += 1
            self._occ_sum += self.in_flight
            self._occ_n += 1
            async with self.outbox.held():  # the step's answers: one message per gateway
                await self._advance(firsts, tokens, time.perf_counter())
                self._requeue(preempted)
                await self._retire()  # those that just finished: GenDone with their last chunk
            self._count_prefix()
            await self._notify()

    async def _notify(self) -> None:
        async with self._stepped:
            self._stepped.notify_all()

    def _admissions(self) -> list[Sequence]:
        out: list[Sequence] = []
        kept: list[Sequence] = []
        full: set[Lane] = set()
        now_wall = time.time()
        while self.waiting and len(out) < self.per_step:
            seq = self.waiting.popleft()
            st = self.requests.get(seq.work.request_id)
            if st is None or st.cancelled or seq.work.deadline <= now_wall:
                self._finish_unstarted(seq, st)
                continue
            version = st.version or self.models.resolve(seq.work.version)
            lane = self.lanes.get(version)
            if lane is None:  # pinned to a version dropped meanwhile: cannot happen, but
                self._refuse_unstarted(seq, st, ServiceError(  # answer, never wait forever
                    503, f"version {version} is not loaded on this worker; retry shortly",
                    code="version_unavailable", retry_after=1.0))
                continue
            slot = lane.free_slot() if lane not in full else None
            if slot is not None and not st.version:
                try:
                    lane.engine.check_prompt(seq.work.prompt)  # prod may have changed
                except ValueError as exc:
                    self._refuse_unstarted(seq, st, ServiceError(400, str(exc)))
                    continue
            prompt = seq.work.prompt + seq.tokens  # a preempted one re-runs its tokens too
            if slot is None or not lane.engine.can_admit(prompt):
                full.add(lane)  # FIFO per lane: nobody overtakes a sequence that waits
                kept.append(seq)  # work for other lanes may still go
                if all(ln in full or ln.free_slot() is None for ln in self.lanes.values()):
                    break
                continue
            st.version = version
            # Host bookkeeping only (no device work), and no engine call runs now.
            lane.engine.begin(slot, prompt, seq.work.sampling, seq.seed)
            seq.lane, seq.slot = lane, slot
            if not seq.admitted:
                seq.admitted = time.perf_counter()
                seq.detok = _detokenizer(lane.engine, seq.work)
            lane.active[slot] = seq
            self.prefilling.append(seq)
            out.append(seq)
        self.waiting.extendleft(reversed(kept))
        return out

    def _engine_step(self, prefilling: list[Sequence], lanes: list[Lane]):
        """Runs on the engine thread: prompt chunks within the token budget, then per
        lane make room for the next step, dispatch it, and read the one before it."""
        firsts = []
        left = self.chunk
        for seq in prefilling:
            if left <= 0:
                break
            engine = seq.lane.engine
            n = min(left, engine.prefilling(seq.slot))
            left -= n
            try:
                first = engine.prefill_step(seq.slot, n)
            except Exception as exc:  # noqa: BLE001 - fails this sequence only
                firsts.append((seq, exc))
                continue
            if first is not None:
                firsts.append((seq, first))
                # Queued behind the step in flight: it joins the next one dispatched.
                seq.joined = seq.lane.dispatched + 1
        tokens, preempted = [], []
        for lane in lanes:
            # The next step is dispatched before the last one is read: it queues behind
            # it, so the device goes from one to the next while this thread wakes, the
            # loop takes the tokens and calls back (docs/decisions/0016).
            pending, step_no = lane.pending, lane.dispatched
            preempted += [(lane, slot) for slot in lane.engine.make_room()]
            if lane.engine.active_slots:
                lane.pending = lane.engine.step_async()
                lane.dispatched += 1
            else:
                lane.pending = None
            if pending is not None:
                tokens.append((lane, pending.result(), step_no))
        return firsts, tokens, preempted

    def _requeue(self, preempted: list[tuple[Lane, int]]) -> None:
        """Preempted sequences (their cache already freed) wait again, at the front,
        oldest first; one that finished on its last token is retired as usual."""
        back = []
        for lane, slot in preempted:
            seq = lane.active.get(slot)
            if seq is None:
                continue
            self.counters["preemptions"] += 1
            if seq in self.prefilling:
                self.prefilling.remove(seq)
            if seq.finish is not None:
                continue  # _retire frees the slot (a no-op in the engine) and closes it
            del lane.active[slot]
            seq.live, seq.slot = False, -1
            back.append(seq)
        back.sort(key=lambda q: q.admitted)
        self.waiting.extendleft(reversed(back))

    def _count_prefix(self) -> None:
        """Fold each engine's prefix-cache counts into the runner's, which outlive a
        dropped engine (counters never go down)."""
        for lane in self.lanes.values():
            stats = lane.engine.cache_stats()
            self.counters["prefix_queries"] += stats.queries - lane.seen[0]
            self.counters["prefix_hits"] += stats.hits - lane.seen[1]
            lane.seen = (stats.queries, stats.hits)

    async def _advance(self, firsts, tokens, now: float) -> None:
        for seq, tok in firsts:
            if isinstance(tok, Exception):
                log.error("prefill_failed", request_id=seq.work.request_id, error=repr(tok))
                seq.finish = "error"
                st = self.requests.get(seq.work.request_id)
                if st is not None and not st.cancelled:
                    st.cancelled = True  # its other choices stop too
                    await self.outbox.error(seq.work, internal("the model failed on this prompt"))
                continue
            self.prefilling.remove(seq)
            seq.live = True
            await self._accept(seq, int(tok), now)
        for lane, toks, step_no in tokens:
            for slot, seq in list(lane.active.items()):
                if seq.finish is not None or seq.joined > step_no or not seq.live:
                    continue
                await self._accept(seq, int(toks[slot]), now)

    async def _accept(self, seq: Sequence, tok: int, now: float) -> None:
        st = self.requests[seq.work.request_id]
        if seq.generated == 0:
            seq.first_at = now
            if not st.first_at:
                st.first_at = now
                st.admitted = seq.admitted
        else:
            gap = now - seq.last_at
            st.itl_sum += gap
            st.itl_n += 1
            st.itl_counts[itl_bucket(gap)] += 1
        seq.last_at = now
        seq.generated += 1
        seq.unsent += 1
        seq.tokens.append(tok)
        st.completion_tokens += 1
        if tok in seq.lane.eos and not seq.work.ignore_eos:
            seq.finish = "stop"
            text = seq.detok.flush()
        else:
            text = seq.detok.feed(tok)
            in_context = len(seq.work.prompt) + seq.generated  # the slot may be preempted
            if not seq.detok.stopped and (seq.generated >= seq.work.max_tokens
                                          or seq.lane.engine.max_context <= in_context):
                seq.finish = "length"
                text += seq.detok.flush()  # may still complete a stop string
            if seq.detok.stopped:
                seq.finish = "stop"
        if seq.work.stream:
            if text or seq.finish:
                await self._chunk(seq, text)
        else:
            seq.text.append(text)
            if seq.finish:
                await self._chunk(seq, "".join(seq.text))

    async def _chunk(self, seq: Sequence, text: str) -> None:
        w = seq.work
        await self.outbox.publish(w, GenChunk(
            w.request_id, seq.index, text, seq.unsent, seq.finish, w.attempt, seq.lane.version))
        seq.unsent = 0

    def _finish_unstarted(self, seq: Sequence, st: RequestState | None) -> None:
        seq.finish = "cancelled"
        if st is not None:
            st.remaining -= 1
            if st.remaining == 0:
                self._spawn(self._close_now(st))

    def _refuse_unstarted(self, seq: Sequence, st: RequestState, err: ServiceError) -> None:
        """The error first, then (once its last choice is dropped) the GenDone."""
        st.cancelled = True  # its other choices are dropped at their turn
        self._spawn(self.outbox.error(seq.work, err))
        self._finish_unstarted(seq, st)

    def _spawn(self, coro) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)  # the loop keeps only a weak reference
        task.add_done_callback(self._tasks.discard)

    async def _retire(self) -> None:
        """Free the slots of finished, cancelled and expired sequences."""
        now_wall = time.time()
        freed: list[tuple[Lane, int, Sequence]] = []
        for lane in self.lanes.values():
            for slot, seq in lane.active.items():
                st = self.requests.get(seq.work.request_id)
                if seq.finish is None and st is not None and (
                        st.cancelled or seq.work.deadline <= now_wall):
                    seq.finish = "cancelled"
                if seq.finish is not None:
                    freed.append((lane, slot, seq))
        if not freed:
            return
        await asyncio.get_running_loop().run_in_executor(
            self.executor, _free_slots, [(lane.engine, slot) for lane, slot, _ in freed])
        done: dict[str, list[str]] = {}
        for lane, slot, seq in freed:
            del lane.active[slot]
            if seq in self.prefilling:
                self.prefilling.remove(seq)
            st = self.requests.get(seq.work.request_id)
            if st is not None:
                st.remaining -= 1
                if st.remaining == 0:
                    await self._close_request(st)
                    done.setdefault(st.work.sched_id, []).append(st.work.request_id)
        if done:
            await self.outbox.done(done)

    async def _close_now(self, st: RequestState) -> None:
        await self._close_request(st)
        await self.outbox.done({st.work.sched_id: [st.work.request_id]})

    async def _close_request(self, st: RequestState) -> None:
        """Stage its GenDone (an error first when it expired unanswered); the caller
        reports it done to its scheduler."""
        w = st.work
        self.requests.pop(w.request_id, None)
        if st.cancelled or (w.deadline <= time.time() and st.remaining == 0 and not st.first_at):
            if not st.cancelled:
                await self.outbox.error(w, deadline_exceeded())
        end = time.perf_counter()
        timing = Timing(
            queue=(st.admitted or end) - st.arrived,
            compute=end - (st.admitted or end),
            ttft=(st.first_at - st.arrived) if st.first_at else 0.0,
            itl_mean=st.itl_sum / st.itl_n if st.itl_n else 0.0,
            batch_size=self.in_flight + 1,
            itl_counts=st.itl_counts if st.itl_n else [])
        version = st.version or self.models.resolve(w.version)
        await self.outbox.publish(w, GenDone(
            w.request_id, self.outbox.worker_id, self.outbox.model, version,
            len(w.prompt), st.completion_tokens, timing, w.attempt))


def _detokenizer(engine, work: GenerateWork):
    from engine.detok import Detokenizer

    return Detokenizer(engine.tokenizer, prompt_ids=work.prompt, stop=work.stop)


def _free_slots(slots: list[tuple[object, int]]) -> None:
    """Runs on the engine thread."""
    for engine, slot in slots:
        engine.free(slot)
