"""The batch lane: batch-priority work (shared.priority) waiting at a scheduler for
capacity that interactive work leaves idle.

  1. Interactive work never waits here: it is dispatched at once (or held for a cold
     start, services.scheduler.holds). Batch work admitted while a worker is ready
     goes out at once only to a worker with room (`room`: fewer requests outstanding
     than its batch size, a decoder's slots) and only when no older batch work of
     its model waits; otherwise it waits here, oldest first, per model.
  2. Whenever capacity may have freed (a WorkDone, a heartbeat, a cold start's
     release, the housekeeping tick) the scheduler takes the waiting work out,
     oldest first, one request per unit of room (`first` / `pop`), so batch work
     never sits in a worker's queue ahead of interactive work that arrives later.
  3. Bounded: at most `max_queue_per_worker` x the ready workers (at least one) wait
     per model; one more is a 429 (`put`).
  4. Never refused for the work ahead or its deadline estimate: it waits instead.
     It waits at most WAIT_SHARE of the time it had on arrival, then gets a 429 with
     Retry-After (`expire`); the batch runner sends it again, and a generation
     dispatched before then keeps the rest of its time to generate.
  5. What waits here is not counted ahead of anyone (not in the admission tally, the
     holds or the load reports); once dispatched it counts as any work.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass
from typing import Callable, Iterator

from services.fleet import WorkerView
from shared.errors import ServiceError, overloaded
from shared.messages import WorkRequest

WAIT_SHARE = 0.5  # of the time a batch request had on arrival: the most it waits here
RETRY_AFTER_S = 1.0  # a full lane's hint (a runner backs off further on repeats)


def room(capacity: int, load: int) -> int:
    """Batch requests a worker takes now: `capacity` (its heartbeat's max_batch: an
    encoder's batch, a decoder's slots; at least one) less the requests outstanding
    on it (`load`, whichever lane they came from)."""
    return max(0, max(capacity, 1) - load)


def idle(ready: list[WorkerView], load: Callable[[WorkerView], int]) -> list[WorkerView]:
    """The workers of `ready` with room for batch work, by each one's `load`."""
    return [w for w in ready if room(w.hb.max_batch, load(w))]


@dataclass
class Waiting:
    work: WorkRequest
    since: float  # monotonic: when it began to wait
    until: float  # UNIX seconds: when it stops waiting (a 429)


class BatchLane:
    def __init__(self, max_queue_per_worker: int) -> None:
        self.max_queue_per_worker = max_queue_per_worker
        self.by_model: dict[str, deque[Waiting]] = {}

    def put(self, work: WorkRequest, n_ready: int, now: float | None = None) -> int:
        """Wait for room (`now`: UNIX seconds, default the clock); 429 when the model's
        lane is full. Returns how many of the model's requests wait now."""
        model = work.model
        waiting = self.by_model.setdefault(model, deque())
        if len(waiting) >= self.max_queue_per_worker * max(n_ready, 1):
            if not waiting:
                del self.by_model[model]
            raise overloaded(f"model '{model}' has {len(waiting)} batch requests waiting for "
                             "idle capacity; retry after the hinted delay",
                             retry_after=RETRY_AFTER_S)
        now = time.time() if now is None else now
        until = now + max(0.0, work.deadline - now) * WAIT_SHARE
        waiting.append(Waiting(work, time.monotonic(), until))
        return len(waiting)

    def waits(self, model: str) -> bool:
        return bool(self.by_model.get(model))

    def first(self, model: str) -> Waiting | None:
        """The oldest batch request of `model` waiting, still waiting."""
        waiting = self.by_model.get(model)
        return waiting[0] if waiting else None

    def pop(self, model: str) -> Waiting:
        """The oldest, no longer waiting (the caller dispatches it)."""
        waiting = self.by_model[model]
        out = waiting.popleft()
        if not waiting:
            del self.by_model[model]
        return out

    def take(self, model: str, idle_for: Callable[[WorkRequest], list[WorkerView]]
             ) -> Iterator[tuple[WorkRequest, list[WorkerView]]]:
        """The waiting work of `model`, oldest first, each with the workers that have
        room for it (`idle_for`, asked again after each: the caller dispatches one
        before it asks for the next), until the oldest finds none."""
        while (head := self.first(model)) is not None:
            workers = idle_for(head.work)
            if not workers:
                return
            yield self.pop(model).work, workers

    def drop(self, request_id: str) -> WorkRequest | None:
        """The waiting request `request_id` (its gateway cancelled it), no longer
        waiting; None when it does not wait here."""
        for model, waiting in self.by_model.items():
            for w in waiting:
                if w.work.request_id == request_id:
                    waiting.remove(w)
                    if not waiting:
                        del self.by_model[model]
                    return w.work
        return None

    def count(self, model: str) -> int:
        waiting = self.by_model.get(model)
        return len(waiting) if waiting else 0

    def models(self) -> list[str]:
        return list(self.by_model)

    def expire(self, now: float) -> list[tuple[WorkRequest, ServiceError]]:
        """Waiting work past its wait (`now`: UNIX seconds), each with its 429; no
        longer waiting."""
        out = []
        for model in list(self.by_model):
            keep: deque[Waiting] = deque()
            for w in self.by_model[model]:
                if w.until <= now:
                    waited = time.monotonic() - w.since
                    out.append((w.work, overloaded(
                        f"model '{model}' had no idle capacity for this batch request in "
                        f"{waited:.1f} s (interactive traffic comes first); retry after the "
                        "hinted delay", retry_after=RETRY_AFTER_S)))
                else:
                    keep.append(w)
            if keep:
                self.by_model[model] = keep
            else:
                del self.by_model[model]
        return out
