"""The scheduler: admission, routing and recovery for every request.

Dataflow of one request:
  1. The gateway publishes a WorkRequest to `tensorbus.v1.sched.submit` (queue group:
     one scheduler gets it) with the NATS reply set to the gateway's inbox.
  2. Admission: an expired deadline is a 504, no worker for the model a 503 (or the
     request is held while one warms up), a full fleet queue a 429 with Retry-After.
     Every refusal is sent to the request's reply subject at once.
  3. Routing: the least-loaded ready worker serving the model (and the version the
     request pins or the canary draw picks) gets the WorkRequest on its work subject.
     An unpinned request that draws the canary goes out pinned to it; one that draws
     prod goes to workers holding prod, unpinned, so each runs its own current prod
     (a scheduler whose view lags a promotion never sends work back to the old one).
     When no ready worker holds the drawn version yet (a canary still loading, a
     promotion in progress), prod is used, and failing that any ready worker.
  4. The worker replies to the gateway directly and tells this scheduler which
     requests finished (`WorkDone`), so the outstanding count per worker stays exact.
  5. When a worker expires (missed heartbeats) or reports draining with work still
     outstanding here, that work is dispatched again to another worker (the gateway
     keeps only the first answer per request id).
  6. Every `scale_interval_s` a ScaleDecision per model goes to `telemetry.v1.scale`.
"""

from __future__ import annotations

import asyncio
import math
import random
import time
import uuid
from collections import deque
from dataclasses import dataclass

import msgspec
from nats.aio.client import Client
from nats.aio.msg import Msg

from services.fleet import Fleet, WorkerView
from services.micro import ServiceHealth, add_service
from services.scheduler.aliases import AliasTable
from shared import VERSION, subjects
from shared.config import Config
from shared.errors import ServiceError, deadline_exceeded, overloaded, unavailable
from shared.logging import get_logger
from shared.messages import (
    WorkError,
    WorkRequest,
    done_decoder,
    encode,
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


class Scheduler:
    def __init__(self, nc: Client, config: Config, scheduler_id: str | None = None,
                 choose_version=None, scale_interval_s: float = 2.0,
                 registry=None) -> None:
        self.nc = nc
        self.config = config
        self.id = scheduler_id or config.scheduler_id or uuid.uuid4().hex[:12]
        self.fleet = Fleet(expiry_s=config.worker_expiry_s, stall_s=config.stall_s)
        # With a registry, each model seen in heartbeats has its aliases watched.
        self.aliases = AliasTable(registry) if registry is not None else None
        self.choose_version = choose_version or (
            self.aliases.choose if self.aliases is not None else (lambda model: ""))
        self.prod_version = self.aliases.prod if self.aliases is not None else (lambda model: "")
        self.scale_interval_s = scale_interval_s
        self.outstanding: dict[str, Outstanding] = {}
        self.load: dict[str, int] = {}  # worker_id -> requests outstanding here
        self.held: deque[WorkRequest] = deque()  # waiting for a worker to warm up
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
                tg.create_task(self._housekeeping())
                tg.create_task(self._scaling())
                await self._stop.wait()
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

    async def admit(self, work: WorkRequest) -> None:
        if work.deadline <= time.time():
            raise deadline_exceeded("the request's deadline passed before it was scheduled")
        model = work.model
        ready = self.fleet.ready(model, work.version)
        if not ready:
            if self.fleet.warming(model) and len(self.held) < self._capacity(model, 1):
                self.held.append(work)
                return
            known = bool(self.fleet.for_model(model))
            what = "no ready worker" if known else "no worker"
            raise unavailable(f"{what} serves model '{model}'" + (
                f" version {work.version}" if work.version else "") + "; retry shortly")
        queued = sum(self.load.get(w.worker_id, 0) for w in ready)
        cap = self._capacity(model, len(ready))
        if queued >= cap:
            raise overloaded(f"model '{model}' is at capacity ({queued} requests queued); "
                             "retry after the hinted delay", retry_after=1.0)
        await self._dispatch(work, ready)

    def _capacity(self, model: str, n_ready: int) -> int:
        return self.config.max_queue_per_worker * max(n_ready, 1)

    async def _dispatch(self, work: WorkRequest, ready: list[WorkerView]) -> None:
        sent = work
        if not work.version:
            pin, ready = self._route_version(work.model, ready)
            if pin:  # the worker runs the drawn canary, not its own prod
                sent = msgspec.structs.replace(work, version=pin)
        target = min(ready, key=self._load_of)
        wid = target.worker_id
        # The unpinned original is kept: a re-dispatch draws again.
        self.outstanding[work.request_id] = Outstanding(work, wid, time.monotonic())
        self.load[wid] = self.load.get(wid, 0) + 1
        self.dispatched += 1
        await self.nc.publish(subjects.worker_work(wid), encode(sent))

    def _route_version(self, model: str, ready: list[WorkerView]) -> tuple[str, list[WorkerView]]:
        """(version to pin, workers holding it): the draw, else prod, else ("", all).

        Prod is never pinned ("" = the worker's own prod)."""
        prod = self.prod_version(model)
        for version in (self.choose_version(model), prod):
            if version:
                pool = [w for w in ready if version in w.hb.versions]
                if pool:
                    return ("" if version == prod else version), pool
        return "", ready

    def _load_of(self, w: WorkerView) -> tuple[int, float]:
        mine = self.load.get(w.worker_id, 0)
        theirs = w.hb.queue_depth + w.hb.in_flight
        return (max(mine, theirs), self.rng.random())

    async def _refuse(self, work: WorkRequest, err: ServiceError) -> None:
        if not work.reply:
            return
        out = WorkError(work.request_id, err.status, err.message, err.code, err.retry_after)
        await self.nc.publish(work.reply, encode(out))

    # ------------------------------------------------------------------ feedback
    async def _on_done(self, msg: Msg) -> None:
        try:
            done = done_decoder.decode(msg.data)
        except msgspec.DecodeError:
            return
        for rid in done.request_ids:
            o = self.outstanding.pop(rid, None)
            if o is not None:
                self.load[o.worker_id] = max(0, self.load.get(o.worker_id, 0) - 1)

    async def _on_heartbeat(self, msg: Msg) -> None:
        try:
            hb = heartbeat_decoder.decode(msg.data)
        except msgspec.DecodeError:
            return
        if self.aliases is not None:
            self.aliases.track(hb.model)
        view = self.fleet.observe(hb)
        if view.ready and self.held:
            await self._release_held()
        # A draining worker finishes what it holds; a stopped, unhealthy or wedged one
        # will not, so its outstanding work goes elsewhere (a no-op when it has none).
        if hb.state in ("stopped", "unhealthy") or view.stalled:
            await self._recover(hb.worker_id, "worker stalled" if view.stalled else f"worker {hb.state}")

    async def _release_held(self) -> None:
        held, self.held = self.held, deque()
        for work in held:
            try:
                await self.admit(work)
            except ServiceError as err:
                await self._refuse(work, err)

    async def _recover(self, worker_id: str, why: str) -> None:
        """Send the unfinished work of a lost worker to the others."""
        lost = [o for o in self.outstanding.values() if o.worker_id == worker_id]
        self.load.pop(worker_id, None)
        if lost:
            log.warning("redispatching", worker_id=worker_id, requests=len(lost), reason=why)
        for o in lost:
            self.outstanding.pop(o.work.request_id, None)
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

    async def _expire_held(self) -> None:
        if not self.held:
            return
        now = time.time()
        keep: deque[WorkRequest] = deque()
        for work in self.held:
            if work.deadline <= now:
                await self._refuse(work, deadline_exceeded(
                    "no worker became ready before the request's deadline"))
            elif not self.fleet.warming(work.model) and not self.fleet.ready(work.model):
                await self._refuse(work, unavailable(f"no worker serves model '{work.model}'"))
            else:
                keep.append(work)
        self.held = keep

    async def _scaling(self) -> None:
        while not self._stop.is_set():
            await asyncio.sleep(self.scale_interval_s)
            for decision in self.scale_decisions():
                await self.nc.publish(subjects.TELEMETRY_SCALE, encode_record(decision))

    def scale_decisions(self) -> list[ScaleDecision]:
        out = []
        target = max(self.config.target_queue_per_replica, 1.0)
        for model, workers in self.fleet.models().items():
            ready = [w for w in workers if w.ready]
            queue = sum(w.hb.queue_depth for w in workers)
            inflight = sum(w.hb.in_flight for w in workers)
            desired = max(1, math.ceil((queue + inflight) / target))
            reason = "queue above target" if desired > len(ready) else (
                "queue below target" if desired < len(ready) else "steady")
            out.append(ScaleDecision(model, len(ready), desired, queue, inflight, reason, time.time()))
        return out
