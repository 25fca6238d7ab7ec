"""The encoder runner: dynamic batching.

  1. Work arrives in `submit()` and waits in a FIFO inbox.
  2. When the engine is free, the loop closes a batch: everything waiting for the same
     model version as the oldest request, up to `max_batch` inputs (a batch runs on one
     engine, so it holds one version; unpinned work takes the version that is prod
     when its batch closes, and other versions keep their place). It first waits (at
     most `max_wait_s` after the oldest arrival) until as many inputs wait as the
     largest of the last few batches: under steady load batches stay full, while a
     lone request (recent batches of one) never waits at all. The wait is also never
     longer than a recent batch took to compute: it exists to save a whole batch for
     the stragglers, so with an engine whose batch costs 0.1 ms, waiting 5 ms would
     spend fifty times what it saves (docs/decisions/0016).
  3. Expired requests are answered 504 and never computed; a request cancelled while
     it waits leaves the inbox at once (never computed) and is reported done to its
     scheduler. One already computing finishes: it is a single engine call.
  4. The batch runs on the single engine thread, on the engine `LoadedModels` holds
     for its version at that moment; the event loop stays free.
  5. Each request's EmbedResult (naming the version that computed it) goes to its
     reply subject through the outbox, then one WorkDone per scheduler per batch.
"""

from __future__ import annotations

import asyncio
import time
from collections import defaultdict, deque
from concurrent.futures import Executor
from dataclasses import dataclass, field
from typing import cast

import numpy as np

from services.worker.runner import Gauges, Outbox
from services.worker.versions import LoadedModels
from shared.errors import ServiceError, bad_request, deadline_exceeded, internal, too_large
from shared.logging import get_logger
from shared.messages import EmbedResult, EmbedWork, Timing

log = get_logger("worker.batcher")


@dataclass
class Pending:
    work: EmbedWork
    arrived: float  # perf_counter
    closed: float = 0.0  # when its batch was closed


@dataclass
class BatchOutcome:
    items: list[Pending]
    vectors: list[np.ndarray]  # per item: [n_inputs, dim] float32
    timings: list[Timing]
    error: BaseException | None = None  # the whole batch failed
    failed: list[tuple["Pending", BaseException]] = field(default_factory=list)
    version: str = ""  # the model version that computed it


@dataclass
class BatchStats:
    batches: int = 0
    items: int = 0
    inputs: int = 0
    window_batches: int = 0
    window_inputs: int = 0

    def take_occupancy(self, max_batch: int) -> float:
        if not self.window_batches:
            return 0.0
        occ = self.window_inputs / (self.window_batches * max_batch)
        self.window_batches = self.window_inputs = 0
        return min(occ, 1.0)


BATCH_S_WEIGHT = 0.2  # moving-average weight of the newest batch's compute time


def run_encoder(engine, inputs: list[list[int]],
                types: list[list[int]] | None = None, raw: bool = False) -> np.ndarray:
    """One engine call: a cross-encoder (`task` "score", `engine.interface.Reranker`)
    scores `inputs` as text pairs with their token types (all 0 when none are given:
    the warm-up's probes), `raw`: its logits; an embedder embeds them.
    [len(inputs), dim] float32."""
    if engine.task == "score":
        return engine.score(inputs, types if types is not None else [[0] * len(x) for x in inputs],
                            raw=raw)
    return engine.embed(inputs)


class EncoderRunner:
    """Dynamic batching over a worker's encoder versions (a `runner.Runner`)."""

    work_type = EmbedWork
    costs = None  # an encoder's cost is the one its warm-up timed

    def __init__(self, models: LoadedModels, outbox: Outbox, executor: Executor,
                 max_batch: int, max_wait_s: float) -> None:
        self.models = models
        self.outbox = outbox
        self.executor = executor
        self.max_batch = max_batch
        self.max_wait_s = max_wait_s
        self.inbox: deque[Pending] = deque()
        self.in_flight = 0
        self.steps = 0  # engine calls finished
        self.compiling = False  # an encoder compiles every bucket before it is ready
        self.stats = BatchStats()
        self._wake = asyncio.Event()
        self._idle = asyncio.Event()
        self._idle.set()
        self._closed = False
        self._waiting = 0  # inputs in the inbox
        self._recent: deque[int] = deque(maxlen=8)  # sizes of the last batches
        self._batch_s: float | None = None  # recent batches' compute time (moving average)
        self.computing: str | None = None  # version of the batch on the engine thread
        self._batch_done = asyncio.Condition()
        self._tasks: set[asyncio.Task] = set()  # the loop keeps only weak references

    @property
    def queue_depth(self) -> int:
        return len(self.inbox)

    def gauges(self) -> Gauges:
        return Gauges(queue_depth=self.queue_depth, in_flight=self.in_flight,
                      max_batch=self.max_batch, occupancy=self.stats.take_occupancy(self.max_batch),
                      steps=self.steps)

    def submit(self, work: EmbedWork) -> None:
        self.inbox.append(Pending(work, time.perf_counter()))
        self._waiting += len(work.inputs)
        self._idle.clear()
        self._wake.set()

    def cancel(self, request_id: str) -> None:
        """Drop `request_id` if it still waits (its gateway wants no answer); its
        scheduler hears it is done, as for any finished request."""
        p = next((p for p in self.inbox if p.work.request_id == request_id), None)
        if p is None:
            return  # unknown, answered, or in the batch computing now
        self.inbox.remove(p)
        self._waiting -= len(p.work.inputs)
        task = asyncio.get_running_loop().create_task(
            self.outbox.done({p.work.sched_id: [request_id]}))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        self._wake.set()  # a batch waiting to fill looks again

    async def drain(self) -> None:
        self.close()
        await self.wait_idle()

    def close(self) -> None:
        self._closed = True
        self._wake.set()

    async def wait_idle(self) -> None:
        await self._idle.wait()

    def uses(self, version: str) -> bool:
        """Whether a computing batch runs on `version` or queued work pins it."""
        return self.computing == version or any(p.work.version == version for p in self.inbox)

    async def wait_unused(self, version: str) -> None:
        """Until nothing computing or queued needs `version` (unpinned work never does:
        it takes whichever version is prod when its batch closes)."""
        async with self._batch_done:
            await self._batch_done.wait_for(lambda: not self.uses(version))

    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            if not self.inbox:
                self._idle.set()
                if self._closed:
                    return
                self._wake.clear()
                await self._wake.wait()
                continue
            version, batch = await self._close_batch()
            if not batch:
                await self._notify()
                continue
            self.in_flight, self.computing = len(batch), version
            try:
                outcome = await loop.run_in_executor(self.executor, self._compute, version, batch)
            finally:
                self.in_flight, self.computing = 0, None
            await self._publish(outcome)
            await self._notify()

    async def _notify(self) -> None:
        async with self._batch_done:
            self._batch_done.notify_all()

    async def _close_batch(self) -> tuple[str, list[Pending]]:
        target = min(self.max_batch, max(self._recent, default=1))
        wait_s = self.max_wait_s if self._batch_s is None else min(self.max_wait_s, self._batch_s)
        if wait_s > 0 and self._waiting < target:
            deadline = self.inbox[0].arrived + wait_s
            while self._waiting < target and not self._closed:
                left = deadline - time.perf_counter()
                if left <= 0:
                    break
                self._wake.clear()
                try:  # asyncio.timeout: wait_for (3.11) may swallow a cancellation
                    async with asyncio.timeout(left):
                        await self._wake.wait()
                except TimeoutError:
                    break
        now_wall, now = time.time(), time.perf_counter()
        version, batch, expired, kept = self._take(now_wall, now)
        self.inbox.extendleft(reversed(kept))
        if batch:  # before any await: the hot swap must see this version in use
            self.computing = version
        for p in expired:
            await self.outbox.refuse(p.work, deadline_exceeded(
                "the request expired in the worker's queue"))
        if batch:
            self._recent.append(sum(len(p.work.inputs) for p in batch))
        return version, batch

    def _take(self, now_wall: float, now: float):
        """Split the inbox: the batch (one version, FIFO), expired work, the rest.

        Synchronous, so the version chosen for unpinned work cannot change under it."""
        version: str | None = None
        batch: list[Pending] = []
        expired: list[Pending] = []
        kept: list[Pending] = []
        n, full = 0, False
        while self.inbox:
            p = self.inbox.popleft()
            size = len(p.work.inputs)
            if p.work.deadline <= now_wall:
                self._waiting -= size
                expired.append(p)
                continue
            v = self.models.resolve(p.work.version)
            if version is None:
                version = v
            if full or v != version or (batch and n + size > self.max_batch):
                full = full or v == version  # later work of this version waits its turn
                kept.append(p)
                continue
            self._waiting -= size
            p.closed = now
            batch.append(p)
            n += size
        return version or "", batch, expired, kept

    def _compute(self, version: str, batch: list[Pending]) -> BatchOutcome:
        """Runs on the engine thread."""
        out: BatchOutcome | list[np.ndarray]  # the whole outcome, or the batch's vectors
        engine = self.models.engine_of(version)
        scoring = engine.task == "score"
        keep = [p for p in batch if bool(p.work.types) == scoring]
        if len(keep) < len(batch):  # never sent by a gateway: it asks the model's own task
            wrong = [p for p in batch if bool(p.work.types) != scoring]
            out = self._compute(version, keep) if keep else BatchOutcome([], [], [], version=version)
            what = "scores text pairs (rerank, score)" if scoring else "embeds texts"
            out.failed += [(p, bad_request(f"model '{p.work.model}' {what}; this request "
                                           f"asks for the other")) for p in wrong]  # fmt: skip
            return out
        flat = [ids for p in batch for ids in p.work.inputs]
        types = [t for p in batch for t in p.work.types] if scoring else None
        start = time.perf_counter()
        try:
            # pairs: the logits, each request's activated here unless it asks for them
            vecs = run_encoder(engine, flat, types, raw=scoring)  # [sum(inputs), dim]
            self.steps += 1
        except Exception as exc:  # noqa: BLE001 - reported per request
            if len(batch) == 1:
                return BatchOutcome(batch, [], [], exc, version=version)
            return self._compute_one_by_one(version, batch)
        end = time.perf_counter()
        took, was = end - start, self._batch_s
        self._batch_s = took if was is None else was + BATCH_S_WEIGHT * (took - was)
        out, timings, i = [], [], 0
        normalize = engine.normalize
        for p in batch:
            k = len(p.work.inputs)
            v = vecs[i:i + k]
            if scoring:
                out.append(v if p.work.raw else engine.activate(v))
            else:
                out.append(matryoshka(v, p.work.dimensions, normalize))
            i += k
            timings.append(Timing(batch_wait=p.closed - p.arrived, queue=start - p.closed,
                                  compute=end - start, batch_size=len(flat)))
        self.stats.batches += 1
        self.stats.window_batches += 1
        self.stats.items += len(batch)
        self.stats.inputs += len(flat)
        self.stats.window_inputs += len(flat)
        return BatchOutcome(batch, out, timings, version=version)

    def _compute_one_by_one(self, version: str, batch: list[Pending]) -> BatchOutcome:
        """A batch failed: isolate the culprit so its batch-mates still get answers."""
        outs = [self._compute(version, [p]) for p in batch]
        merged = BatchOutcome([], [], [], version=version)
        failed = [o for o in outs if o.error is not None]
        for o in outs:
            if o.error is None:
                merged.items += o.items
                merged.vectors += o.vectors
                merged.timings += o.timings
        merged.failed = [(o.items[0], cast(BaseException, o.error)) for o in failed]
        return merged

    def _refusal(self, work: EmbedWork, vecs) -> ServiceError | None:
        """What keeps computed vectors from their requester: a width wider than the
        model's, or an answer larger than one bus message (a gateway cuts large
        requests into parts that fit; a NATS client must send fewer inputs)."""
        if work.dimensions > vecs.shape[1]:
            return bad_request(f"'dimensions' is {work.dimensions}; model '{work.model}' "
                               f"embeds in {vecs.shape[1]}")
        size, limit = vecs.shape[0] * vecs.shape[1] * 4 + RESULT_FRAMING, self.outbox.max_payload
        if 0 < limit < size:
            return too_large(f"the answer would take {size} bytes and the bus carries at "
                             f"most {limit} in one message: send fewer inputs per request")
        return None

    async def _publish(self, out: BatchOutcome) -> None:
        """Every request of a batch answered, then one WorkDone per scheduler."""
        done: dict[str, list[str]] = defaultdict(list)
        failed = [(p, out.error) for p in out.items] if out.error is not None else []
        for p, exc in failed + out.failed:
            if isinstance(exc, ServiceError):  # the request's own fault
                await self.outbox.error(p.work, exc, out.version)
            else:
                log.error("request_failed", request_id=p.work.request_id, error=repr(exc))
                await self.outbox.error(p.work, internal("the model failed on this input"),
                                        out.version)
            done[p.work.sched_id].append(p.work.request_id)
        if out.error is None:
            for p, vecs, timing in zip(out.items, out.vectors, out.timings):
                w = p.work
                refused = self._refusal(w, vecs)
                if refused is not None:
                    await self.outbox.error(w, refused, out.version)
                    done[w.sched_id].append(w.request_id)
                    continue
                await self.outbox.publish(w, EmbedResult(
                    w.request_id, self.outbox.worker_id, self.outbox.model, out.version,
                    int(vecs.shape[1]), vecs.astype("<f4", copy=False).tobytes(),
                    sum(len(x) for x in w.inputs), timing))
                done[w.sched_id].append(w.request_id)
        await self.outbox.done(done, max((t.compute for t in out.timings), default=0.0), sum(len(x) for p in out.items for x in p.work.inputs))


RESULT_FRAMING = 1024  # bytes an EmbedResult adds to its vectors, at most


def matryoshka(vecs, width: int, normalize: bool):
    """A Matryoshka model's vectors cut to their first `width` components, and
    renormalised when the model's own vectors are unit length (0, or at least the
    full width: unchanged; wider is refused when published)."""
    if not width or width >= vecs.shape[1]:
        return vecs
    cut = vecs[:, :width]
    if normalize:
        norms = np.linalg.norm(cut, axis=1, keepdims=True)
        cut = cut / np.maximum(norms, 1e-12)
    return cut
