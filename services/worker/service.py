"""The worker: one actor around its engines, one per loaded version.

  1. Heartbeats start at once (state `starting`, then `warming` while every shape
     bucket compiles, then `ready`), so the scheduler can hold requests during a
     cold start instead of refusing them. Each carries the runner's load and the
     worker's memory (device memory where the backend reports it, else host RSS).
     An encoder's warm-up ends by timing two full batches (`time_encoder`), a
     decoder's by timing two prompts and a decode step (`time_decoder`, then refitted
     by its runner as it steps); every heartbeat from then on carries the cost, so
     schedulers admit a first burst by its work, not by a count.
     With a model source the versions come from the registry (`versions.HotSwap`):
     prod and canary are fetched and verified while the state is `starting`, and the
     aliases are followed afterwards (hot swap without dropping requests, encoders
     and decoders alike). `LoadedModels` reports every change by callback, and a
     heartbeat goes out at once.
  2. Work arrives on `tensorbus.v1.worker.<id>.work` and goes to the runner: the
     encoder runner (dynamic batching) or the decoder runner (continuous batching),
     both behind `runner.Runner` and both answering through a narrow `Outbox`. Work
     pinned to a version this worker does not hold is refused with a 503 at once;
     a `Cancel` goes to the runner.
  3. Results go straight to the requesting gateway's inbox, everything one batch or
     decode step produced for one gateway as one message (`Outbox`); the
     dispatching scheduler hears which requests finished (`WorkDone`).
  4. `drain()` (SIGTERM): report `draining` so schedulers stop routing here, keep
     serving what was already sent for a grace period, stop taking work, finish what
     is held, report `stopped`.
"""

from __future__ import annotations

import asyncio
import os
import socket
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import msgspec
from nats.aio.client import Client
from nats.aio.msg import Msg

from services.liveness import live_file
from services.micro import ServiceHealth, add_service
from services.registry.source import LOCAL, ModelSource
from services.worker.batcher import EncoderRunner
from services.worker.engines import prefill_chunk
from services.worker.fleet import FleetPrograms
from services.worker.generation import DecoderRunner
from services.worker.memory import MemoryProbe, rss_bytes
from services.worker.priority import lower_threads
from services.worker.runner import Gauges, Outbox, Runner
from services.worker.timing import time_decoder, time_encoder
from services.worker.versions import EngineFactory, HotSwap, LoadedModels
from shared import VERSION, subjects
from shared.bus import Links
from shared.costs import Cost, GenCost
from shared.config import Config
from shared.errors import ServiceError
from shared.logging import get_logger
from shared.messages import cancel_decoder, work_decoder
from shared.telemetry import Heartbeat
from shared.telemetry import encode as encode_record

log = get_logger("worker")

def default_worker_id() -> str:
    return f"{socket.gethostname()}-{os.getpid()}"


class Worker:
    """Engines (one per loaded version) behind a NATS inbox.

    Either pass a built `engine` (it serves as `version`, fixed), or pass `model`,
    `source` and `engine_factory`: the worker then loads the versions the registry's
    aliases name and follows them. `kind` may be left empty in that case; the first
    version loaded decides it.
    """

    def __init__(self, nc: Client, config: Config, engine=None, *, kind: str = "",
                 worker_id: str | None = None, version: str = LOCAL, model: str = "",
                 source: ModelSource | None = None,
                 engine_factory: EngineFactory | None = None, time_warmup: bool = True,
                 fleet: FleetPrograms | None = None) -> None:
        self.nc = nc
        self.links = Links(nc)  # its drops go out in heartbeats (`reconnects`)
        self.config = config
        self.id = worker_id or config.worker_id or default_worker_id()
        self.model = engine.name if engine is not None else (model or config.model)
        self.models = LoadedModels(engine, version,
                                   kind=kind or ("encoder" if engine is not None else ""))
        self.models.on_change(self.versions_changed)
        self.swap: HotSwap | None = None
        if engine is None:
            if engine_factory is None:
                raise ValueError("a worker needs an engine or an engine factory")
            self.swap = HotSwap(self.model, self.models, source, engine_factory,
                                in_use=self._wait_unused, grace_s=config.heartbeat_s * 3,
                                model_dir=config.model_dir, fleet=fleet)
        self.fleet = fleet
        self.outbox = Outbox(nc, self.id, self.model, prod=lambda: self.models.prod)
        self.runner: Runner[Any] | None = None  # built in run(), once the kind is known
        self.memory = MemoryProbe()
        self.state = "starting"
        self.health: ServiceHealth | None = None  # set in run()
        self.executor = ThreadPoolExecutor(1, thread_name_prefix="engine")
        self._subs: list = []
        self._stop = asyncio.Event()
        self._hb_now = asyncio.Event()
        self.time_warmup = time_warmup  # time the encoder at warm-up (its cost, in heartbeats)
        self.warm_cost: Cost | GenCost | None = None  # an encoder's, or a decoder's
        self._born = time.perf_counter()
        self.start_s = 0.0  # seconds from construction to ready: its cold start, measured
        self._last_steps, self._last_progress = -1, time.monotonic()  # for the liveness probe

    @property
    def kind(self) -> str:
        return self.models.kind

    @property
    def versions(self) -> list[str]:
        """Versions traffic goes to, prod first (heartbeats, results of unpinned work)."""
        return self.models.serving()

    def _make_runner(self) -> Runner[Any]:
        if self.kind == "decoder":
            return DecoderRunner(self.models, self.outbox, self.executor,
                                 self.config.prefill_per_step, prefill_chunk(self.config))
        return EncoderRunner(self.models, self.outbox, self.executor, self.config.max_batch,
                             self.config.max_wait_ms / 1000)

    async def _wait_unused(self, version: str) -> None:
        if self.runner is not None:
            await self.runner.wait_unused(version)

    async def warmup(self) -> None:
        self.state = "warming"
        self._hb_now.set()
        loop = asyncio.get_running_loop()
        t0 = time.perf_counter()
        n = 0
        for engine in list(self.models.engines.values()):
            n += await loop.run_in_executor(self.executor, engine.warmup, True) or 0
        engine = self.models.prod_engine
        if self.time_warmup and self.kind == "encoder" and engine is not None:
            self.warm_cost = await loop.run_in_executor(
                self.executor, time_encoder, engine, self.config.max_batch)
        elif self.time_warmup and self.kind == "decoder" and engine is not None:
            self.warm_cost = await loop.run_in_executor(
                self.executor, time_decoder, engine, prefill_chunk(self.config))
        log.info("warm", buckets=n, seconds=round(time.perf_counter() - t0, 2),
                 **self._cost_fields())
        # The engine's threads exist now (the executor's, the runtime's intra-op pool).
        lower_threads(self.config.engine_nice)

    def versions_changed(self) -> None:
        """The served versions (or the refusal reason) changed: tell everyone now."""
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
            health=self.health, metadata={"worker_id": self.id, "model": self.model},
            live_file=live_file("tensorbus-worker", self.config))
        async with asyncio.TaskGroup() as tg:
            tg.create_task(self._heartbeats())
            if self.swap is not None:
                t0 = time.perf_counter()
                await self.swap.start()
                log.info("loaded", versions=self.versions, kind=self.kind,
                         seconds=round(time.perf_counter() - t0, 2))
            await self.warmup()
            self.runner = self._make_runner()
            if isinstance(self.warm_cost, GenCost):
                assert self.runner.costs is not None  # a decoder's runner: it fits costs
                self.runner.costs.learn(self.warm_cost)  # until its own steps are timed
            tg.create_task(self.runner.run())
            self._subs = [
                await self.nc.subscribe(
                    subjects.worker_work(self.id), cb=self._on_work,
                    pending_msgs_limit=1_000_000, pending_bytes_limit=1 << 30),
                await self.nc.subscribe(subjects.CANCEL, cb=self._on_cancel),
            ]
            await self.nc.flush()
            self.state = "ready"
            self.start_s = time.perf_counter() - self._born
            self.health.ready = True
            self.health.details = {"instance": self.id, "model": self.model, "versions": self.versions}
            self._hb_now.set()
            log.info("ready", worker_id=self.id, model=self.model, kind=self.kind,
                     versions=self.versions, seconds=round(self.start_s, 2),
                     **self._program_fields())
            shelving = tg.create_task(self.fleet.run()) if self.fleet is not None else None
            follow = tg.create_task(self.swap.run()) if self.swap is not None else None
            if ready is not None:
                ready.set()
            await self._stop.wait()
            if follow is not None:  # no swap while draining
                assert self.swap is not None  # follow runs it
                follow.cancel()
                await self.swap.stop()
            if shelving is not None:
                shelving.cancel()  # _drain publishes the last round itself
            await self._drain()
            self._hb_now.set()

    def stop(self) -> None:
        """Begin draining (idempotent)."""
        self._stop.set()

    def _stop_compiles(self) -> None:
        """Let every engine's background compile end before the process does (see
        DecoderEngine.close), within the drain timeout (a supervisor kills after it);
        one that outlasts it is logged and left."""
        wait_s = self.config.drain_timeout_s
        for engine in list(self.models.engines.values()):
            if not engine.close(wait_s):
                log.warning("compile_still_running", worker_id=self.id, waited_s=wait_s)

    def _progressing(self) -> bool:
        """Live unless work is held and no engine step finished for a while (a step
        waiting on a program being compiled is slow, not stuck)."""
        runner = self.runner
        if runner is None or not runner.in_flight:
            self._last_steps, self._last_progress = -1, time.monotonic()
            return True
        if runner.steps != self._last_steps or runner.compiling:
            self._last_steps, self._last_progress = runner.steps, time.monotonic()
        return time.monotonic() - self._last_progress < self.config.stall_s

    async def _drain(self) -> None:
        # run() set both before it waits for the stop that leads here.
        assert self.health is not None and self.runner is not None
        self.health.ready = False
        self.state = "draining"
        self._hb_now.set()
        log.info("draining", worker_id=self.id)
        # Schedulers that have not seen `draining` yet may still send work; keep the
        # subscription open until every scheduler has either seen it or expired us.
        await asyncio.sleep(self.config.heartbeat_s * 3)
        for sub in self._subs[:1]:  # the work inbox; cancels keep arriving meanwhile
            await sub.drain()
        await self.runner.drain()
        await asyncio.get_running_loop().run_in_executor(None, self._stop_compiles)
        if self.fleet is not None:
            await self.fleet.publish_quietly()  # what it compiled since the last round
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
        assert self.runner is not None  # subscribed once run() built it
        if work.version and not self.models.holds(work.version):
            await self.outbox.refuse(work, ServiceError(
                503, f"version {work.version} of '{work.model}' is not loaded on this worker; "
                "retry shortly", code="version_unavailable", retry_after=1.0))
        elif isinstance(work, self.runner.work_type):
            self.runner.submit(work)
        else:
            await self.outbox.refuse(work, ServiceError(
                400, f"model '{work.model}' does not serve this endpoint"))

    async def _on_cancel(self, msg: Msg) -> None:
        assert self.runner is not None  # subscribed once run() built it
        try:
            self.runner.cancel(cancel_decoder.decode(msg.data).request_id)
        except msgspec.DecodeError:
            pass  # a bad cancel message is ignored

    # -------------------------------------------------------------- heartbeats
    def heartbeat(self) -> Heartbeat:
        if self.runner is not None:
            load = self.runner.gauges()
        else:  # starting or warming: nothing taken yet
            load = Gauges(queue_depth=0, in_flight=0, max_batch=self.config.max_batch,
                          occupancy=0.0, steps=0)
        engine: Any = self.models.prod_engine  # an Encoder or a Decoder; None while starting
        decoder = self.kind == "decoder" and engine is not None
        facts = engine.info if decoder else engine  # an encoder says them itself
        device = facts.device if engine is not None else "cpu"
        used, limit, source = self.memory.read(device)
        stats = engine.stats() if decoder else None
        compiled, total = (stats.compiled, stats.programs) if stats else (0, 0)
        if engine is not None and not decoder:
            compiled, total = engine.program_counts()
        measured, units = (stats.forms_measured, stats.forms_total) if stats else (0, 0)
        quant, forms = (stats.quant, stats.compute_forms) if stats else ("", {})
        # The runner's gauges carry the heartbeat's own names: they go across as they are.
        return Heartbeat(
            worker_id=self.id, model=self.model, kind=self.kind or "encoder", state=self.state,
            versions=list(self.versions), queue_depth=load.queue_depth,
            in_flight=load.in_flight, max_batch=load.max_batch,
            batch_occupancy=load.occupancy, steps=load.steps, rss_bytes=rss_bytes(),
            compiling=self.runner is not None and self.runner.compiling,
            device=device, sent_at=time.time(), last_error=self.models.error,
            dtype=facts.dtype if engine is not None else "float32", mem_used_bytes=used,
            mem_limit_bytes=limit, mem_source=source, kv_blocks_total=load.kv_blocks_total,
            kv_blocks_used=load.kv_blocks_used, prefix_cache_queries=load.prefix_cache_queries,
            prefix_cache_hits=load.prefix_cache_hits, preemptions=load.preemptions,
            spec_decode_drafts=load.spec_decode_drafts,
            spec_decode_draft_tokens=load.spec_decode_draft_tokens,
            spec_decode_accepted_tokens=load.spec_decode_accepted_tokens,
            prefix_block=load.prefix_block, prefix_keys=load.prefix_keys,
            devices=list(facts.devices) if engine is not None else [],
            start_s=self.start_s, programs_compiled=compiled, programs_total=total,
            forms_measured=measured, forms_total=units, quant=quant, compute_forms=forms,
            site=self.config.site, reconnects=self.links.drops, **self._cost_fields())

    def _program_fields(self) -> dict[str, object]:
        """The ready line's programs: compiled of those the engine serves, and (a
        worker that shares the fleet's) how many it compiled, loaded and fetched."""
        out: dict[str, object] = {}
        engine = self.models.prod_engine
        if self.kind == "decoder" and engine is not None:
            stats = engine.stats()
            out["programs"] = f"{stats.compiled}/{stats.programs}"
        elif engine is not None and engine.program_counts()[1]:
            out["programs"] = "{}/{}".format(*engine.program_counts())
        if self.fleet is not None:
            out.update(self.fleet.summary())
        return out

    def _cost_fields(self) -> dict[str, float]:
        """The heartbeat's cost: an encoder's from warm-up; a decoder's as its runner
        has fitted it (from warm-up until its steps are timed)."""
        cost = self.warm_cost
        costs = self.runner.costs if self.runner is not None else None
        if costs is not None:
            cost = costs.cost() or cost
        if isinstance(cost, Cost):
            return {"cost_per_token": cost.per_token, "cost_per_batch": cost.per_batch}
        if isinstance(cost, GenCost):
            return {"prefill_per_token": cost.prefill.per_token,
                    "prefill_per_chunk": cost.prefill.per_batch,
                    "decode_per_step": cost.decode.per_batch,
                    "decode_per_row": cost.decode.per_token,
                    "decode_length": cost.length}
        return {}

    async def _publish_heartbeat(self) -> None:
        await self.nc.publish(subjects.TELEMETRY_WORKERS, encode_record(self.heartbeat()))

    async def _heartbeats(self) -> None:
        while True:
            await self._publish_heartbeat()
            if self.state == "stopped":
                return
            self._hb_now.clear()
            # asyncio.timeout, not wait_for: on 3.11 wait_for can swallow a cancellation
            # that lands as the event is set, and this loop would then never end.
            try:
                async with asyncio.timeout(self.config.heartbeat_s):
                    await self._hb_now.wait()
            except TimeoutError:
                pass
