"""The worker: one actor around one engine instance.

  1. Heartbeats start at once (state `starting`, then `warming` while every shape
     bucket compiles, then `ready`), so the scheduler can hold requests during a
     cold start instead of refusing them.
     With a model source the versions come from the registry (`versions.HotSwap`):
     prod and canary are fetched and verified while the state is `starting`, and the
     aliases are followed afterwards (hot swap without dropping requests).
  2. Work arrives on `tensorbus.v1.worker.<id>.work` and goes to the batcher (encoders)
     or the continuous-batching loop (decoders). Work pinned to a version this worker
     does not hold is refused with a 503 at once.
  3. Results go straight to the request's reply subject (the gateway's inbox);
     the dispatching scheduler hears which requests finished (one `WorkDone` per batch).
  4. `drain()` (SIGTERM): report `draining` so schedulers stop routing here, keep
     serving what was already sent for a grace period, stop taking work, finish what
     is held, report `stopped`.
"""

from __future__ import annotations

import asyncio
import os
import socket
import time
from collections import defaultdict
from concurrent.futures import ThreadPoolExecutor

import msgspec
from nats.aio.client import Client
from nats.aio.msg import Msg

from services.micro import ServiceHealth, add_service
from services.registry.source import LOCAL, ModelSource
from services.worker.batcher import BatchOutcome, DynamicBatcher
from services.worker.versions import EngineFactory, HotSwap, LoadedModels
from shared import VERSION, subjects
from shared.config import Config
from shared.errors import ServiceError, deadline_exceeded, internal
from shared.logging import get_logger
from shared.messages import (
    EmbedResult,
    EmbedWork,
    GenerateWork,
    WorkDone,
    WorkError,
    encode,
    work_decoder,
)
from shared.telemetry import Heartbeat
from shared.telemetry import encode as encode_record

log = get_logger("worker")


def default_worker_id() -> str:
    return f"{socket.gethostname()}-{os.getpid()}"


def rss_bytes() -> int:
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:
        return 0


class Worker:
    """One engine (or one per loaded version) behind a NATS inbox.

    Either pass a built `engine` (it serves as `version`, fixed), or pass `model`,
    `source` and `engine_factory`: the worker then loads the versions the registry's
    aliases name and follows them. `kind` may be left empty in that case; the first
    version loaded decides it.
    """

    def __init__(self, nc: Client, config: Config, engine=None, *, kind: str = "",
                 worker_id: str | None = None, version: str = LOCAL, model: str = "",
                 source: ModelSource | None = None,
                 engine_factory: EngineFactory | None = None) -> None:
        self.nc = nc
        self.config = config
        self.kind = kind or ("encoder" if engine is not None else "")
        self.id = worker_id or config.worker_id or default_worker_id()
        self.model = engine.name if engine is not None else (model or config.model)
        self.models = LoadedModels(engine, version)
        self.swap: HotSwap | None = None
        if engine is None:
            if engine_factory is None:
                raise ValueError("a worker needs an engine or an engine factory")
            self.swap = HotSwap(self, source, engine_factory, model_dir=config.model_dir)
        self.state = "starting"
        self.health: ServiceHealth | None = None  # set in run()
        self.last_error = ""
        self.steps = 0
        self.executor = ThreadPoolExecutor(1, thread_name_prefix="engine")
        self.batcher = DynamicBatcher(
            self._embed, self.executor, config.max_batch, config.max_wait_ms / 1000,
            on_result=self._on_batch, on_expired=self._on_expired,
            version_of=lambda v: self.models.resolve(v))
        self.generator = None  # decoders: services.worker.generation.GenerationLoop
        self._sub = None
        self._stop = asyncio.Event()
        self._hb_now = asyncio.Event()

    # ------------------------------------------------------------------ engine
    @property
    def engine(self):
        """The prod version's engine."""
        return self.models.engine_of("")

    @property
    def versions(self) -> list[str]:
        """Versions traffic goes to, prod first (heartbeats, results of unpinned work)."""
        return self.models.serving()

    def _embed(self, version: str, inputs: list[list[int]]):
        """Runs on the engine thread; `version` is held until its batch is done."""
        out = self.models.engine_of(version).embed(inputs)
        self.steps += 1
        return out

    async def warmup(self) -> None:
        self.state = "warming"
        self._hb_now.set()
        loop = asyncio.get_running_loop()
        t0 = time.perf_counter()
        n = 0
        for engine in list(self.models.engines.values()):
            n += await loop.run_in_executor(self.executor, engine.warmup, True) or 0
        log.info("warm", buckets=n, seconds=round(time.perf_counter() - t0, 2))

    def versions_changed(self) -> None:
        """The served versions (or last_error) changed: tell everyone now."""
        if self.health is not None and self.health.ready:
            self.health.details = {"instance": self.id, "model": self.model, "versions": self.versions}
        self._hb_now.set()

    # --------------------------------------------------------------- lifecycle
    async def run(self, ready: asyncio.Event | None = None) -> None:
        self.health = ServiceHealth(ready=False)
        self.health.details = {"instance": self.id}
        self.health.add_check("forward_progress", self._progressing, liveness=True)
        what = f"{self.kind} worker" if self.kind else "worker"
        self.micro = await add_service(
            self.nc, "tensorbus-worker", VERSION, f"{what} for {self.model}",
            health=self.health, metadata={"worker_id": self.id, "model": self.model})
        async with asyncio.TaskGroup() as tg:
            tg.create_task(self._heartbeats())
            if self.swap is not None:
                t0 = time.perf_counter()
                self.models = await self.swap.start()
                log.info("loaded", versions=self.versions, kind=self.kind,
                         seconds=round(time.perf_counter() - t0, 2))
            await self.warmup()
            if self.kind == "decoder":
                from services.worker.generation import GenerationLoop

                self.generator = GenerationLoop(self)
                tg.create_task(self.generator.run())
            else:
                tg.create_task(self.batcher.run())
            self._sub = await self.nc.subscribe(
                subjects.worker_work(self.id), cb=self._on_work,
                pending_msgs_limit=1_000_000, pending_bytes_limit=1 << 30)
            await self.nc.flush()
            self.state = "ready"
            self.health.ready = True
            self.health.details = {"instance": self.id, "model": self.model, "versions": self.versions}
            self._hb_now.set()
            log.info("ready", worker_id=self.id, model=self.model, kind=self.kind,
                     versions=self.versions)
            follow = tg.create_task(self.swap.run()) if self.swap is not None else None
            if ready is not None:
                ready.set()
            await self._stop.wait()
            if follow is not None:  # no swap while draining
                follow.cancel()
                await self.swap.stop()
            await self._drain()
            self._hb_now.set()

    def stop(self) -> None:
        """Begin draining (idempotent)."""
        self._stop.set()

    def _progressing(self) -> bool:
        """Live unless work is held and no engine step finished for a while."""
        busy = self.batcher.in_flight or (self.generator and self.generator.in_flight)
        if not busy:
            self._last_steps, self._last_progress = self.steps, time.monotonic()
            return True
        steps = self.generator.steps if self.generator else self.steps
        if steps != getattr(self, "_last_steps", -1):
            self._last_steps, self._last_progress = steps, time.monotonic()
        return time.monotonic() - getattr(self, "_last_progress", time.monotonic()) < self.config.stall_s

    async def _drain(self) -> None:
        self.health.ready = False
        self.state = "draining"
        self._hb_now.set()
        log.info("draining", worker_id=self.id)
        # Schedulers that have not seen `draining` yet may still send work; keep the
        # subscription open until every scheduler has either seen it or expired us.
        await asyncio.sleep(self.config.heartbeat_s * 3)
        if self._sub is not None:
            await self._sub.drain()
        if self.generator is not None:
            await self.generator.drain()
        else:
            self.batcher.close()
            await self.batcher.wait_idle()
        self.state = "stopped"
        await self._publish_heartbeat()
        await self.nc.flush()
        await self.micro.stop()
        self.executor.shutdown(wait=False)
        log.info("stopped", worker_id=self.id)

    # ------------------------------------------------------------------- work
    async def _on_work(self, msg: Msg) -> None:
        try:
            work = work_decoder.decode(msg.data)
        except msgspec.DecodeError:
            log.warning("bad_work_message")
            return
        log.debug("request_received", request_id=work.request_id, model=work.model)
        if work.version and not self.models.holds(work.version):
            await self.send_error(work, ServiceError(
                503, f"version {work.version} of '{work.model}' is not loaded on this worker; "
                "retry shortly", code="version_unavailable", retry_after=1.0))
            await self.report_done({work.sched_id: [work.request_id]})
        elif isinstance(work, EmbedWork) and self.kind == "encoder":
            self.batcher.submit(work)
        elif isinstance(work, GenerateWork) and self.generator is not None:
            self.generator.submit(work)
        else:
            await self.send_error(work, ServiceError(
                400, f"model '{work.model}' does not serve this endpoint"))

    async def _on_batch(self, out: BatchOutcome) -> None:
        done: dict[str, list[str]] = defaultdict(list)
        if out.error is not None:
            log.error("batch_failed", error=repr(out.error))
            for p in out.items:
                await self.send_error(p.work, internal("the model failed on this input"))
                done[p.work.sched_id].append(p.work.request_id)
        for p, exc in out.failed:
            log.error("request_failed", request_id=p.work.request_id, error=repr(exc))
            await self.send_error(p.work, internal("the model failed on this input"))
            done[p.work.sched_id].append(p.work.request_id)
        for p, vecs, timing in zip(out.items, out.vectors, out.timings):
            w = p.work
            res = EmbedResult(w.request_id, self.id, self.model, out.version,
                              int(vecs.shape[1]), vecs.astype("<f4", copy=False).tobytes(),
                              sum(len(x) for x in w.inputs), timing)
            await self.nc.publish(w.reply, encode(res))
            done[w.sched_id].append(w.request_id)
        await self.report_done(done)

    async def report_done(self, done: dict[str, list[str]]) -> None:
        for sched_id, ids in done.items():
            if sched_id:
                await self.nc.publish(subjects.sched_done(sched_id), encode(WorkDone(self.id, ids)))

    async def _on_expired(self, work) -> None:
        await self.send_error(work, deadline_exceeded("the request expired in the worker's queue"))
        await self.report_done({work.sched_id: [work.request_id]})

    async def send_error(self, work, err: ServiceError) -> None:
        if work.reply:
            await self.nc.publish(work.reply, encode(WorkError(
                work.request_id, err.status, err.message, err.code, err.retry_after, self.id)))

    # -------------------------------------------------------------- heartbeats
    def heartbeat(self) -> Heartbeat:
        gen = self.generator
        queue = gen.queue_depth if gen else self.batcher.queue_depth
        in_flight = gen.in_flight if gen else self.batcher.in_flight
        occupancy = gen.occupancy() if gen else self.batcher.stats.take_occupancy(self.config.max_batch)
        steps = gen.steps if gen else self.steps
        engine = self.models.engines.get(self.models.prod)  # None while starting
        return Heartbeat(
            worker_id=self.id, model=self.model, kind=self.kind or "encoder", state=self.state,
            versions=list(self.versions), queue_depth=queue, in_flight=in_flight,
            max_batch=self.config.max_batch if not gen else gen.slots,
            batch_occupancy=occupancy, steps=steps, rss_bytes=rss_bytes(),
            device=getattr(engine, "device", "cpu"), sent_at=time.time(),
            slots_total=gen.slots if gen else 0, slots_used=gen.in_flight if gen else 0,
            kv_usage=gen.kv_usage() if gen else 0.0, last_error=self.last_error,
            dtype=getattr(engine, "dtype", "float32"))

    async def _publish_heartbeat(self) -> None:
        await self.nc.publish(subjects.TELEMETRY_WORKERS, encode_record(self.heartbeat()))

    async def _heartbeats(self) -> None:
        while True:
            await self._publish_heartbeat()
            if self.state == "stopped":
                return
            self._hb_now.clear()
            try:
                await asyncio.wait_for(self._hb_now.wait(), self.config.heartbeat_s)
            except TimeoutError:
                pass
