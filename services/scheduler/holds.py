"""Cold-start holding: requests for a model no ready worker takes yet.

  1. A request admitted while no ready worker takes new work for its model (none
     running, all warming, or all above the memory threshold) is held, oldest first,
     and counts against the model's queue bound as if one worker were ready; the
     gateway is told (`Held`) and demand goes out at once (the service does both).
  2. The first worker that becomes ready gets them (`take`), each admitted again with
     the time it was held (its `Accepted`): interactive work first, then batch work
     (shared.priority), which takes the room left or waits in the batch lane. Held
     batch work is not counted ahead of arrivals (`tally`).
  3. A generation is held until its deadline or, when this scheduler has seen a
     worker of the model start (`observe_start`: the slowest start measured), until
     that cold start has passed with some margin, if its `end_by` (the client's own
     timeout, else TENSORBUS_MAX_GENERATION_S) allows: its deadline moves there and
     the gateway is told (`Held.until`). One whose deadline passes first ends with a
     504 that says it was held (`expire`); a model the orchestrator says `failed`
     ends them with a 503 (`fail`).
  4. One its gateway cancels (its client left, or its time ran out there first) is
     dropped (`drop`): never dispatched, never generated.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass

from services.scheduler.admission import work_size
from shared.admission import Tally
from shared.errors import ServiceError, deadline_exceeded, overloaded, unavailable
from shared.messages import GenerateWork, WorkRequest
from shared.priority import BATCH

START_MARGIN = 1.25  # a held request waits this many measured cold starts: a start
# also spends time before the worker measures (the interpreter, imports)


@dataclass
class HeldWork:
    work: WorkRequest
    since: float  # monotonic: when it was first held


class Holds:
    def __init__(self, max_queue_per_worker: int, cold_start_s: float = 0.0) -> None:
        self.max_queue_per_worker = max_queue_per_worker
        self.cold_start_s = cold_start_s  # TENSORBUS_COLD_START_S: the wait past a deadline
        self.by_model: dict[str, deque[HeldWork]] = {}  # model -> waiting for a cold start
        self.start_s: dict[str, float] = {}  # model -> its slowest worker start seen (seconds)

    def observe_start(self, model: str, start_s: float) -> None:
        """A ready worker's heartbeat says it took `start_s` to start."""
        if start_s > self.start_s.get(model, 0.0):
            self.start_s[model] = start_s

    def until(self, work: WorkRequest) -> float:
        """When `work`, held from now, stops waiting: its deadline; a generation
        `cold_start_s` past it, or its measured cold start (with margin) when that is
        later, but never past its end_by (the client's own Tensorbus-Timeout, else
        TENSORBUS_MAX_GENERATION_S)."""
        if not isinstance(work, GenerateWork) or not work.end_by:
            return work.deadline
        later = work.deadline + self.cold_start_s
        start = self.start_s.get(work.model, 0.0)
        if start:
            later = max(later, time.time() + start * START_MARGIN)
        return max(work.deadline, min(work.end_by, later))

    def hold(self, work: WorkRequest, since: float | None, queued: int, n_ready: int) -> int:
        """Hold `work` (`since`: held from then, monotonic; None = now), or 429 when the
        model's queue is full: `queued` dispatched here and the held, bounded as for at
        least one worker. Returns how many are held now."""
        model = work.model
        held = self.by_model.setdefault(model, deque())
        if len(held) + queued >= self.max_queue_per_worker * max(n_ready, 1):
            raise overloaded(f"model '{model}' is starting and already holds {len(held)} "
                             "requests; retry after the hinted delay", retry_after=1.0)
        if since is None:
            work.deadline = self.until(work)  # the worker's first-token bound moves with it
        held.append(HeldWork(work, time.monotonic() if since is None else since))
        return len(held)

    def take(self, model: str) -> list[HeldWork]:
        """Everything held for `model`, interactive before batch, each oldest first;
        no longer held."""
        return sorted(self.by_model.pop(model, ()), key=lambda h: h.work.priority)

    def drop(self, request_id: str) -> WorkRequest | None:
        """The held request `request_id`, no longer held (None: not held here)."""
        for model, held in self.by_model.items():
            for h in held:
                if h.work.request_id == request_id:
                    held.remove(h)
                    if not held:
                        del self.by_model[model]
                    return h.work
        return None

    def count(self, model: str) -> int:
        held = self.by_model.get(model)
        return len(held) if held else 0

    def tally(self, model: str) -> Tally:
        """The work held for `model` (it counts ahead of new arrivals)."""
        out = Tally()
        for h in self.by_model.get(model, ()):
            if h.work.priority < BATCH:
                out.add(*work_size(h.work))
        return out

    def models(self) -> list[str]:
        """Models with work held."""
        return [m for m, h in self.by_model.items() if h]

    def expire(self, now: float) -> list[tuple[WorkRequest, ServiceError]]:
        """Held work whose deadline (UNIX seconds) has passed, with its 504; no longer held."""
        out = []
        for model in list(self.by_model):
            keep: deque[HeldWork] = deque()
            for h in self.by_model[model]:
                if h.work.deadline <= now:
                    waited = time.monotonic() - h.since
                    out.append((h.work, deadline_exceeded(
                        f"no worker of model '{model}' became ready before the request's "
                        f"deadline (held {waited:.1f} s for a cold start)")))
                else:
                    keep.append(h)
            if keep:
                self.by_model[model] = keep
            else:
                del self.by_model[model]
        return out

    def fail(self, failed: dict[str, str]) -> list[tuple[WorkRequest, ServiceError]]:
        """Held work of models that failed (model -> why), with its 503; no longer held."""
        out = []
        for model in [m for m in self.by_model if m in failed]:
            for h in self.by_model.pop(model):
                out.append((h.work, unavailable(
                    f"model '{model}' cannot start: {failed[model]}", retry_after=None)))
        return out
