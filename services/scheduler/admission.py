"""The scheduler's admission decision: dispatch, hold, or refuse one request.

`Admission.admit(work)`, in this order (each refusal a ServiceError the service sends
to the request's reply subject at once):

  1. Its reservation, if it made one (`reserve`), is released: its room becomes the
     work itself, which is not checked again. Work whose reservation lapsed (its
     gateway took longer than RESERVATION_S) is judged as any arrival.
  2. A deadline already passed is a 504.
  3. A model that is not served (`MODEL=0:0`) or `failed` (the orchestrator says its
     worker's configuration is invalid) is a 503 with the reason
     (`shared.admission.check_served`).
  4. No ready worker takes new work for the model: [] (the caller holds it for a
     cold start, services.scheduler.holds), unless it pins a version no ready worker
     has while others of the model are ready (503).
  5. The bound, over every scheduler's work (`ahead`: this one's tally, what it
     holds, the others' SchedLoad reports), by work: for embeddings
     (`shared.admission.check`) tokens x the model's measured cost per token, from
     the workers' `WorkDone`, and a request that cannot finish before its own
     deadline behind the work ahead is a 429 with Retry-After in seconds of
     estimated work; for generation (`shared.admission.check_generation`) the work
     ahead of its prompt and the prompt's own, from the prefill and decode costs the
     ready workers' heartbeats carry (timed at warm-up, refitted as they step), and
     one whose prompt cannot be computed before its deadline is a 429 at once.
     Generation that no worker has timed is bounded by count alone.
     Batch-priority work (shared.priority) skips 5: it is never refused for the work
     ahead or its deadline, but waits for idle room in the scheduler's batch lane
     (services.scheduler.lane), which bounds it by count.

`reserve` admits a large embeddings body by its estimated size (a completion by
count: its size is not known before tokenizing) before the gateway tokenizes it, and
holds its room in the tally until its work arrives.
"""

from __future__ import annotations

import time
from typing import Callable, NamedTuple

from services.fleet import Fleet, WorkerView
from shared import admission
from shared.admission import LoadBoard, Tally
from shared.costs import Cost, CostBook, gen_cost
from shared.config import Config, prefill_chunk_on
from shared.errors import deadline_exceeded, unavailable
from shared.messages import EmbedWork, GenerateWork, Reserve, SchedLoad, WorkDone, WorkRequest
from shared.priority import BATCH
from shared.telemetry import Heartbeat

RESERVATION_S = 5.0  # a reservation whose work never came (its gateway gone) is dropped


def work_size(work: WorkRequest) -> tuple[int, int]:
    """(inputs, tokens) of one request."""
    if isinstance(work, EmbedWork):
        return len(work.inputs), sum(len(x) for x in work.inputs)
    return work.n, len(work.prompt)


def work_decode(work: WorkRequest) -> int:
    """Tokens a request may generate: max_tokens x its choices (0 for embeddings)."""
    return 0 if isinstance(work, EmbedWork) else work.n * work.max_tokens


class Reservation(NamedTuple):
    """Room a scheduler holds for a request admitted before tokenizing."""

    model: str
    inputs: int
    tokens: int
    expires: float  # monotonic


class Admission:
    """One scheduler's admission state: its tally of work out, its reservations, the
    models' costs, the other schedulers' reports and the failed models.

    `held(model)` is the work this scheduler holds for a cold start (it counts ahead);
    `changed()` is called whenever the tally moves (a load report is due)."""

    def __init__(self, config: Config, scheduler_id: str, fleet: Fleet,
                 held: Callable[[str], Tally] = lambda model: Tally(),
                 changed: Callable[[], None] = lambda: None) -> None:
        self.config = config
        self.id = scheduler_id
        self.fleet = fleet
        self.held = held
        self.changed = changed
        self.tally: dict[str, Tally] = {}  # model -> work outstanding here (dispatched, reserved)
        self.reservations: dict[str, Reservation] = {}  # admitted before tokenizing, not arrived
        self.costs = CostBook()  # model -> engine seconds per token, from WorkDone
        self.board = LoadBoard(scheduler_id, expiry_s=config.worker_expiry_s)  # other schedulers
        self.failed: dict[str, str] = {}  # model -> why (the orchestrator's FleetStatus)

    # ---------------------------------------------------------------- decisions
    def admit(self, work: WorkRequest) -> list[WorkerView]:
        """The ready workers `work` may go to, [] to hold it for a cold start; a
        refusal is raised."""
        reserved = bool(work.reserved) and self.release(work.request_id)
        self.check_open(work.model, work.deadline)
        model = work.model
        ready = self.fleet.available(model, work.version)
        if not ready:
            if work.version and self.fleet.available(model):
                raise unavailable(f"no ready worker serves model '{model}' version "
                                  f"{work.version}; retry shortly")
            return []
        if reserved or work.priority >= BATCH:  # admitted before tokenizing; or batch
            return ready  # work, which waits for room rather than being refused for it
        if isinstance(work, EmbedWork):
            self.check_size(model, *work_size(work), work.deadline, ready, by_work=True)
        else:
            self.check_generation(work, ready)
        return ready

    def check_open(self, model: str, deadline: float) -> None:
        """504 for a deadline already passed, 503 for a model that gets no worker."""
        if deadline <= time.time():
            raise deadline_exceeded("the request's deadline passed before it was scheduled")
        admission.check_served(model, self.config.fleet_bounds(model)[1], self.failed.get(model))

    def check_size(self, model: str, inputs: int, tokens: int, deadline: float,
                   ready: list[WorkerView], by_work: bool) -> None:
        """429 unless the request fits (`shared.admission.check`): by work for
        embeddings, by count for a completion's reservation (its prompt and max_tokens
        are not known before tokenizing; its submit is not checked again)."""
        admission.check(
            model, self.ahead(model), inputs, tokens, len(ready),
            max_batch=max(w.hb.max_batch for w in ready) if by_work else 0,
            cost=self.costs.cost(model) if by_work else None,
            left_s=deadline - time.time(),
            max_queue_per_worker=self.config.max_queue_per_worker,
            max_queue_s=self.config.max_queue_s if by_work else float("inf"),
            by_work=by_work)

    def check_generation(self, work: GenerateWork, ready: list[WorkerView]) -> None:
        """429 unless the generation's prompt can be computed behind the work ahead
        within the queue bound and its deadline (`shared.admission.check_generation`),
        by the cost the ready workers' heartbeats carry; by count while none does."""
        hbs = [w.hb for w in ready]
        admission.check_generation(
            work.model, self.ahead(work.model), work.n, len(work.prompt), len(ready),
            slots=min((hb.max_batch for hb in hbs), default=1),  # a decoder's: its slots
            running=sum(hb.in_flight for hb in hbs), cost=gen_cost(hbs),
            left_s=work.deadline - time.time(),
            max_queue_per_worker=self.config.max_queue_per_worker,
            max_queue_s=self.config.max_queue_s,
            chunk=prefill_chunk_on(self.config.prefill_chunk, hbs[0].device if hbs else "cpu"))

    def ahead(self, model: str) -> Tally:
        """Every scheduler's outstanding work for `model`: this one's (live), what it
        holds, and the others' last reports (at most one interval old)."""
        return (self.tally.get(model, Tally()) + self.board.total(model, time.monotonic())
                + self.held(model))

    # -------------------------------------------------------------------- tally
    def dispatched(self, work: WorkRequest) -> None:
        self.tally.setdefault(work.model, Tally()).add(*work_size(work), decode=work_decode(work))
        self.changed()

    def finished(self, work: WorkRequest) -> None:
        """Dispatched work that finished, or was taken back from a lost worker."""
        self.tally[work.model].add(*work_size(work), sign=-1, decode=work_decode(work))
        self.changed()

    # -------------------------------------------------------------- reservations
    def reserve(self, req: Reserve) -> str:
        """Admit an embeddings request by its estimated size and hold its room: this
        scheduler's id, "" when no ready worker serves it (its submit is then held or
        refused as any other), or a ServiceError (429, 503, 504) as its submit would get."""
        self.check_open(req.model, req.deadline)
        ready = self.fleet.available(req.model, req.version)
        if not ready:
            return ""
        self.check_size(req.model, req.inputs, req.tokens, req.deadline, ready,
                        by_work=not req.generate)
        self.tally.setdefault(req.model, Tally()).add(req.inputs, req.tokens)
        self.changed()
        self.reservations[req.request_id] = Reservation(req.model, req.inputs, req.tokens,
                                                        time.monotonic() + RESERVATION_S)
        return self.id

    def release(self, request_id: str) -> bool:
        """A reservation's room back (its work arrived, was cancelled, or expired);
        False when there was none."""
        r = self.reservations.pop(request_id, None)
        if r is None:
            return False
        self.tally[r.model].add(r.inputs, r.tokens, sign=-1)
        self.changed()
        return True

    def expire_reservations(self, now: float) -> None:
        """Drop the reservations whose work did not come by their expiry (monotonic)."""
        for rid in [rid for rid, r in self.reservations.items() if r.expires <= now]:
            self.release(rid)

    # ----------------------------------------------------------------- feedback
    def observe_done(self, done: WorkDone, model: str) -> None:
        """A finished batch's engine time and tokens: the model's cost."""
        if done.tokens:
            self.costs.observe(model, done.compute_s, done.tokens)

    def observe_heartbeat(self, hb: Heartbeat) -> None:
        """A worker's heartbeat: a model not timed here yet starts from the cost its
        warm-up showed."""
        if hb.cost_per_token or hb.cost_per_batch:
            self.costs.learn(hb.model, Cost(hb.cost_per_batch, hb.cost_per_token))

    def observe_load(self, load: SchedLoad, now: float) -> None:
        """Another scheduler's report: its work counts here; a model this scheduler
        has not timed yet starts from its cost estimate."""
        self.board.observe(load, now)
        for m in load.models:
            self.costs.learn(m.model, Cost(m.cost_per_batch, m.cost_per_token))

    def observe_status(self, status) -> None:
        """The orchestrator's FleetStatus: which models failed, and why."""
        self.failed = admission.failed_models(status)
