"""The scheduler: the actor that wires admission, holds, routing, recovery, load
reports and scaling decisions for every request.

Dataflow of one request:
  1. The gateway publishes a WorkRequest to `tensorbus.v1.sched.submit` (queue group:
     one scheduler gets it) with the NATS reply set to the gateway's inbox; a large
     body reserved its room first (`tensorbus.v1.sched.reserve`) and comes to this
     scheduler's own submit subject.
  2. Admission (services.scheduler.admission): 504 for a passed deadline, 503 for a
     model not served or failed, 429 with Retry-After over the queue bound (by count,
     and for embeddings by estimated work, shared with the other schedulers) or for a
     request that cannot finish before its deadline. Every refusal is sent to the
     request's reply subject at once.
  3. Cold start (services.scheduler.holds): no ready worker takes new work for the
     model: the request is held, the gateway is told (`Held`), and a ScaleDecision
     goes out at once. The first worker that becomes ready gets it (with an
     `Accepted` carrying the time held); its own deadline passing first ends it with
     a 504 that says so; a Cancel (broadcast on `tensorbus.v1.cancel`, which every
     scheduler hears) drops it.
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
     Workers at this scheduler's own site come first; other sites' only when none
     of its own has room (services.scheduler.sites). Batch-priority work goes only
     to a worker with idle room, and waits for one in the batch lane
     (services.scheduler.lane) behind every interactive request.
  5. The worker replies to the gateway directly and tells this scheduler which
     requests finished (`WorkDone`, with the batch's engine time: the model's cost),
     so the outstanding count per worker stays exact.
  6. When a worker expires (missed heartbeats) or reports draining with work still
     outstanding here, that work is dispatched again to another worker (the gateway
     keeps only the first answer per request id), or, for a generation its gateway
     resumes itself, the gateway is told (`worker_lost`); a request whose workers
     were lost more than `max_redispatch` times ends with a 500. The same re-dispatch
     when the worker's or this scheduler's own connection dropped
     (services.scheduler.recovery).
  7. Load reports (services.scheduler.loads): this scheduler's outstanding work per
     model goes to `tensorbus.v1.sched.load` every heartbeat interval and within
     EARLY_REPORT_S of any change or refusal; the others' count here.
  8. Scaling (services.scheduler.decisions): every `scale_interval_s` a ScaleDecision
     for every model it knows goes to `telemetry.v1.scale`.
"""

from __future__ import annotations

import asyncio
import random
import time
import uuid
from dataclasses import dataclass, field

import msgspec
from nats.aio.client import Client
from nats.aio.msg import Msg

from services.fleet import Fleet, WorkerView
from services.liveness import live_file
from services.micro import ServiceHealth, add_service
from services.scheduler.admission import Admission
from services.registry.alias_table import AliasTable
from services.scheduler.catalogue import Catalogue
from services.scheduler.decisions import ScaleDecisions
from services.scheduler.holds import Holds
from services.scheduler.lane import BatchLane, idle
from services.scheduler.loads import LoadReports
from services.scheduler.recovery import Recovery
from services.scheduler.routed import Routed
from services.scheduler.sites import at_site
from shared import VERSION, prefix, subjects
from shared.priority import BATCH
from shared.bus import Links
from shared.config import Config
from shared.errors import ServiceError
from shared.logging import get_logger
from shared.messages import (
    Accepted,
    EmbedWork,
    Held,
    Reserved,
    WorkError,
    WorkRequest,
    cancel_decoder,
    done_decoder,
    encode,
    fleet_status_decoder,
    reserve_decoder,
    work_decoder,
)
from shared.telemetry import heartbeat_decoder

log = get_logger("scheduler")


@dataclass
class Outstanding:
    work: WorkRequest
    worker_id: str
    dispatched_at: float
    keys: list[int] = field(default_factory=list)  # short prefix keys of its prompt


ROUTED_GRACE_BEATS = 4  # heartbeat intervals a finished request's prefix counts as held


class Scheduler:
    def __init__(self, nc: Client, config: Config, scheduler_id: str | None = None,
                 choose_version=None, scale_interval_s: float = 2.0,
                 registry=None) -> None:
        self.nc = nc
        self.config = config
        self.id = scheduler_id or config.scheduler_id or uuid.uuid4().hex[:12]
        self.fleet = Fleet(expiry_s=config.worker_expiry_s, stall_s=config.stall_s,
                           memory_high=config.memory_high)
        self.catalogue = Catalogue(config.fleet, registry)
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
        self.holds = Holds(config.max_queue_per_worker, config.cold_start_s)
        self.lane = BatchLane(config.max_queue_per_worker)  # batch work waiting for room
        self.admission = Admission(config, self.id, self.fleet, held=self.holds.tally)
        self.loads = LoadReports(nc, self.id, self.admission, self.holds, config.heartbeat_s)
        self.admission.changed = self.loads.changed
        self.scaling = ScaleDecisions(nc, config, self.id, self.fleet, self.catalogue,
                                      self.holds, self._queued, self.lane.count)
        self._stop = asyncio.Event()
        self._subs: list = []
        self.rng = random.Random()
        self.dispatched = 0
        self.links = Links(nc)  # a dropped connection: what it dispatched goes again
        self.loads.links = self.links  # its drops go out in load reports (`reconnects`)
        self.recovery = Recovery(outstanding=self.outstanding, load=self.load,
                                 routed=self.routed, admission=self.admission,
                                 loads=self.loads, links=self.links, resend=self._admit_or_refuse,
                                 refuse=self._refuse, max_redispatch=config.max_redispatch)

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
            await self.nc.subscribe(subjects.SCHED_LOAD, cb=self.loads.on_report),
        ]
        self.micro = await add_service(
            self.nc, "tensorbus-scheduler", VERSION, "admission, routing and scaling signals",
            health=self._health(), metadata={"scheduler_id": self.id},
            live_file=live_file("tensorbus-scheduler", self.config))
        await self.nc.flush()
        # Said at once, even with no load to report: a gateway holding submissions
        # that found no scheduler (one restarted) sends them again when it hears one.
        await self.loads.publish(force=True)
        log.info("scheduler_started", scheduler_id=self.id)
        if ready is not None:
            ready.set()
        try:
            async with asyncio.TaskGroup() as tg:
                loops = [tg.create_task(self._housekeeping()), tg.create_task(self._scaling()),
                         tg.create_task(self.catalogue.run(self._stop)),
                         tg.create_task(self.loads.run(self._stop))]
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
        await self._admit_or_refuse(work)

    async def admit(self, work: WorkRequest, since: float | None = None) -> None:
        """Dispatch, hold or refuse one request; `since` = held from then (monotonic)."""
        ready = self.admission.admit(work)
        if not ready:
            await self._hold(work, since)
        elif work.priority < BATCH:
            await self._dispatch(work, ready, since)
        elif (roomy := self._idle(work, ready)) and not self.lane.waits(work.model):
            await self._dispatch(work, roomy, since)
        else:  # no room left by interactive work, or older batch work waits first
            self.lane.put(work, len(ready))

    def _idle(self, work: WorkRequest, ready: list[WorkerView] | None = None) -> list[WorkerView]:
        """The ready workers for `work` with room for batch work (services.scheduler.lane)."""
        ready = self.fleet.available(work.model, work.version) if ready is None else ready
        return idle(ready, lambda w: self._load_of(w)[0])

    async def _drain_lane(self, model: str) -> None:
        """Batch work waiting for `model` out to the room there is now, oldest first."""
        for work, workers in self.lane.take(model, self._idle):
            await self._dispatch(work, workers)

    async def _admit_or_refuse(self, work: WorkRequest, since: float | None = None) -> None:
        try:
            await self.admit(work, since)
        except ServiceError as err:
            await self._refuse(work, err)

    async def _hold(self, work: WorkRequest, since: float | None) -> None:
        model = work.model
        n_held = self.holds.hold(work, since, self._queued(model),
                                 len(self.fleet.available(model)))
        self.catalogue.note(model)
        if since is None and work.reply:
            await self.nc.publish(work.reply, encode(Held(work.request_id, model, work.deadline)))
        await self.scaling.held(model, n_held)

    def _queued(self, model: str) -> int:
        """Requests of `model` dispatched here, unfinished."""
        return sum(1 for o in self.outstanding.values() if o.work.model == model)

    # --------------------------------------------------------------- reservations
    async def _on_reserve(self, msg: Msg) -> None:
        try:
            req = reserve_decoder.decode(msg.data)
        except msgspec.DecodeError:
            log.warning("bad_reserve")
            return
        if not msg.reply:
            return
        out: Reserved | WorkError
        try:
            out = Reserved(req.request_id, self.admission.reserve(req))
        except ServiceError as err:
            out = WorkError(req.request_id, err.status, err.message, err.code, err.retry_after)
        await self.nc.publish(msg.reply, encode(out))
        self.loads.changed()

    async def _on_cancel(self, msg: Msg) -> None:
        """A request its gateway gave up on (its client left, its time ran out): held
        for a cold start, it is dropped, so the worker that starts never generates
        it; reserved and not submitted (it failed to tokenize), its room comes back."""
        if not (self.admission.reservations or self.holds.by_model or self.lane.by_model):
            return
        try:
            rid = cancel_decoder.decode(msg.data).request_id
        except msgspec.DecodeError:
            return
        if self.admission.reservations:
            self.admission.release(rid)
        if self.holds.by_model and self.holds.drop(rid) is not None:
            log.debug("held_request_cancelled", request_id=rid)
            self.loads.changed()
        if self.lane.by_model and self.lane.drop(rid) is not None:
            log.debug("batch_request_cancelled", request_id=rid)

    # ------------------------------------------------------------------ dispatch
    async def _dispatch(self, work: WorkRequest, ready: list[WorkerView],
                        since: float | None = None) -> None:
        sent = work
        ready = at_site(ready, self.config.site, lambda w: self._load_of(w)[0],
                        self.config.max_queue_per_worker)
        if not work.version:
            pin, ready = self._route_version(work.model, ready, work.user)
            if pin:  # the worker runs the drawn canary, not its own prod
                sent = msgspec.structs.replace(work, version=pin)
        target, keys = self._pick(work, ready)
        wid = target.worker_id
        # The unpinned original is kept: a re-dispatch draws again.
        now = time.monotonic()
        old = self.outstanding.get(work.request_id)
        if old is not None:  # a gateway asked again (its path was lost): counted once
            self._finished(old)
        self.outstanding[work.request_id] = Outstanding(work, wid, now, keys)
        if keys:
            self.routed.sent(wid, keys)
        self.load[wid] = self.load.get(wid, 0) + 1
        self.admission.dispatched(work)
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
        self.loads.changed()

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
        if done.tokens and not model:
            view = self.fleet.workers.get(done.worker_id)
            model = view.hb.model if view else ""
        self.admission.observe_done(done, model)
        if self.lane.waits(model):  # room freed: batch work waiting takes it
            await self._drain_lane(model)

    def _finished(self, o: Outstanding) -> None:
        self.load[o.worker_id] = max(0, self.load.get(o.worker_id, 0) - 1)
        if o.keys:
            self.routed.finished(o.worker_id, o.keys, time.monotonic())
        self.admission.finished(o.work)

    async def _on_heartbeat(self, msg: Msg) -> None:
        try:
            hb = heartbeat_decoder.decode(msg.data)
        except msgspec.DecodeError:
            return
        if self.aliases is not None:
            self.aliases.track(hb.model)
        self.catalogue.note(hb.model, hb.kind)
        self.admission.observe_heartbeat(hb)  # before it counts as ready: its cost is known
        if hb.start_s:
            self.holds.observe_start(hb.model, hb.start_s)
        view = self.fleet.observe(hb)
        if view.ready and self.holds.count(hb.model) and self.fleet.available(hb.model):
            await self._release_held(hb.model)
        if view.ready and self.lane.waits(hb.model):  # its own count of work may have fallen
            await self._drain_lane(hb.model)
        # A draining worker finishes what it holds; a stopped, unhealthy or wedged one
        # will not, so its outstanding work goes elsewhere (a no-op when it has none).
        if hb.state in ("stopped", "unhealthy") or view.stalled:
            await self.recovery.recover(hb.worker_id, "worker stalled" if view.stalled
                                        else f"worker {hb.state}", gone=True)
        else:  # its connection dropped since its last heartbeat: sent again
            await self.recovery.worker_reconnected(hb)

    async def _on_fleet_status(self, msg: Msg) -> None:
        try:
            status = fleet_status_decoder.decode(msg.data)
        except msgspec.DecodeError:
            return
        self.admission.observe_status(status)
        for work, err in self.holds.fail(self.admission.failed):
            await self._refuse(work, err)

    async def _release_held(self, model: str) -> None:
        """The first ready worker of `model`: what waited for it goes out, interactive
        first, each lane oldest first (batch work takes the room left, or waits)."""
        for h in self.holds.take(model):
            await self._admit_or_refuse(h.work, since=h.since)

    # -------------------------------------------------------------- background
    async def _housekeeping(self) -> None:
        tick = max(0.05, min(0.25, self.config.worker_expiry_s / 4))
        last = time.monotonic()
        while not self._stop.is_set():
            await asyncio.sleep(tick)
            now = time.monotonic()
            late, last = now - last - tick, now
            if late > tick:  # held up: heartbeats may wait unread in our buffers, so a
                self.fleet.excuse(late)  # worker's silence counts only our running time
            if late > self.config.worker_expiry_s / 2:  # and they may all come now
                log.warning("scheduler_stalled", seconds=round(late, 2))
                continue
            for gone in self.fleet.expire():
                log.warning("worker_expired", worker_id=gone.worker_id)
                await self.recovery.recover(gone.worker_id, "missed heartbeats", gone=True)
            for work, err in self.holds.expire(time.time()) + self.lane.expire(time.time()):
                await self._refuse(work, err)
            for model in self.lane.models():  # room a heartbeat-less change freed
                await self._drain_lane(model)
            self.admission.expire_reservations(time.monotonic())

    async def _scaling(self) -> None:
        while not self._stop.is_set():
            await asyncio.sleep(self.scale_interval_s)
            await self.scaling.publish_all()
