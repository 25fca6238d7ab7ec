"""The local orchestrator: runs the worker processes the scale decisions ask for.

  1. At start the models to manage are the bundled ones and the registry's catalogue
     (re-read every `catalogue_s`), with bounds from `Config.fleet_bounds`; each
     model's minimum is started at once, before any decision arrives.
  2. ScaleDecisions on `telemetry.v1.scale` go to the policy (one per scheduler per
     model; a silent scheduler's expire); heartbeats on `telemetry.v1.workers` tell
     which of this orchestrator's workers are ready.
  3. On every decision, exit and tick (`interval_s`), the policy's plan is carried
     out: new workers start with their engine threads; surplus ones get SIGTERM
     and drain, and SIGKILL if still alive after `TENSORBUS_DRAIN_TIMEOUT_S`.
  4. A worker that exits unasked is restarted with back-off; one that exits 78 is not,
     and its model is `failed` with the worker's last stderr line as the reason.
  5. A FleetStatus goes to `tensorbus.v1.orchestrator.status` at once when any
     model's state changes, and every `status_s` regardless.
  6. `stop()` (SIGTERM/SIGINT): every worker drains, then `run()` returns.
"""

from __future__ import annotations

import asyncio
import os
import socket
import time
from typing import Awaitable, BinaryIO, Callable

import msgspec
from nats.aio.client import Client
from nats.aio.msg import Msg

from services.liveness import live_file
from services.micro import ServiceHealth, add_service
from services.orchestrator.policy import (
    ModelSpec,
    Plan,
    Policy,
    ProcView,
    model_specs,
    model_state,
    threads_per_worker,
)
from services.orchestrator.procs import Launcher, WorkerProcess, describe_exit, safe_token
from shared import VERSION, catalog, subjects
from shared.config import Config, parse_fleet
from shared.logging import get_logger
from shared.messages import FleetStatus, ModelStatus, encode
from shared.scaling import NOT_SERVED
from shared.telemetry import Heartbeat, ScaleDecision, record_decoder

log = get_logger("orchestrator")

Catalogue = Callable[[], Awaitable[list[str]]]


def registry_catalogue(registry) -> Catalogue:
    """The bundled models and the registry's (None: the bundled ones only). A registry
    read that fails or takes over 5 s keeps the names of the last good one, so a slow
    registry never drains a model's workers."""
    listed: set[str] = set()

    async def names() -> list[str]:
        nonlocal listed
        if registry is not None:
            try:
                listed = set(await asyncio.wait_for(registry.list_models(), 5.0))
            except Exception as exc:  # noqa: BLE001 - keep the last good list
                log.warning("registry_list_failed", error=f"{type(exc).__name__}: {exc}")
        return sorted({m.name for m in catalog.bundled()} | listed)

    return names


class Orchestrator:
    def __init__(self, nc: Client, config: Config, catalogue: Catalogue, *,
                 env: dict[str, str] | None = None, cores: int | None = None,
                 interval_s: float = 1.0, status_s: float = 2.0, catalogue_s: float = 10.0,
                 orchestrator_id: str | None = None, worker_argv: list[str] | None = None,
                 out: BinaryIO | None = None) -> None:
        self.nc = nc
        self.config = config
        self.catalogue = catalogue
        self.cores = cores or os.cpu_count() or 1
        self.interval_s = interval_s
        self.status_s = status_s
        self.catalogue_s = catalogue_s
        self.id = orchestrator_id or safe_token(socket.gethostname().split(".")[0])
        self.policy = Policy([], config.worker_budget(self.cores),
                             target_per_replica=config.target_queue_per_replica)
        self.launcher = Launcher(dict(os.environ if env is None else env), self._on_exit,
                                 out=out, argv=worker_argv, worker_prefix=f"{self.id}-")
        self.procs: dict[str, WorkerProcess] = {}
        self.worker_state: dict[str, tuple[str, float]] = {}  # worker id -> (state, seen)
        self._wake = asyncio.Event()
        self._stop = asyncio.Event()
        self._plan = Plan()
        self._unknown: set[str] = set()  # fleet entries already warned about
        self._deadlines: set[asyncio.Task] = set()  # SIGKILL for workers that drain too long
        self._last_status: list[ModelStatus] | None = None
        self._status_at = 0.0

    # ------------------------------------------------------------ lifecycle
    async def run(self, ready: asyncio.Event | None = None) -> None:
        health = ServiceHealth(ready=False)
        health.details = {"instance": f"{socket.gethostname()}-{os.getpid()}"}
        micro = await add_service(self.nc, "tensorbus-orchestrator", VERSION,
                                  "local orchestrator: runs the worker processes",
                                  health=health, metadata={"orchestrator_id": self.id},
                                  live_file=live_file("tensorbus-orchestrator", self.config))
        subs = [await self.nc.subscribe(subjects.TELEMETRY_SCALE, cb=self._on_record),
                await self.nc.subscribe(subjects.TELEMETRY_WORKERS, cb=self._on_record)]
        await self.refresh_catalogue()
        health.ready = True
        log.info("orchestrating", orchestrator_id=self.id, budget=self.policy.budget,
                 cores=self.cores, models={m.name: (m.min, m.max) for m in self.policy.models})
        if ready is not None:
            ready.set()
        refresh = asyncio.create_task(self._catalogue_loop())
        try:
            await self._control_loop()
        finally:
            refresh.cancel()
            for t in self._deadlines:
                t.cancel()
            for s in subs:
                await s.unsubscribe()
            await self._drain_all()
            await self._publish_status(force=True)
            await micro.stop()

    def stop(self) -> None:
        """Drain every worker and return from run() (idempotent)."""
        self._stop.set()
        self._wake.set()

    async def _drain_all(self) -> None:
        procs = list(self.procs.values())
        for wp in procs:
            wp.terminate()
        log.info("draining_workers", workers=[p.name for p in procs])
        await self.launcher.wait_all(procs, self.config.drain_timeout_s)

    # ----------------------------------------------------------- catalogue
    async def refresh_catalogue(self) -> None:
        try:
            names = await self.catalogue()
        except Exception as exc:  # noqa: BLE001 - keep the models already known
            log.warning("catalogue_unavailable", error=str(exc))
            return
        specs = model_specs(self.config, names)
        for name in parse_fleet(self.config.fleet).keys() - set(names) - self._unknown:
            self._unknown.add(name)
            log.warning("fleet_model_unknown", model=name,
                        why="TENSORBUS_FLEET names it, but neither the registry nor the "
                            "bundled models hold it; it gets no worker until one does")
        if specs != self.policy.models:
            self.policy.set_models(specs)
            self._wake.set()

    async def _catalogue_loop(self) -> None:
        while True:
            await asyncio.sleep(self.catalogue_s)  # a period, not a synchronisation
            await self.refresh_catalogue()

    # -------------------------------------------------------------- inputs
    async def _on_record(self, msg: Msg) -> None:
        try:
            rec = record_decoder.decode(msg.data)
        except msgspec.DecodeError:
            return
        if isinstance(rec, ScaleDecision):
            self.policy.observe(rec, time.monotonic())
            self._wake.set()
        elif isinstance(rec, Heartbeat) and rec.worker_id.startswith(self.id + "-"):
            prev = self.worker_state.get(rec.worker_id, ("", 0.0))[0]
            self.worker_state[rec.worker_id] = (rec.state, time.monotonic())
            if prev != rec.state:
                self._wake.set()

    def _on_exit(self, wp: WorkerProcess, code: int) -> None:
        self.procs.pop(wp.name, None)
        self.worker_state.pop(wp.worker_id, None)
        view = ProcView(wp.name, wp.model, wp.started_at, wp.stopping)
        how = describe_exit(code)
        outcome = self.policy.exited(view, code, wp.last_stderr or how, time.monotonic())
        level = log.info if outcome == "stopped" else log.error
        level("worker_exited", worker=wp.name, worker_id=wp.worker_id, model=wp.model,
              pid=wp.pid, code=code, outcome=outcome, exit=how, last_stderr=wp.last_stderr)
        self._wake.set()

    # ------------------------------------------------------------- control
    async def _control_loop(self) -> None:
        while not self._stop.is_set():
            self._wake.clear()
            await self.reconcile()
            try:
                await asyncio.wait_for(self._wake.wait(), self._next_tick())
            except TimeoutError:
                pass

    def _next_tick(self) -> float:
        now = time.monotonic()
        retries = [self.policy.retry_at(m.name) - now for m in self.policy.models]
        return max(0.05, min([self.interval_s] + [r for r in retries if r > 0]))

    def views(self) -> list[ProcView]:
        return [ProcView(p.name, p.model, p.started_at, p.stopping) for p in self.procs.values()]

    async def reconcile(self) -> None:
        now = time.monotonic()
        plan = self.policy.plan(self.views(), now)
        threads = threads_per_worker(self.cores, sum(plan.targets.values()),
                                     self.config.worker_threads)
        wp: WorkerProcess | None
        for model in plan.start:
            try:
                wp = await self.launcher.start(model, threads)
            except OSError as exc:  # fork or exec refused (memory, process limit)
                log.error("worker_start_failed", model=model, error=str(exc))
                self.policy.exited(ProcView("", model, now), 1, f"could not start: {exc}", now)
                continue
            self.procs[wp.name] = wp
            log.info("worker_started", worker=wp.name, worker_id=wp.worker_id, pid=wp.pid,
                     model=model, threads=threads)
        for name in plan.stop:
            wp = self.procs.get(name)
            if wp is not None and not wp.stopping:
                log.info("worker_stopping", worker=name, worker_id=wp.worker_id, pid=wp.pid)
                wp.terminate()
                task = asyncio.create_task(self._deadline(wp))
                self._deadlines.add(task)
                task.add_done_callback(self._deadlines.discard)
        self._plan = plan
        await self._publish_status()

    async def _deadline(self, wp: WorkerProcess) -> None:
        try:
            await asyncio.wait_for(wp.exited.wait(), self.config.drain_timeout_s)
        except TimeoutError:
            log.warning("drain_deadline_passed", worker=wp.name, pid=wp.pid)
            wp.kill()

    # -------------------------------------------------------------- status
    def status(self) -> list[ModelStatus]:
        targets, notes = self._plan.targets, self._plan.notes
        now = time.monotonic()
        fresh = self.config.worker_expiry_s
        out = []
        for m in self.policy.models:
            mine = [p for p in self.procs.values() if p.model == m.name and not p.stopping]
            ready = sum(1 for p in mine if self._ready(p.worker_id, now, fresh))
            failed = self.policy.failed(m.name)
            target = 0 if self._stop.is_set() else targets.get(m.name, 0)
            reason = failed or ("orchestrator stopped" if self._stop.is_set() else
                                notes.get(m.name, "") or _bounds_note(m))
            out.append(ModelStatus(m.name, model_state(target, len(mine), ready, failed),
                                   len(mine), target, reason))
        return out

    def _ready(self, worker_id: str, now: float, fresh: float) -> bool:
        state, seen = self.worker_state.get(worker_id, ("", 0.0))
        return state == "ready" and now - seen <= fresh

    async def _publish_status(self, force: bool = False) -> None:
        models = self.status()
        now = time.monotonic()
        if not force and models == self._last_status and now - self._status_at < self.status_s:
            return
        if models != self._last_status:
            log.info("fleet_status", models={s.model: f"{s.state} {s.running}/{s.desired}"
                                             for s in models})
        self._last_status, self._status_at = models, now
        await self.nc.publish(subjects.ORCHESTRATOR_STATUS,
                              encode(FleetStatus(self.id, models, time.time())))


def _bounds_note(m: ModelSpec) -> str:
    return NOT_SERVED if m.max == 0 else ""
