"""The decoder runner: continuous batching, one engine call per iteration.

Three parts, split as vLLM v1 splits its engine core: the step scheduler
(`decode.scheduler`: queue, lanes, admission, preemption, which step each sequence
is in; host only), the output processor (`decode.output`: detokenizing, stop
checks, chunks, the GenDone and its timing; no engine), and this thin loop, which
owns the asyncio side: the engine thread, the outbox, the events.

  1. `submit()` checks the prompt against prod's engine (a 400 at once if it cannot
     fit) and queues its `n` choices with the scheduler.
  2. Each iteration first frees the slots of sequences that finished, were
     cancelled or ran out of time (on the engine thread; a request's deadline
     bounds the wait for its first token, then its stall timeout and `end_by` do),
     then asks the scheduler for a plan: the sequences admitted now, their prompt
     chunks within the token budget, the lanes to step. Work dropped or refused
     while it waited is answered at once.
  3. One call on the engine thread runs the plan: the prompt chunks, then per lane
     room in the cache for the next step (`make_room`: the scheduler's policy
     names the sequences preempted, the newest first), the next step dispatched (`step_async`), and only then the tokens
     of the step before it read: step n+1 waits on the device behind step n, and
     detokenizing and publishing step n overlap its computation
     (docs/decisions/0016).
  4. The scheduler matches the tokens read to the sequences that were in that step;
     the output processor turns each into chunks; preempted sequences go back to
     the front of the queue; finished ones are freed and their GenDones staged.
     Everything one step produced (chunks, GenDones, errors) leaves as one message
     per gateway (`Outbox.held`).
  5. Lanes follow `LoadedModels` by callback, so a new prod gets a lane the moment
     it is switched in; a version no alias names keeps its lane while a sequence
     runs or waits on it (`wait_unused`); then the hot swap drops it, and its lane
     goes with it.
  6. A quantized engine that found no stored choice of compute forms measures them
     after ready (engine/decoder/formchoice.py): one (bucket, form) on the engine
     thread whenever the loop is idle, and one every FORMS_EVERY iterations while
     it is busy, each between two iterations, once its program is compiled (the
     engine's background compiles wake the loop).
"""

from __future__ import annotations

import asyncio
import random
import time
import weakref
from concurrent.futures import Executor
from typing import TYPE_CHECKING, Any, cast

from services.worker.decode.output import OutputProcessor, Say
from services.worker.decode.scheduler import (
    Lane, LaneStep, Request, Sequence, StepPlan, StepResult, StepScheduler)
from services.worker.runner import Gauges, Outbox
from services.worker.versions import LoadedModels
from shared.costs import GenCostBook
from shared.errors import ServiceError, internal
from shared.logging import get_logger
from shared.messages import GenerateWork, TokenLogprob

if TYPE_CHECKING:
    from engine.interface import Decoder

log = get_logger("worker.generation")
FORMS_EVERY = 16  # busy iterations per compute-form measurement (one (bucket, form))


class DecoderRunner:
    """Continuous batching over a worker's decoder versions (a `runner.Runner`)."""

    work_type = GenerateWork

    def __init__(self, models: LoadedModels, outbox: Outbox, executor: Executor,
                 prefill_per_step: int, prefill_chunk: int = 512) -> None:
        self.models = models
        self.outbox = outbox
        self.executor = executor
        self.costs = GenCostBook()  # prefill and step costs, for the heartbeat (admission)
        self.sched = StepScheduler(models.resolve, prefill_per_step, prefill_chunk,
                                   riders=self._riders)
        self.output = OutputProcessor(outbox.worker_id, outbox.model)
        # Prefix-cache counts and preemptions, since start (Any: they go into Gauges by name).
        self.counters: dict[str, Any] = self.sched.counters
        self.steps = 0
        self.generated = 0  # tokens generated since start, over every request
        self._occ_sum = 0
        self._occ_n = 0
        self._wake = asyncio.Event()
        self._idle = asyncio.Event()
        self._idle.set()
        self._stepped = asyncio.Condition()
        self._tasks: set[asyncio.Task] = set()
        self._scoring: dict[str, bool] = {}  # echo requests whose prompt is scored -> cancelled
        self._closed = False  # drained: `run` ends once nothing is held
        self._loop: asyncio.AbstractEventLoop | None = None  # set by `run`
        self._heard: weakref.WeakSet = weakref.WeakSet()  # engines whose compiles wake it
        self._unmeasured: weakref.WeakSet = weakref.WeakSet()  # whose measuring failed
        models.on_change(self._follow)
        self._follow()

    def _riders(self, interactive: int) -> int:
        """Batch sequences that may share the steps of `interactive` ones
        (services.worker.decode.scheduler rule 6): on a CPU each row adds about a
        quarter of a one-row step, so none; on an accelerator a row is nearly free
        until the batch is large, so every slot (docs/decisions/0088)."""
        engine = self.models.prod_engine
        if engine is None or engine.info.device.split(":")[0] == "cpu":
            return 0
        return engine.info.slots

    # ------------------------------------------------------------- versions
    def _follow(self) -> None:
        """LoadedModels changed: a lane per engine it holds, none for one it dropped."""
        self.sched.follow(self.models.engines)
        self._listen()
        self._wake.set()

    def _listen(self) -> None:
        """Wake the loop when an engine's background compile joins: a compute form's
        measuring program may be due (`_measure_forms`)."""
        loop = self._loop
        if loop is None:
            return

        def wake() -> None:
            loop.call_soon_threadsafe(self._wake.set)

        for lane in self.lanes.values():
            if lane.engine not in self._heard:
                self._heard.add(lane.engine)
                lane.engine.on_compiled(wake)

    @property
    def lanes(self) -> dict[str, Lane]:
        return self.sched.lanes

    @property
    def requests(self) -> dict[str, Request]:
        return self.sched.requests

    def uses(self, version: str) -> bool:
        return self.sched.uses(version)

    async def wait_unused(self, version: str) -> None:
        async with self._stepped:
            await self._stepped.wait_for(lambda: not self.uses(version))

    # ------------------------------------------------------------- accounting
    @property
    def queue_depth(self) -> int:
        return len(self.sched.waiting)

    @property
    def in_flight(self) -> int:
        return self.sched.running

    @property
    def compiling(self) -> bool:
        return any(lane.engine.stats().compiling for lane in list(self.lanes.values()))

    def _compile_waited(self) -> float:
        return sum(lane.engine.stats().compile_waited_s for lane in list(self.lanes.values()))

    def gauges(self) -> Gauges:
        serving = [self.lanes[v] for v in self.models.serving() if v in self.lanes]
        slots = sum(lane.engine.info.slots for lane in serving) or 1
        used = self.in_flight
        if self._occ_n:
            occ = self._occ_sum / (self._occ_n * slots)
            self._occ_sum = self._occ_n = 0
        else:
            occ = used / slots
        # Cache blocks held, over every loaded engine (a retiring one still holds its).
        stats = [lane.engine.stats().cache for lane in self.lanes.values()]
        return Gauges(queue_depth=self.queue_depth, in_flight=used, max_batch=slots,
                      occupancy=min(occ, 1.0), steps=self.steps,
                      kv_blocks_total=sum(c.blocks for c in stats),
                      kv_blocks_used=sum(c.held for c in stats), **self.counters,
                      **self._prefix_summary(serving))

    @staticmethod
    def _prefix_summary(serving: list[Lane]) -> dict:
        """What prod's engine holds, for prefix-aware routing (bounded)."""
        from shared.prefix import SUMMARY_KEYS

        engine = serving[0].engine if serving else None
        block = engine.info.prefix_block if engine is not None else 0  # 0: cache off
        if not block:
            return {}
        assert engine is not None  # a block came from it
        return {"prefix_block": block, "prefix_keys": engine.stats(SUMMARY_KEYS).prefixes}

    def _count_prefix(self) -> None:
        """Fold each engine's prefix-cache counts into the runner's, which outlive a
        dropped engine (counters never go down)."""
        for lane in self.lanes.values():
            counts = lane.engine.stats()
            stats = counts.cache
            self.counters["prefix_cache_queries"] += stats.queries - lane.seen[0]
            self.counters["prefix_cache_hits"] += stats.hits - lane.seen[1]
            lane.seen = (stats.queries, stats.hits)
            spec = counts.spec
            now = (spec.steps, spec.drafted, spec.accepted)
            for name, new, was in zip(("spec_decode_drafts", "spec_decode_draft_tokens",
                                       "spec_decode_accepted_tokens"), now, lane.spec_seen):
                self.counters[name] += new - was
            lane.spec_seen = now

    # -------------------------------------------------------------- requests
    def submit(self, work: GenerateWork) -> None:
        now = time.perf_counter()
        if work.request_id in self.sched.requests:
            # A scheduler re-sent work this worker still runs (it judged the worker
            # stalled): the gateway keeps one answer per request, and this one goes on.
            log.info("duplicate_work_ignored", request_id=work.request_id)
            return
        # The worker submits only work of a version it holds (or unpinned: prod).
        engine = cast("Decoder", self.models.engines.get(self.models.resolve(work.version)))
        try:
            engine.check(work.prompt, work.sampling)  # an engine without every control: 400
        except ValueError as exc:
            self._spawn(self.outbox.refuse(work, ServiceError(400, str(exc))))
            return
        seed = work.sampling.seed if work.sampling.seed is not None else random.getrandbits(32)
        self._idle.clear()
        if work.prompt_logprobs >= 0:  # echo with logprobs: the prompt scored first
            self._spawn(self._scored(work, engine, now, seed))
            return
        self._add(work, now, seed)

    def _add(self, work: GenerateWork, now: float, seed: int, prompt_logprobs=()) -> None:
        self.sched.add(work, now, seed)
        self.output.add(work, now, prompt_logprobs)
        self._wake.set()

    async def _scored(self, work: GenerateWork, engine, now: float, seed: int) -> None:
        """The prompt's logprobs, computed on the engine thread between steps, then
        the request joins the queue (they ride in each choice's first chunk)."""
        loop = asyncio.get_running_loop()
        self._scoring[work.request_id] = False
        try:
            got = await loop.run_in_executor(self.executor, engine.prompt_logprobs,
                                             work.prompt, work.prompt_logprobs)
        except ValueError as exc:
            await self.outbox.refuse(work, ServiceError(400, str(exc)))
            self._wake.set()
            return
        finally:
            cancelled = self._scoring.pop(work.request_id, False)
        if cancelled:  # its client left meanwhile: nothing generated, its scheduler told
            await self.outbox.done({work.sched_id: [work.request_id]})
            self._wake.set()
            return
        self._add(work, now, seed, [TokenLogprob(*entry) for entry in got])

    def cancel(self, request_id: str) -> None:
        if request_id in self._scoring:  # not queued yet: dropped once its scoring ends
            self._scoring[request_id] = True
        elif self.sched.cancel(request_id):
            self._wake.set()

    async def drain(self) -> None:
        """Answer what is held, then end `run` (the worker stopped taking work first)."""
        self._closed = True
        self._wake.set()
        await self._idle.wait()

    # ------------------------------------------------------------------ loop
    async def run(self) -> None:
        loop = self._loop = asyncio.get_running_loop()
        self._listen()
        while True:
            async with self.outbox.held():
                await self._retire()  # cancelled or expired meanwhile
            if not self.sched.busy:
                if not self._closed and await self._measure_forms():
                    continue  # then look for work again
                if not self._scoring:  # an echo prompt being scored is held work too
                    self._idle.set()
                self._wake.clear()
                await self._notify()
                if self._closed and self._idle.is_set():
                    return
                await self._wake.wait()
                continue
            if self.steps % FORMS_EVERY == FORMS_EVERY - 1 and not self._closed:
                await self._measure_forms()
            plan, adm = self.sched.schedule(time.time(), time.perf_counter())
            for work, err in adm.refused:  # the error before its GenDone
                self._spawn(self.outbox.error(work, err))
            for req in adm.closed:
                self._spawn(self._close_now(req))
            t0, waited = time.perf_counter(), self._compile_waited()
            result = await loop.run_in_executor(self.executor, _execute, plan)
            if self._compile_waited() == waited:  # a step that compiled: not the model's cost
                self.costs.observe(time.perf_counter() - t0, *_measured(plan, result))
            self.steps += 1
            self._occ_sum += self.in_flight
            self._occ_n += 1
            async with self.outbox.held():  # the step's answers: one message per gateway
                await self._advance(result, time.perf_counter())
                self.sched.requeue(result)
                await self._retire()  # those that just finished: GenDone with their last chunk
            self._count_prefix()
            await self._notify()

    async def _measure_forms(self) -> bool:
        """One step of an engine's compute-form choice (a (bucket, form) measured or a
        bucket switched), on the engine thread -> whether there was one."""
        for lane in list(self.lanes.values()):
            engine = lane.engine
            if engine in self._unmeasured or not engine.stats().tune_due:
                continue
            try:
                await asyncio.get_running_loop().run_in_executor(self.executor, engine.tune, 1)
            except Exception as exc:  # noqa: BLE001 - it serves on with the forms it runs
                log.error("form_measuring_failed", error=repr(exc))
                self._unmeasured.add(engine)
            return True
        return False

    async def _notify(self) -> None:
        async with self._stepped:
            self._stepped.notify_all()

    async def _advance(self, result: StepResult, now: float) -> None:
        for seq, tok in self.sched.update(result, time.time()):
            if isinstance(tok, BaseException):
                log.error("prefill_failed", request_id=seq.work.request_id, error=repr(tok))
                if self.sched.fail(seq):  # its other choices stop too
                    await self.outbox.error(seq.work, internal("the model failed on this prompt"))
                continue
            if seq.finish is not None:
                continue  # it ended on an earlier token of the same speculative step
            self.generated += 1
            await self._say(self.output.accept(seq, tok, now))

    async def _say(self, says: list[Say]) -> None:
        for say in says:
            if isinstance(say.message, ServiceError):
                await self.outbox.error(say.work, say.message)
            else:
                await self.outbox.publish(say.work, say.message)

    async def _retire(self) -> None:
        """Free the slots of finished, cancelled and expired sequences."""
        freed = self.sched.retiring(time.time())
        yielded = self.sched.yielding(time.perf_counter())  # making way for interactive work
        if not freed and not yielded:
            return
        for _, _, seq in freed:  # how much of max_tokens sequences use: admission's estimate
            self.costs.finished(len(seq.tokens), seq.work.max_tokens)
        await asyncio.get_running_loop().run_in_executor(
            self.executor, _free_slots, [(lane.engine, slot) for lane, slot, _ in freed + yielded])
        if yielded:
            log.debug("batch_yielded", sequences=len(yielded))
            self.sched.park(yielded, time.perf_counter())
        done: dict[str, list[str]] = {}
        for req, running in self.sched.retire(freed):
            await self._close(req, running)
            done.setdefault(req.work.sched_id, []).append(req.work.request_id)
        if done:
            await self.outbox.done(done)

    async def _close_now(self, req: Request) -> None:
        """A request whose every choice was dropped before it started."""
        await self._close(req, self.in_flight)
        await self.outbox.done({req.work.sched_id: [req.work.request_id]})

    async def _close(self, req: Request, running: int) -> None:
        version = req.version or self.models.resolve(req.work.version)
        await self._say(self.output.close(req, version, running, time.perf_counter()))

    def _spawn(self, coro) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)  # the loop keeps only a weak reference
        task.add_done_callback(self._tasks.discard)


def _execute(plan: StepPlan) -> StepResult:
    """Runs on the engine thread: the plan's prompt chunks, then per lane make room
    for the next step, dispatch it, and read the one before it. An engine that mixes
    (engine/decoder/steps.py `mixed`) may take a chunk into that step's pass instead;
    a prompt it finishes there is in that step (its first token in its result)."""
    firsts: list[tuple[Sequence, int | BaseException]] = []
    riding: list[Sequence] = []  # chunks handed to the step
    for seq, n in plan.prefill:
        try:
            assert seq.lane is not None  # admitted: a prefilling sequence has its lane
            first = seq.lane.engine.prefill_step(seq.slot, n, mix=True)
        except Exception as exc:  # noqa: BLE001 - fails this sequence only
            firsts.append((seq, exc))
            continue
        if first is not None:
            firsts.append((seq, first))
        else:
            riding.append(seq)
    lanes = []
    for lane in plan.lanes:
        # The next step is dispatched before the last one is read: it queues behind
        # it, so the device goes from one to the next while this thread wakes, the
        # loop takes the tokens and calls back (docs/decisions/0016).
        engine = lane.engine
        preempted = engine.make_room(lane.victim)  # the scheduler's policy
        pending = engine.step_async()
        joined = [seq for seq in riding if seq.lane is lane and seq.slot not in preempted
                  and not engine.prefilling(seq.slot)]  # fmt: skip
        tokens = lane.pending.result() if lane.pending is not None else None  # [slots]
        more = lane.pending.more if lane.pending is not None else {}
        lanes.append(LaneStep(lane, pending, tokens, preempted, more, joined))
    return StepResult(firsts, lanes)


def _measured(plan: StepPlan, result: StepResult) -> tuple[int, int, int]:
    """What one iteration computed, for its cost: (prompt tokens, prompt chunks,
    sequences in the decode steps it read; 0 when it read none)."""
    rows = sum(sum(s.live for s in ls.lane.active.values())
               for ls in result.lanes if ls.tokens is not None)
    return sum(n for _, n in plan.prefill), len(plan.prefill), rows


def _free_slots(slots: list[tuple[Decoder, int]]) -> None:
    """Runs on the engine thread."""
    for engine, slot in slots:
        engine.free(slot)
