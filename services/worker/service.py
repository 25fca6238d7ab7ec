"""The worker: one actor around one engine instance.

  1. Heartbeats start at once (state `starting`, then `warming` while every shape
     bucket compiles, then `ready`), so the scheduler can hold requests during a
     cold start instead of refusing them.
  2. Work arrives on `tensorbus.v1.worker.<id>.work` and goes to the batcher (encoders)
     or the continuous-batching loop (decoders).
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

from services.worker.batcher import BatchOutcome, DynamicBatcher
from services.micro import ServiceHealth, add_service
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
    def __init__(self, nc: Client, config: Config, engine, *, kind: str = "encoder",
                 worker_id: str | None = None, version: str = "local") -> None:
        self.nc = nc
        self.config = config
        self.engine = engine
        self.kind = kind
        self.id = worker_id or config.worker_id or default_worker_id()
        self.model = engine.name
        self.versions = [version]
        self.state = "starting"
        self.last_error = ""
        self.steps = 0
        self.executor = ThreadPoolExecutor(1, thread_name_prefix="engine")
        self.batcher = DynamicBatcher(
            self._embed, self.executor, config.max_batch, config.max_wait_ms / 1000,
            on_result=self._on_batch, on_expired=self._on_expired)
        self.generator = None  # decoders: services.worker.generation.GenerationLoop
        self._sub = None
        self._stop = asyncio.Event()
        self._hb_now = asyncio.Event()

    # ------------------------------------------------------------------ engine
    def _embed(self, inputs: list[list[int]]):
        out = self.engine.embed(inputs)
        self.steps += 1
        return out

    async def warmup(self) -> None:
        self.state = "warming"
        self._hb_now.set()
        loop = asyncio.get_running_loop()
        t0 = time.perf_counter()
        n = await loop.run_in_executor(self.executor, self.engine.warmup, True)
        log.info("warm", buckets=n, seconds=round(time.perf_counter() - t0, 2))

    # --------------------------------------------------------------- lifecycle
    async def run(self, ready: asyncio.Event | None = None) -> None:
        self.health = ServiceHealth(ready=False)
        self.health.add_check("forward_progress", self._progressing, liveness=True)
        self.micro = await add_service(
            self.nc, "tensorbus-worker", VERSION, f"{self.kind} worker for {self.model}",
            health=self.health, metadata={"worker_id": self.id, "model": self.model})
        async with asyncio.TaskGroup() as tg:
            tg.create_task(self._heartbeats())
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
            self.health.details = {"model": self.model, "versions": self.versions}
            self._hb_now.set()
            log.info("ready", worker_id=self.id, model=self.model, kind=self.kind)
            if ready is not None:
                ready.set()
            await self._stop.wait()
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
        return time.monotonic() - getattr(self, "_last_progress", time.monotonic()) < 10.0

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
        if isinstance(work, EmbedWork) and self.kind == "encoder":
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
            res = EmbedResult(w.request_id, self.id, self.model, self.versions[0],
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
        return Heartbeat(
            worker_id=self.id, model=self.model, kind=self.kind, state=self.state,
            versions=list(self.versions), queue_depth=queue, in_flight=in_flight,
            max_batch=self.config.max_batch if not gen else gen.slots,
            batch_occupancy=occupancy, steps=steps, rss_bytes=rss_bytes(),
            device=getattr(self.engine, "device", "cpu"), sent_at=time.time(),
            slots_total=gen.slots if gen else 0, slots_used=gen.in_flight if gen else 0,
            kv_usage=gen.kv_usage() if gen else 0.0, last_error=self.last_error,
            dtype=getattr(self.engine, "dtype", "float32"))

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
