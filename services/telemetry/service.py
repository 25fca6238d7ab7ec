"""The telemetry actor: fleet metrics, sketches, summaries, and the replay stream.

Dataflow:

1. `run()` serves Prometheus `/metrics` (127.0.0.1 by default), makes sure the
   JetStream stream `TELEMETRY` exists with its limits, and subscribes the
   `telemetry.v1.requests|workers|scale` subjects with core NATS.
2. Each message is decoded once (`record_decoder`) and matched on its type:
   RequestRecord -> counters, histograms and the summary window; Heartbeat ->
   per-worker and per-model gauges; ScaleDecision -> desired replicas (combined over
   live schedulers) and held requests.
3. Every `summary_interval_s` a `Summary` (per model: requests, errors, throughput,
   latency and TTFT quantiles, tokens/s, cost per 1M tokens, input and output apart)
   goes out on `telemetry.v1.summary` and sets the cost gauges; workers silent past `worker_expiry_s` lose their series.
4. With the model registry, request records also feed the canary guardian
   (services/telemetry/canary.py), which rolls back a guarded canary that does worse
   than prod past its margins.
5. `stop()` (idempotent) ends the loops, unregisters, unsubscribes, stops HTTP.

Telemetry must never slow inference. Publishers use plain core NATS publish and never
wait on this service; its subscriptions have large pending limits, so a burst queues
here and, past the limits, is dropped here (counted in
`tensorbus_telemetry_dropped_messages_total`), never pushed back to the publisher.
"""

from __future__ import annotations

import asyncio
import time
from typing import TYPE_CHECKING, Callable

import msgspec
from nats.aio.client import Client
from nats.aio.subscription import Subscription
from nats.errors import Error as NatsError
from nats.js.api import StreamConfig
from prometheus_client import CollectorRegistry, start_http_server

from services.micro import MicroService, ServiceHealth, add_service
from shared import subjects
from shared.config import Config, bad_config
from shared.jetstream import check_replicas, replicas
from shared.logging import get_logger
from shared.telemetry import Heartbeat, RequestRecord, ScaleDecision, encode, record_decoder

from services.registry.errors import RegistryError
from services.registry.store import Registry

from . import VERSION
from .canary import CHECK_S, CanaryGuardian
from .metrics import TelemetryMetrics
from .stream import ensure_stream, stream_config
from .summary import SummaryWindow

if TYPE_CHECKING:
    import threading
    from wsgiref.simple_server import WSGIServer

    from shared.telemetry import Summary

log = get_logger("telemetry")

SERVICE_NAME = "tensorbus-telemetry"
PENDING_MSGS = 1_000_000
PENDING_BYTES = 512 * 1024 * 1024
YIELD_EVERY = 256  # records handled between yields to the event loop during a burst


class TelemetryService:
    def __init__(
        self,
        nc: Client,
        config: Config,
        *,
        registry: CollectorRegistry | None = None,
        metrics_host: str = "127.0.0.1",
        window_slots: int = 12,
        alpha: float = 0.01,
        stream: StreamConfig | None = None,
        clock: Callable[[], float] = time.monotonic,
        model_registry: Registry | None = None,
    ) -> None:
        self.nc = nc
        self.config = config
        try:
            config.worker_price("")  # a malformed price list stops the service at start
        except ValueError as exc:
            raise bad_config(str(exc)) from None
        self.registry = registry if registry is not None else CollectorRegistry()
        self.metrics = TelemetryMetrics(self.registry, expiry_s=config.worker_expiry_s)
        self.window = SummaryWindow(config.summary_interval_s, window_slots, alpha, clock)
        self.health = ServiceHealth()
        self.started = asyncio.Event()  # set once subscribed, serving and registered
        self.last_summary: Summary | None = None
        self._metrics_host = metrics_host
        self._stream_config = stream or stream_config()
        self._stream_ok = False
        self._clock = clock
        self._stopping = asyncio.Event()
        self._done = asyncio.Event()
        self._running = False
        self._subs: list[Subscription] = []
        self._processed: dict[str, int] = {}  # per subject, to count drops
        self._dropped: dict[str, int] = {}
        self._micro: MicroService | None = None
        self.guardian = CanaryGuardian(model_registry, clock=clock) if model_registry else None
        self._httpd: WSGIServer | None = None
        self._http_thread: threading.Thread | None = None

    @property
    def metrics_port(self) -> int:
        """The port `/metrics` is bound to (the real one when configured as 0)."""
        if self._httpd is None:
            raise RuntimeError("metrics server not started")
        return self._httpd.server_port

    # --- lifecycle

    async def run(self) -> None:
        if self._running or self._stopping.is_set():
            return
        self._running = True
        try:
            await self._start()
            self.started.set()
            log.info("telemetry_started", metrics_port=self.metrics_port,
                     stream=self._stream_ok, window_s=self.window.window_s)
            async with asyncio.TaskGroup() as tg:
                loops = [tg.create_task(self._summary_loop()),
                         tg.create_task(self._expiry_loop())]
                if self.guardian is not None:
                    loops.append(tg.create_task(self._canary_loop()))
                await self._stopping.wait()
                for task in loops:
                    task.cancel()
        finally:
            await self._shutdown()
            self._done.set()

    async def stop(self) -> None:
        self._stopping.set()
        if self._running:
            await self._done.wait()

    async def _start(self) -> None:
        self._httpd, self._http_thread = start_http_server(
            self.config.metrics_port, self._metrics_host, registry=self.registry)
        await self._ensure_stream()
        for subject in (subjects.TELEMETRY_REQUESTS, subjects.TELEMETRY_WORKERS,
                        subjects.TELEMETRY_SCALE):
            self._subs.append(await self.nc.subscribe(
                subject, cb=self._handler(subject),
                pending_msgs_limit=PENDING_MSGS, pending_bytes_limit=PENDING_BYTES))
        self.health.add_check("nats", lambda: self.nc.is_connected)
        self.health.details["metrics_port"] = self.metrics_port
        self._micro = await add_service(
            self.nc, SERVICE_NAME, VERSION, "fleet metrics, summaries and the telemetry stream",
            health=self.health, metadata={"metrics_port": str(self.metrics_port)})
        self.health.ready = True

    async def _shutdown(self) -> None:
        self.health.ready = False
        if self.guardian is not None:
            await self.guardian.stop()
        if self._micro is not None:
            await self._micro.stop()
        for sub in self._subs:
            try:
                await sub.unsubscribe()
            except NatsError:
                pass  # the connection already closed or is draining: interest is gone
        self._subs = []
        if self._httpd is not None:
            await asyncio.to_thread(self._httpd.shutdown)
            self._httpd.server_close()
        log.info("telemetry_stopped")

    async def _ensure_stream(self) -> None:
        try:
            await ensure_stream(self.nc.jetstream(), self._stream_config,
                                replicas(self.nc, self.config.js_replicas))
            self._stream_ok = True
            await check_replicas(self.nc, (str(self._stream_config.name),), self.config.js_replicas)
        except (NatsError, asyncio.TimeoutError) as exc:
            # Metrics and summaries still work; replay waits for JetStream.
            log.warning("stream_unavailable", stream=self._stream_config.name, error=str(exc))
        self.health.details["stream"] = self._stream_ok

    # --- records

    def _handler(self, subject: str):
        self._processed[subject] = 0

        async def on_msg(msg) -> None:
            self.handle(msg.data)
            n = self._processed[subject] = self._processed[subject] + 1
            if n % YIELD_EVERY == 0:
                await asyncio.sleep(0)  # let the reader and other tasks run mid-burst

        return on_msg

    def handle(self, data: bytes) -> None:
        """Apply one encoded telemetry record to the metrics and the summary window."""
        try:
            rec = record_decoder.decode(data)
            now = self._clock()
            match rec:
                case RequestRecord():
                    self.metrics.observe_request(rec)
                    self.window.add(rec, now)
                    if self.guardian is not None:
                        self.guardian.observe(rec, now)
                case Heartbeat():
                    self.metrics.observe_heartbeat(rec, now)
                case ScaleDecision():
                    self.metrics.observe_scale(rec, now)
                case _:
                    self.metrics.bad_records.inc()
        except (msgspec.DecodeError, ValueError) as exc:
            self.metrics.bad_records.inc()
            log.debug("bad_record", error=str(exc))

    # --- periodic work

    async def _summary_loop(self) -> None:
        interval = self.config.summary_interval_s
        due = self._clock() + interval
        while True:
            await asyncio.sleep(max(due - self._clock(), 0.0))
            due = max(due + interval, self._clock())  # after a stall, skip, don't burst
            await self.publish_summary()
            self._account_subscriptions()
            if not self._stream_ok:
                await self._ensure_stream()

    async def publish_summary(self) -> None:
        rates: dict[str, float] = {}  # model -> price of its live workers per hour
        for model, device in self.metrics.worker_devices():
            rates[model] = rates.get(model, 0.0) + self.config.worker_price(model, device)
        summary = self.window.summary(at=time.time(), cost_per_hour=rates, now=self._clock())
        self.metrics.set_costs({ms.model: (ms.cost_per_1m_input_tokens,
                                           ms.cost_per_1m_output_tokens)
                                for ms in summary.models})
        self.last_summary = summary
        try:
            await self.nc.publish(subjects.TELEMETRY_SUMMARY, encode(summary))
        except NatsError as exc:
            log.warning("summary_publish_failed", error=str(exc))

    def _account_subscriptions(self) -> None:
        for sub in self._subs:
            pending = sub.pending_msgs
            self.metrics.pending.labels(sub.subject).set(pending)
            dropped = sub.delivered - self._processed[sub.subject] - pending
            if dropped > self._dropped.get(sub.subject, 0):
                log.warning("telemetry_dropped", subject=sub.subject, total=dropped)
                self.metrics.dropped.labels(sub.subject).inc(
                    dropped - self._dropped.get(sub.subject, 0))
                self._dropped[sub.subject] = dropped

    async def _canary_loop(self) -> None:
        assert self.guardian is not None  # run() starts this loop only with a guardian
        while True:
            await asyncio.sleep(CHECK_S)
            try:
                await self.guardian.check(self._clock())
            except (NatsError, asyncio.TimeoutError, RegistryError) as exc:
                log.warning("canary_check_failed", error=str(exc))  # tried again next time

    async def _expiry_loop(self) -> None:
        period = max(min(self.config.worker_expiry_s / 4, 0.5), 0.01)
        while True:
            await asyncio.sleep(period)
            for worker in self.metrics.expire_workers(self._clock()):
                log.info("worker_expired", worker=worker)
            self.metrics.expire_decisions(self._clock())
