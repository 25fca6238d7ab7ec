"""The gateway's NATS surface: `inference.v1.*` request/reply (queue group `gateway`);
the Files and Batch API's subjects are services/gateway/batch_bus.py's.

  1. Each route's subject is a nats.micro endpoint (services.gateway.pipeline.routes);
     each request runs in its own task (a subscription callback must not wait on a
     model).
  2. A Call (services.gateway.call) wraps it: ids from `X-Request-Id` / `Nats-Msg-Id`,
     deadline from `Tensorbus-Timeout`, msgpack from `Content-Type`.
  3. The route's pipeline prepares it, then answers whole (one reply) or streamed
     (one message per OpenAI chunk, then `[DONE]`), each naming the model version.
  4. A failure becomes the error contract: `Nats-Service-Error-Code` /
     `Nats-Service-Error` headers plus the body (mid-stream: an error message, then
     `[DONE]`).
"""

from __future__ import annotations

import asyncio
import time
from functools import partial
from typing import Any

import msgspec
from nats.aio.client import Client
from nats.aio.msg import Msg

from services.gateway import codec
from services.gateway.codec import VERSION_HEADER  # noqa: F401 - where tests and clients look
from services.gateway.batch_bus import BatchBus
from services.gateway.batch_ops import BatchOps
from services.gateway.call import Call
from services.gateway.frontend import USER_HEADER, Frontend
from services.gateway.pipeline import Pipeline, Prepared, routes
from services.micro import ConcurrentHandler, ServiceHealth, add_service
from shared import VERSION, priority, subjects
from shared.config import Config
from shared.api_replies import STREAM_DONE
from shared.errors import ServiceError, bad_request, too_large
from shared.logging import get_logger
from shared.messages import fleet_status_decoder, sched_load_decoder
from shared.telemetry import ScaleDecision, heartbeat_decoder, record_decoder

log = get_logger("gateway")

REQUEST_ID_HEADERS = ("X-Request-Id", "Nats-Msg-Id")
TIMEOUT_HEADER = "Tensorbus-Timeout"


class Gateway:
    def __init__(self, nc: Client, config: Config, frontend: Frontend | None = None,
                 http: bool = True) -> None:
        self.nc = nc
        self.config = config
        self.front = frontend or Frontend(nc, config)
        self.routes = routes(self.front)
        self._tasks: set[asyncio.Task] = set()
        self._subs: list = []
        self._stop = asyncio.Event()
        self.http = http and config.http_port >= 0
        self.http_port: int | None = None  # the bound port, once serving
        self._ready = False

    async def run(self, ready: asyncio.Event | None = None) -> None:
        await self.front.start()
        self._subs.append(await self.nc.subscribe(
            subjects.TELEMETRY_WORKERS, cb=self._on_heartbeat, pending_msgs_limit=100_000))
        self._subs.append(await self.nc.subscribe(subjects.TELEMETRY_SCALE, cb=self._on_scale))
        # On the control connection: in a burst a report read behind the main
        # connection's backlog of requests would come after the refusals it decides.
        self._subs.append(await self.front.admission.control.subscribe(
            subjects.SCHED_LOAD, cb=self._on_sched_load))
        self._subs.append(await self.nc.subscribe(subjects.ORCHESTRATOR_STATUS,
                                                  cb=self._on_fleet_status))
        self.micro = await add_service(
            self.nc, "tensorbus-gateway", VERSION, "OpenAI-shaped inference API over NATS",
            health=ServiceHealth(ready=True))
        # The inference subjects are the micro service's endpoints (queue group
        # `gateway`), so `nats micro stats tensorbus-gateway` counts every request,
        # its errors and its time; each request is still served in its own task.
        batch_bus = BatchBus(self.nc, BatchOps(self.nc, self.config))
        endpoints: tuple[tuple[str, str, ConcurrentHandler], ...] = (
            *((r.endpoint, r.subject, partial(self._serve, r.pipeline)) for r in self.routes),
            ("models", subjects.MODELS, self._on_models),
            *batch_bus.endpoints())
        for name, subject, handler in endpoints:
            await self.micro.add_concurrent_endpoint(
                name, subject, handler, queue_group=subjects.QUEUE_GATEWAY, tasks=self._tasks,
                pending_msgs=1_000_000, pending_bytes=1 << 30)
        await self.nc.flush()
        # Abandoned multipart uploads (services/gateway/uploads.py): at start, then now and then.
        sweeper = asyncio.create_task(batch_bus.uploads.sweep_forever())
        server = None
        if self.http:
            from services.gateway.http import build_app, serve_http

            app = build_app(self.front, self.routes, lambda: self._ready)
            bound: list[int] = []
            server, http_task = await serve_http(app, self.config.http_host, self.config.http_port,
                                                 self.config.max_header_bytes, bound=bound)
            self.http_port = bound[0] if bound else None
        self._ready = True
        log.info("gateway_started", http_port=self.http_port)
        if ready is not None:
            ready.set()
        await self._stop.wait()
        self._ready = False
        sweeper.cancel()
        await self.micro.stop()
        if server is not None:
            server.should_exit = True
            await http_task
        for s in self._subs:
            await s.unsubscribe()
        if self._tasks:
            await asyncio.wait(self._tasks, timeout=self.config.request_timeout_s)
        await self.front.stop()

    def stop(self) -> None:
        self._stop.set()

    async def _on_heartbeat(self, msg: Msg) -> None:
        try:
            self.front.fleet.observe(heartbeat_decoder.decode(msg.data))
        except msgspec.DecodeError:
            return
        self.front.fleet.expire()

    async def _on_scale(self, msg: Msg) -> None:
        try:
            rec = record_decoder.decode(msg.data)
        except msgspec.DecodeError:
            return
        if isinstance(rec, ScaleDecision):
            self.front.decisions.observe(rec, time.monotonic())

    async def _on_sched_load(self, msg: Msg) -> None:
        try:
            load = sched_load_decoder.decode(msg.data)
        except msgspec.DecodeError:
            return
        self.front.admission.observe_load(load)
        self.front.schedulers.observe(load)

    async def _on_fleet_status(self, msg: Msg) -> None:
        try:
            status = fleet_status_decoder.decode(msg.data)
        except msgspec.DecodeError:
            return
        self.front.observe_status(status)

    async def _on_models(self, msg: Msg) -> bool:
        self.front.fleet.expire()
        mp = codec.is_msgpack(msg.headers)
        await self._respond(msg, codec.encode(self.front.model_list(), mp), mp)
        return True

    async def _serve(self, pipe: Pipeline[Any], msg: Msg) -> bool:
        """Serve one request to the end; False when it was answered with an error."""
        hdrs = msg.headers or {}
        client_id = next((hdrs[h] for h in REQUEST_ID_HEADERS if hdrs.get(h)), None)
        mp = codec.is_msgpack(hdrs)
        call = Call.open(self.front, pipe.name, client_id=client_id, timeout_s=_timeout(hdrs),
                         msgpack=mp, user=hdrs.get(USER_HEADER, ""))
        call.over_bus = True
        async with call.guarded():
            call.priority = priority.parse(hdrs.get(priority.HEADER))
            prep = await pipe.prepare(msg.data, call)
            if prep.stream:
                await self._stream(msg, pipe, prep, call)
            else:
                body = codec.encode(await pipe.whole(prep, call), mp)
                if len(body) > self.nc.max_payload > 0:  # estimated ahead; this is the backstop
                    raise too_large(f"the answer takes {len(body)} bytes and one bus message "
                                    f"carries at most {self.nc.max_payload}: ask for less")
                await self._respond(msg, body, mp, call.out.version, call.ignored)
        if call.error is not None:
            await self._respond_error(msg, call.error, mp, call.out.version)
        return call.out.status < 400

    async def _stream(self, msg: Msg, pipe: Pipeline[Any], prep: Prepared, call: Call) -> None:
        """One message per chunk to the reply subject, then `[DONE]`; an error after
        the request was accepted is one error message before `[DONE]`."""
        if not msg.reply:
            raise bad_request("a streaming request needs a reply subject")
        mp, out, publish = call.msgpack, call.out, self.nc.publish
        try:
            async for ready in pipe.chunks(prep, call):
                headers = codec.reply_headers(mp, out.version, call.ignored)
                for chunk in ready:
                    await publish(msg.reply, codec.encode(chunk, mp), headers=headers)
        except ServiceError as err:
            call.fail(err)
            body, eh = codec.error_reply(err, mp, out.version)
            await publish(msg.reply, body, headers=eh)
        await publish(msg.reply, STREAM_DONE, headers=codec.reply_headers(False, out.version))

    async def _respond(self, msg: Msg, body: bytes, mp: bool, version: str = "",
                       ignored: list[str] | None = None) -> None:
        if not msg.reply:
            return
        await self.nc.publish(msg.reply, body, headers=codec.reply_headers(mp, version, ignored))

    async def _respond_error(self, msg: Msg, err: ServiceError, mp: bool, version: str = "") -> None:
        if not msg.reply:
            return
        body, headers = codec.error_reply(err, mp, version)
        await self.nc.publish(msg.reply, body, headers=headers)


def _timeout(headers: dict[str, str]) -> float | None:
    raw = headers.get(TIMEOUT_HEADER)
    if not raw:
        return None
    try:
        value = float(raw)
    except ValueError:
        return None
    return value if value > 0 and value == value else None
