"""The scheduler: admission, routing and recovery for every request.

Dataflow of one request:
  1. The gateway publishes a WorkRequest to `tensorbus.v1.sched.submit` (queue group:
     one scheduler gets it) with the NATS reply set to the gateway's inbox.
  2. Admission: an expired deadline is a 504; a model that is not served
     (`MODEL=0:0`) or `failed` (the orchestrator says its worker's configuration is
     invalid) a 503 with the reason; a full fleet queue (dispatched + held, bounded
     as for at least one worker) a 429 with Retry-After. With a ready worker, an
     embeddings request is admitted by work (`shared.admission`): the queue bound is
     in estimated compute (tokens x the model's measured cost per token, from the
     workers' `WorkDone`), shared with the other schedulers (their `SchedLoad`
     reports), and a request that cannot finish before its own deadline behind the
     work ahead is a 429 at once. Every refusal is sent to the request's reply
     subject at once. A large embeddings body is admitted before the gateway
     tokenizes it (`Reserve`, by its estimated size, on `tensorbus.v1.sched.reserve`):
     its room is held in the tally until its work arrives on this scheduler's own
     submit subject, and that work is not checked again. So gateways' bursts meet
     the bound here before any tokenizing; a gateway that does not submit cancels,
     and a reservation left over expires after RESERVATION_S.
  3. Cold start: no ready worker takes new work for the model (none running, all
     warming, or all above the memory threshold and so taking no new work): the
     request is held, the gateway is told (`Held`), and a ScaleDecision goes out at
     once. The first worker that becomes ready gets it (with an `Accepted` carrying
     the time held); its own deadline passing first ends it with a 504 that says so.
  4. Routing: the least-loaded ready worker below the memory threshold serving the
     model (and the version the request pins or the canary draw picks) gets the
     WorkRequest on its work subject; for a prompt, the one whose heartbeat says it
     caches the longest prefix of it (whole conversation, block by block), unless
     it holds more than `prefix_route_imbalance` requests over the least loaded.
     Heartbeats carry the prefixes, so a restarted scheduler routes by them again
     within one heartbeat interval.
     An unpinned request that draws the canary goes out pinned to it; one that draws
     prod goes to workers holding prod, unpinned, so each runs its own current prod
     (a scheduler whose view lags a promotion never sends work back to the old one).
     When no ready worker holds the drawn version yet (a canary still loading, a
     promotion in progress), prod is used, and failing that any ready worker.
  5. The worker replies to the gateway directly and tells this scheduler which
     requests finished (`WorkDone`), so the outstanding count per worker stays exact.
  6. When a worker expires (missed heartbeats) or reports draining with work still
     outstanding here, that work is dispatched again to another worker (the gateway
     keeps only the first answer per request id).
  7. This scheduler's outstanding work per model goes to `tensorbus.v1.sched.load`
     (`SchedLoad`) for the other schedulers and the gateways every heartbeat interval,
     and within EARLY_REPORT_S of any change or refusal: the gateways then refuse
     the rest of a burst themselves, and admit again as soon as room comes back.
  8. Every `scale_interval_s` a ScaleDecision for every model it knows (catalogue,
     registry, heartbeats; served or not) goes to `telemetry.v1.scale`, computed by
     the pure `services.scheduler.scaling.Autoscaler`.
"""

from __future__ import annotations

import asyncio
import random
import time
import uuid
from collections import deque
from dataclasses import dataclass, field
from typing import NamedTuple

import msgspec
from nats.aio.client import Client
from nats.aio.msg import Msg

from services.fleet import Fleet, WorkerView
from services.lifecycle import Lifecycle
from services.micro import ServiceHealth, add_service
from services.scheduler.aliases import AliasTable
from services.scheduler.catalogue import Catalogue
from services.scheduler.routed import Routed
from services.scheduler.scaling import Autoscaler, Demand
from shared import VERSION, admission, prefix, subjects
from shared.admission import Cost, CostBook, LoadBoard, Tally
from shared.config import Config
from shared.errors import ServiceError, deadline_exceeded, overloaded, unavailable
from shared.logging import get_logger
from shared.messages import (
    Accepted,
    EmbedWork,
    Held,
    ModelLoad,
    Reserve,
    Reserved,
    SchedLoad,
    WorkError,
    WorkRequest,
    cancel_decoder,
    done_decoder,
    encode,
    fleet_status_decoder,
    reserve_decoder,
    sched_load_decoder,
    work_decoder,
)
from shared.telemetry import ScaleDecision, heartbeat_decoder
from shared.telemetry import encode as encode_record

log = get_logger("scheduler")

VersionChooser = "callable(model) -> str"  # registry canary draw, '' = any version


@dataclass
class Outstanding:
    work: WorkRequest
    worker_id: str
    dispatched_at: float
    keys: list[int] = field(default_factory=list)  # short prefix keys of its prompt


def work_size(work: WorkRequest) -> tuple[int, int]:
    """(inputs, tokens) of one request."""
    if isinstance(work, EmbedWork):
        return len(work.inputs), sum(len(x) for x in work.inputs)
    return work.n, len(work.prompt)


class Reservation(NamedTuple):
    """Room a scheduler holds for a request admitted before tokenizing."""

    model: str
    inputs: int
    tokens: int
    expires: float  # monotonic


@dataclass
class HeldWork:
    work: WorkRequest
    since: float  # monotonic: when it was first held

RESERVATION_S = 5.0  # a reservation whose work never came (its gateway gone) is dropped
EARLY_REPORT_S = 0.02  # a change of the load goes out this soon, and reports this often at most
CATALOGUE_REFRESH_S = 10.0  # how often the registry's model list is read again
ROUTED_GRACE_BEATS = 4  # heartbeat intervals a finished request's prefix counts as held


class Scheduler(Lifecycle):
    def __init__(self, nc: Client, config: Config, scheduler_id: str | None = None,
                 choose_version=None, scale_interval_s: float = 2.0,
                 registry=None) -> None:
        self.nc = nc
        self.config = config
        self.id = scheduler_id or config.scheduler_id or uuid.uuid4().hex[:12]
        self.fleet = Fleet(expiry_s=config.worker_expiry_s, stall_s=config.stall_s,
                           memory_high=config.memory_high)
        self.catalogue = Catalogue(config.fleet, registry)
        self.autoscaler = Autoscaler(config, self.id)
        # With a registry, each model seen in heartbeats has its aliases watched.
        self.aliases = AliasTable(registry) if registry is not None else None
        self.choose_version = choose_version or (
            self.aliases.choose if self.aliases is not None else (lambda model, user="": ""))
        self.prod_version = self.aliases.prod if self.aliases is not None else (lambda model: "")
        self.scale_interval_s = scale_interval_s
        self.outstanding: dict[str, Outstanding] = {}
        # Prompts' prefixes sent to each worker, until its heartbeats announce them.
        self.routed = Routed(grace_s=ROUTED_GRACE_BEATS * config.heartbeat_s)
        self.load: dict[str, int] = {}  # worker_id -> requests outstanding here
        self.tally: dict[str, Tally] = {}  # model -> work outstanding here (dispatched, reserved)
        self.reservations: dict[str, Reservation] = {}  # admitted before tokenizing, not arrived
        self.costs = CostBook()  # model -> engine seconds per token, from WorkDone
        self.board = LoadBoard(self.id, expiry_s=config.worker_expiry_s)  # other schedulers
        self._reported: set[str] = set()  # models with work in the last SchedLoad
        self._reported_at = 0.0  # monotonic time of the last SchedLoad
        self._load_moved = asyncio.Event()  # the tally changed, or a request was refused
        self.held: dict[str, deque[HeldWork]] = {}  # model -> waiting for a cold start
        self.failed: dict[str, str] = {}  # model -> why (the orchestrator's FleetStatus)
        self.published: dict[str, int] = {}  # model -> desired in its last decision
        self._stop = asyncio.Event()
        self._subs: list = []
        self.rng = random.Random()
        self.dispatched = 0
        self.redispatched = 0

    # ------------------------------------------------------------------ lifecycle
    async def run(self, ready: asyncio.Event | None = None) -> None:
        self._subs = [
            await self.nc.subscribe(subjects.TELEMETRY_WORKERS, cb=self._on_heartbeat,
                                    pending_msgs_limit=100_000),
            await self.nc.subscribe(subjects.sched_done(self.id), cb=self._on_done,
                                    pending_msgs_limit=1_000_000),
            await self.nc.subscribe(subjects.SCHED_SUBMIT, queue=subjects.QUEUE_SCHEDULER,
                                    cb=self._on_submit, pending_msgs_limit=1_000_000,
                                    pending_bytes_limit=1 << 30),
            await self.nc.subscribe(subjects.sched_submit(self.id), cb=self._on_submit,
                                    pending_msgs_limit=1_000_000, pending_bytes_limit=1 << 30),
            await self.nc.subscribe(subjects.SCHED_RESERVE, queue=subjects.QUEUE_SCHEDULER,
                                    cb=self._on_reserve, pending_msgs_limit=1_000_000),
            await self.nc.subscribe(subjects.CANCEL, cb=self._on_cancel,
                                    pending_msgs_limit=1_000_000),
            await self.nc.subscribe(subjects.ORCHESTRATOR_STATUS, cb=self._on_fleet_status),
            await self.nc.subscribe(subjects.SCHED_LOAD, cb=self._on_sched_load),
        ]
        self.micro = await add_service(
            self.nc, "tensorbus-scheduler", VERSION, "admission, routing and scaling signals",
            health=self._health(), metadata={"scheduler_id": self.id})
        await self.nc.flush()
        log.info("scheduler_started", scheduler_id=self.id)
        if ready is not None:
            ready.set()
        try:
            async with asyncio.TaskGroup() as tg:
                loops = [tg.create_task(self._housekeeping()), tg.create_task(self._scaling()),
                         tg.create_task(self._refresh_catalogue()),
                         tg.create_task(self._publish_load())]
                await self._stop.wait()
                for task in loops:  # none waits out its interval
                    task.cancel()
                await self.micro.stop()
                for s in self._subs:
                    await s.unsubscribe()
        finally:
            if self.aliases is not None:  # watches must not outlive the scheduler
                await self.aliases.stop()

    def stop(self) -> None:
        self._stop.set()

    def _health(self) -> ServiceHealth:
        health = ServiceHealth(ready=True)
        health.details = {"instance": self.id}
        return health

    # --------------------------------------------------------------- submissions
    async def _on_submit(self, msg: Msg) -> None:
        try:
            work = work_decoder.decode(msg.data)
        except msgspec.DecodeError:
            log.warning("bad_submit")
            return
        if not work.reply:
            work.reply = msg.reply or ""
        work.sched_id = self.id
        try:
            await self.admit(work)
        except ServiceError as err:
            await self._refuse(work, err)

    async def admit(self, work: WorkRequest, since: float | None = None) -> None:
        """Dispatch, hold or refuse one request; `since` = held from then (monotonic)."""
        # Its room, held here, becomes the work itself. Work whose reservation lapsed
        # (its gateway took longer than RESERVATION_S) is judged as any arrival.
        reserved = bool(work.reserved) and self.release(work.request_id)
        if work.deadline <= time.time():
            raise deadline_exceeded("the request's deadline passed before it was scheduled")
        model = work.model
        self._check_served(model)
        ready = self.fleet.available(model, work.version)
        if not ready:
            if work.version and self.fleet.available(model):
                raise unavailable(f"no ready worker serves model '{model}' version "
                                  f"{work.version}; retry shortly")
            await self._hold(work, since)
            return
        if not reserved:  # reserved work was admitted by its size before tokenizing
            self._check_work(work, ready)
        await self._dispatch(work, ready, since)

    def _check_work(self, work: WorkRequest, ready: list[WorkerView]) -> None:
        """429 unless the request fits (`shared.admission.check`): by work for
        embeddings, by count for generation (a decoder's cost is per step, not per token)."""
        self._check_size(work.model, *work_size(work), work.deadline, ready,
                         by_work=isinstance(work, EmbedWork))

    def _check_size(self, model: str, inputs: int, tokens: int, deadline: float,
                    ready: list[WorkerView], by_work: bool) -> None:
        admission.check(
            model, self.ahead(model), inputs, tokens, len(ready),
            max_batch=max(w.hb.max_batch for w in ready) if by_work else 0,
            cost=self.costs.cost(model) if by_work else None,
            left_s=deadline - time.time(),
            max_queue_per_worker=self.config.max_queue_per_worker,
            max_queue_s=self.config.max_queue_s if by_work else float("inf"),
            by_work=by_work)

    # --------------------------------------------------------------- reservations
    async def _on_reserve(self, msg: Msg) -> None:
        try:
            req = reserve_decoder.decode(msg.data)
        except msgspec.DecodeError:
            log.warning("bad_reserve")
            return
        if not msg.reply:
            return
        try:
            out = Reserved(req.request_id, self.reserve(req))
        except ServiceError as err:
            out = WorkError(req.request_id, err.status, err.message, err.code, err.retry_after)
        await self.nc.publish(msg.reply, encode(out))
        self._load_moved.set()

    def reserve(self, req: Reserve) -> str:
        """Admit an embeddings request by its estimated size and hold its room: this
        scheduler's id, "" when no ready worker serves it (its submit is then held or
        refused as any other), or a ServiceError (429, 503, 504) as its submit would get."""
        if req.deadline <= time.time():
            raise deadline_exceeded("the request's deadline passed before it was scheduled")
        self._check_served(req.model)
        ready = self.fleet.available(req.model, req.version)
        if not ready:
            return ""
        self._check_size(req.model, req.inputs, req.tokens, req.deadline, ready,
                         by_work=not req.generate)
        self.tally.setdefault(req.model, Tally()).add(req.inputs, req.tokens)
        self._load_moved.set()
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
        self._load_moved.set()
        return True

    def _expire_reservations(self) -> None:
        now = time.monotonic()
        for rid in [rid for rid, r in self.reservations.items() if r.expires <= now]:
            self.release(rid)

    async def _on_cancel(self, msg: Msg) -> None:
        """A gateway that reserved and will not submit (its request failed to
        tokenize, or its client left) gives the room back."""
        if not self.reservations:
            return
        try:
            self.release(cancel_decoder.decode(msg.data).request_id)
        except msgspec.DecodeError:
            return

    def ahead(self, model: str) -> Tally:
        """Every scheduler's outstanding work for `model`: this one's (live), what it
        holds, and the others' last reports (at most one interval old)."""
        out = self.tally.get(model, Tally()) + self.board.total(model, time.monotonic())
        for h in self.held.get(model, ()):
            out.add(*work_size(h.work))
        return out

    def _check_served(self, model: str) -> None:
        if self.config.fleet_bounds(model)[1] == 0:
            raise unavailable(f"model '{model}' is not served here (TENSORBUS_FLEET "
                              f"{model}=0:0)", retry_after=None)
        why = self.failed.get(model)
        if why:
            raise unavailable(f"model '{model}' cannot start: {why}", retry_after=None)

    def _capacity(self, model: str, n_ready: int) -> int:
        """The fleet queue bound: at zero ready workers, what one worker would have."""
        return self.config.max_queue_per_worker * max(n_ready, 1)

    def _held_count(self, model: str) -> int:
        held = self.held.get(model)
        return len(held) if held else 0

    async def _hold(self, work: WorkRequest, since: float | None) -> None:
        model = work.model
        held = self.held.setdefault(model, deque())
        queued = sum(1 for o in self.outstanding.values() if o.work.model == model)
        if len(held) + queued >= self._capacity(model, len(self.fleet.available(model))):
            raise overloaded(f"model '{model}' is starting and already holds {len(held)} "
                             "requests; retry after the hinted delay", retry_after=1.0)
        held.append(HeldWork(work, time.monotonic() if since is None else since))
        self.catalogue.note(model)
        if since is None and work.reply:
            await self.nc.publish(work.reply, encode(Held(work.request_id, model)))
        # Demand goes out now, not at the next interval: a cold start begins at once.
        decision = self.decide(model)
        if len(held) == 1 or decision.desired_replicas > self.published.get(model, 0):
            await self._publish_decision(decision)

    async def _dispatch(self, work: WorkRequest, ready: list[WorkerView],
                        since: float | None = None) -> None:
        sent = work
        if not work.version:
            pin, ready = self._route_version(work.model, ready, work.user)
            if pin:  # the worker runs the drawn canary, not its own prod
                sent = msgspec.structs.replace(work, version=pin)
        target, keys = self._pick(work, ready)
        wid = target.worker_id
        # The unpinned original is kept: a re-dispatch draws again.
        now = time.monotonic()
        self.outstanding[work.request_id] = Outstanding(work, wid, now, keys)
        if keys:
            self.routed.sent(wid, keys)
        self.load[wid] = self.load.get(wid, 0) + 1
        self.tally.setdefault(work.model, Tally()).add(*work_size(work))
        self._load_moved.set()
        self.dispatched += 1
        if since is not None and work.reply:  # released from a hold: the gateway records it
            await self.nc.publish(work.reply, encode(Accepted(work.request_id, wid, now - since)))
        await self.nc.publish(subjects.worker_work(wid), encode(sent))
        log.debug("request_dispatched", request_id=work.request_id, worker=wid)

    def _route_version(self, model: str, ready: list[WorkerView],
                       user: str = "") -> tuple[str, list[WorkerView]]:
        """(version to pin, workers holding it): the draw, else prod, else ("", all).

        Prod is never pinned ("" = the worker's own prod)."""
        prod = self.prod_version(model)
        for version in (self.choose_version(model, user), prod):
            if version:
                pool = [w for w in ready if version in w.hb.versions]
                if pool:
                    return ("" if version == prod else version), pool
        return "", ready

    def _pick(self, work: WorkRequest, ready: list[WorkerView]) -> tuple[WorkerView, list[int]]:
        """Prefix first (prompts, when workers cache prefixes), then load -> (worker,
        the prompt's short prefix keys: [] when not routed by prefix)."""
        block = next((w.hb.prefix_block for w in ready if w.hb.prefix_block), 0)
        if isinstance(work, EmbedWork) or not block or self.config.prefix_route_imbalance < 0:
            return min(ready, key=self._load_of), []
        keys = [prefix.short(k) for k in prefix.prefix_keys(work.prompt, block)]
        now = time.monotonic()
        held = lambda w: self.routed.held(w.worker_id, w.prefixes, now)  # noqa: E731
        size = lambda w: self.routed.size(w.worker_id, w.prefixes)  # noqa: E731
        return prefix.choose(ready, keys, held, lambda w: self._load_of(w),
                             self.config.prefix_route_imbalance, size), keys

    def _load_of(self, w: WorkerView) -> tuple[int, float]:
        mine = self.load.get(w.worker_id, 0)
        theirs = w.hb.queue_depth + w.hb.in_flight
        return (max(mine, theirs), self.rng.random())

    async def _refuse(self, work: WorkRequest, err: ServiceError) -> None:
        if not work.reply:
            return
        out = WorkError(work.request_id, err.status, err.message, err.code, err.retry_after)
        await self.nc.publish(work.reply, encode(out))
        self._load_moved.set()

    # ------------------------------------------------------------------ feedback
    async def _on_done(self, msg: Msg) -> None:
        try:
            done = done_decoder.decode(msg.data)
        except msgspec.DecodeError:
            return
        model = ""
        for rid in done.request_ids:
            o = self.outstanding.pop(rid, None)
            if o is not None:
                self._finished(o)
                model = o.work.model
        if done.tokens:
            view = self.fleet.workers.get(done.worker_id)
            self.costs.observe(model or (view.hb.model if view else ""), done.compute_s, done.tokens)

    def _finished(self, o: Outstanding) -> None:
        self.load[o.worker_id] = max(0, self.load.get(o.worker_id, 0) - 1)
        if o.keys:
            self.routed.finished(o.worker_id, o.keys, time.monotonic())
        self.tally[o.work.model].add(*work_size(o.work), sign=-1)
        self._load_moved.set()

    async def _on_heartbeat(self, msg: Msg) -> None:
        try:
            hb = heartbeat_decoder.decode(msg.data)
        except msgspec.DecodeError:
            return
        if self.aliases is not None:
            self.aliases.track(hb.model)
        self.catalogue.note(hb.model, hb.kind)
        view = self.fleet.observe(hb)
        if view.ready and self.held.get(hb.model) and self.fleet.available(hb.model):
            await self._release_held(hb.model)
        # A draining worker finishes what it holds; a stopped, unhealthy or wedged one
        # will not, so its outstanding work goes elsewhere (a no-op when it has none).
        if hb.state in ("stopped", "unhealthy") or view.stalled:
            await self._recover(hb.worker_id, "worker stalled" if view.stalled else f"worker {hb.state}")

    async def _on_fleet_status(self, msg: Msg) -> None:
        try:
            status = fleet_status_decoder.decode(msg.data)
        except msgspec.DecodeError:
            return
        self.failed = {m.model: m.reason or "its worker exited on an invalid configuration"
                       for m in status.models if m.state == "failed"}
        for model in [m for m in self.held if m in self.failed]:
            for h in self.held.pop(model):
                await self._refuse(h.work, unavailable(
                    f"model '{model}' cannot start: {self.failed[model]}", retry_after=None))

    async def _release_held(self, model: str) -> None:
        """The first ready worker of `model`: what waited for it goes out, oldest first."""
        for h in self.held.pop(model, ()):
            try:
                await self.admit(h.work, since=h.since)
            except ServiceError as err:
                await self._refuse(h.work, err)

    async def _recover(self, worker_id: str, why: str) -> None:
        """Send the unfinished work of a lost worker to the others."""
        lost = [o for o in self.outstanding.values() if o.worker_id == worker_id]
        self.load.pop(worker_id, None)
        self.routed.forget(worker_id)
        if lost:
            log.warning("redispatching", worker_id=worker_id, requests=len(lost), reason=why)
        for o in lost:
            self.outstanding.pop(o.work.request_id, None)
            self.tally[o.work.model].add(*work_size(o.work), sign=-1)
            work = o.work
            work.attempt += 1
            self.redispatched += 1
            try:
                await self.admit(work)
            except ServiceError as err:
                await self._refuse(work, err)

    # -------------------------------------------------------------- background
    async def _housekeeping(self) -> None:
        tick = max(0.05, min(0.25, self.config.worker_expiry_s / 4))
        last = time.monotonic()
        while not self._stop.is_set():
            await asyncio.sleep(tick)
            now = time.monotonic()
            late, last = now - last - tick, now
            if late > self.config.worker_expiry_s / 2:
                # This process stalled: heartbeats may be waiting unread in our own
                # buffers, so silence measured by our clock proves nothing yet.
                log.warning("scheduler_stalled", seconds=round(late, 2))
                continue
            for gone in self.fleet.expire():
                log.warning("worker_expired", worker_id=gone.worker_id)
                await self._recover(gone.worker_id, "missed heartbeats")
            await self._expire_held()
            self._expire_reservations()

    async def _expire_held(self) -> None:
        now = time.time()
        for model in list(self.held):
            keep: deque[HeldWork] = deque()
            for h in self.held[model]:
                if h.work.deadline <= now:
                    waited = time.monotonic() - h.since
                    await self._refuse(h.work, deadline_exceeded(
                        f"no worker of model '{model}' became ready before the request's "
                        f"deadline (held {waited:.1f} s for a cold start)"))
                else:
                    keep.append(h)
            if keep:
                self.held[model] = keep
            else:
                del self.held[model]

    async def _on_sched_load(self, msg: Msg) -> None:
        try:
            load = sched_load_decoder.decode(msg.data)
        except msgspec.DecodeError:
            return
        self.board.observe(load, time.monotonic())
        for m in load.models:  # a model this scheduler has not timed yet starts from theirs
            self.costs.learn(m.model, Cost(m.cost_per_batch, m.cost_per_token))

    async def _publish_load(self) -> None:
        """This scheduler's share of every queue, so others count it against the bound:
        each heartbeat interval, and within EARLY_REPORT_S of a change or a refusal.
        A refusal here means a gateway's view (a report old) let through what this
        scheduler would not; a gateway that heard the count go up refuses the rest of
        a burst itself, and one that heard it come down admits again at once."""
        moved = self._load_moved
        while not self._stop.is_set():
            try:
                async with asyncio.timeout(self.config.heartbeat_s):
                    await moved.wait()
            except TimeoutError:
                pass
            wait = self._reported_at + EARLY_REPORT_S - time.monotonic()
            if wait > 0:
                await asyncio.sleep(wait)  # a rate limit: changes meanwhile go in this one
            moved.clear()
            await self.publish_load()

    def load_report(self) -> SchedLoad:
        """Every model with work here, with work in the last report, or timed here
        (gateways need its cost before a burst, not one interval into it)."""
        busy = {m for m, t in self.tally.items() if t.requests} | {m for m, h in self.held.items() if h}
        models = []
        for m in sorted(busy | self._reported | set(self.costs.models())):
            t = self.tally.get(m, Tally())
            for h in self.held.get(m, ()):
                t = t + Tally(1, *work_size(h.work))
            cost = self.costs.cost(m) or Cost(0.0, 0.0)
            models.append(ModelLoad(m, t.requests, t.inputs, t.tokens, cost.per_token,
                                    cost.per_batch))
        self._reported = busy
        return SchedLoad(self.id, models, time.time())

    async def publish_load(self) -> None:
        self._reported_at = time.monotonic()
        report = self.load_report()
        if report.models:
            await self.nc.publish(subjects.SCHED_LOAD, encode(report))

    async def _scaling(self) -> None:
        while not self._stop.is_set():
            await asyncio.sleep(self.scale_interval_s)
            for decision in self.scale_decisions():
                await self._publish_decision(decision)

    async def _publish_decision(self, decision: ScaleDecision) -> None:
        self.published[decision.model] = decision.desired_replicas
        await self.nc.publish(subjects.TELEMETRY_SCALE, encode_record(decision))

    async def _refresh_catalogue(self) -> None:
        while not self._stop.is_set():
            try:
                await self.catalogue.refresh()
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # noqa: BLE001 - decisions go on with what is known
                log.warning("catalogue_refresh_failed", error=f"{type(exc).__name__}: {exc}")
            await asyncio.sleep(CATALOGUE_REFRESH_S)

    def demand(self, model: str) -> Demand:
        workers = self.fleet.for_model(model)
        ready = [w for w in workers if w.ready]
        pressured = sum(1 for w in ready if self.fleet.pressured(w))
        kind = self.catalogue.kind(model) or next((w.hb.kind for w in workers), "")
        return Demand(
            model=model, kind=kind, ready=len(ready) - pressured, pressured=pressured,
            starting=sum(1 for w in workers if w.hb.state in ("starting", "warming")),
            held=self._held_count(model),
            queued=sum(1 for o in self.outstanding.values() if o.work.model == model),
            queue_depth=sum(w.hb.queue_depth for w in workers),
            in_flight=sum(w.hb.in_flight for w in workers),
            slots_used=sum(w.hb.slots_used for w in workers))

    def decide(self, model: str) -> ScaleDecision:
        return self.autoscaler.decide(self.demand(model), time.monotonic())

    def scale_decisions(self) -> list[ScaleDecision]:
        """One decision for every model known, served or not, idle or not."""
        models = set(self.catalogue.names()) | set(self.fleet.models()) | set(self.held)
        return [self.decide(m) for m in sorted(models)]
