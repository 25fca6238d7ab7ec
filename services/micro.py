"""Register a tensorbus process as a NATS micro service, with health and readiness.

`nats micro ls|info|stats` find every service registered here. Besides the service's
own endpoints, each instance answers two more:

    tensorbus.v1.svc.<name>.health   liveness: the process can make progress
    tensorbus.v1.svc.<name>.ready    readiness: it should receive work now

Every instance listens on these in its own queue group, so a request with several
replies (`nats req --replies 0 ...`) gathers one answer per instance, as `$SRV.PING.<name>`
does; each answer carries the instance id. A failing check answers with
`Nats-Service-Error-Code: 503` and the same JSON body.

The service owns a `ServiceHealth`; it flips `health.ready` once warmed up and may
register checks (callables returning a bool, or a bool and a details mapping). Given
a `live_file`, the service also writes its liveness there (services/liveness.py), so
a probe can read it without the bus.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import replace
from pathlib import Path
from typing import Any, Awaitable, Callable, Mapping

import msgspec
from nats.aio.client import Client
from nats.errors import Error as NatsError
from nats.aio.msg import Msg
from nats.micro.request import ERROR_CODE_HEADER, ERROR_HEADER, Handler, Request
from nats.micro.service import Endpoint, EndpointConfig, Service, ServiceConfig

from services.liveness import keep_live, write_live
from shared.logging import get_logger

log = get_logger("micro")

CheckResult = bool | tuple[bool, Mapping[str, Any]]
Check = Callable[[], CheckResult]
"""A health check: cheap, synchronous, never blocks (it runs on the event loop)."""

_json = msgspec.json.Encoder(enc_hook=str)


def health_subject(name: str) -> str:
    return f"tensorbus.v1.svc.{name}.health"


def ready_subject(name: str) -> str:
    return f"tensorbus.v1.svc.{name}.ready"


class ServiceHealth:
    """Liveness and readiness of one process, owned and flipped by the service.

    `live` starts True, `ready` False: a service says it is ready once it can serve.
    `details` is free-form state shown in every answer (e.g. loaded versions).
    """

    def __init__(self, *, ready: bool = False) -> None:
        self.live = True
        self.ready = ready
        self.details: dict[str, Any] = {}
        self._live_checks: dict[str, Check] = {}
        self._ready_checks: dict[str, Check] = {}

    def add_check(self, name: str, check: Check, *, liveness: bool = False) -> None:
        """Register a readiness check; `liveness=True` makes it a liveness check too."""
        self._ready_checks[name] = check
        if liveness:
            self._live_checks[name] = check

    def health(self) -> tuple[bool, dict[str, Any]]:
        ok, checks = _run_checks(self._live_checks)
        ok = ok and self.live
        return ok, {"live": self.live, "checks": checks, "details": dict(self.details)}

    def readiness(self) -> tuple[bool, dict[str, Any]]:
        ok, checks = _run_checks(self._ready_checks)
        ok = ok and self.live and self.ready
        return ok, {
            "live": self.live,
            "ready": self.ready,
            "checks": checks,
            "details": dict(self.details),
        }


def _run_checks(checks: Mapping[str, Check]) -> tuple[bool, dict[str, Any]]:
    out: dict[str, Any] = {}
    all_ok = True
    for name, check in checks.items():
        try:
            result = check()
        except Exception as exc:  # noqa: BLE001 - a broken check is a failed check
            result = (False, {"error": f"{type(exc).__name__}: {exc}"})
        ok, details = result if isinstance(result, tuple) else (bool(result), {})
        out[name] = {"ok": bool(ok), **details}
        all_ok = all_ok and bool(ok)
    return all_ok, out


ConcurrentHandler = Callable[[Msg], Awaitable[bool]]
"""Serves one message to the end (replies included); returns False when it answered
with an error."""


class ConcurrentEndpoint(Endpoint):
    """A nats.micro endpoint that serves each message in its own task.

    nats.micro awaits its handler inside the subscription callback, so one slow
    request would hold up every later one, and it times only that callback. Here the
    callback starts a task and returns; the task's end updates the endpoint's stats
    (`nats micro stats`): requests on arrival, errors for error replies (as Go's
    micro counts `req.Error`), processing time from arrival to the last reply. The
    subscription takes explicit pending limits, so a burst queues in this process.
    """

    def __init__(self, service: Service, config: EndpointConfig, handler: ConcurrentHandler,
                 tasks: set[asyncio.Task], pending_msgs: int, pending_bytes: int) -> None:
        super().__init__(service, config)
        self._serve = handler
        self._tasks = tasks
        self._pending = (pending_msgs, pending_bytes)

    async def _start(self) -> None:
        self._subscription = await self._service._client.subscribe(
            subject=self._subject, queue=self._queue_group, cb=self._handle_request,
            pending_msgs_limit=self._pending[0], pending_bytes_limit=self._pending[1])

    async def _handle_request(self, msg: Msg) -> None:
        self._num_requests += 1
        task = asyncio.create_task(self._timed(msg, time.perf_counter_ns()))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _timed(self, msg: Msg, start_ns: int) -> None:
        ok = False
        try:
            ok = await self._serve(msg)
        finally:
            if not ok:
                self._num_errors += 1
            self._processing_time += time.perf_counter_ns() - start_ns
            self._average_processing_time = int(self._processing_time / self._num_requests)


class MicroService(Service):
    """A nats.micro Service with a `health` object and an idempotent, safe `stop()`."""

    def __init__(self, nc: Client, config: ServiceConfig, health: ServiceHealth) -> None:
        super().__init__(nc, config)
        self.health = health
        self._stop_lock = asyncio.Lock()
        self._live_task: asyncio.Task | None = None

    def keep_live_file(self, path: Path) -> None:
        """Write `health.health()` to `path` now, then every few seconds until `stop()`.
        A write that fails (a full or missing /tmp) leaves the file stale, for the probe
        to report; it never stops the service from starting."""
        try:
            write_live(path, self.health.health)
        except OSError as exc:
            log.warning("liveness_file_unwritable", path=str(path), error=str(exc))
        self._live_task = asyncio.create_task(keep_live(path, self.health.health))

    @property
    def name(self) -> str:
        return self._name

    @property
    def version(self) -> str:
        return self._version

    async def add_concurrent_endpoint(
            self, name: str, subject: str, handler: ConcurrentHandler, *, queue_group: str,
            tasks: set[asyncio.Task], pending_msgs: int = 65_536,
            pending_bytes: int = 64 * 1024 * 1024) -> None:
        """An endpoint whose messages are served concurrently (see ConcurrentEndpoint);
        `tasks` holds the running ones so the owner can wait for them at shutdown."""
        config = EndpointConfig(name=name, subject=subject, queue_group=queue_group,
                                handler=_never_called)
        endpoint = ConcurrentEndpoint(self, config, handler, tasks, pending_msgs, pending_bytes)
        await endpoint._start()
        self._endpoints.append(endpoint)

    async def stop(self) -> None:
        """Unsubscribe everything; safe to call twice, concurrently, or after the
        connection closed or began draining (drain already removes the interest)."""
        async with self._stop_lock:
            if self.stopped.is_set():
                return
            if self._live_task is not None:
                self._live_task.cancel()
            if not (self._client.is_closed or self._client.is_draining):
                try:
                    await super().stop()
                except NatsError as exc:
                    log.warning("micro_stop_failed", service=self._name, error=str(exc))
            self._endpoints = []
            self._subscriptions = {}
            self._stopped.set()

    async def _answer(self, request: Request, probe: Callable[[], tuple[bool, dict]]) -> None:
        ok, body = probe()
        body = {"name": self._name, "id": self._id, "version": self._version,
                "status": "ok" if ok else "unavailable", **body}
        data = _json.encode(body)
        if ok:
            await request.respond(data)
        else:
            await request.respond(data, headers={ERROR_CODE_HEADER: "503",
                                                 ERROR_HEADER: f"{self._name} is not ok"})


async def _never_called(request: Request) -> None:  # ConcurrentEndpoint serves instead
    raise RuntimeError("unreachable")


async def add_service(
    nc: Client,
    name: str,
    version: str,
    description: str,
    endpoints: Mapping[str, Handler | EndpointConfig] | None = None,
    queue_group: str | None = None,
    *,
    health: ServiceHealth | None = None,
    metadata: Mapping[str, str] | None = None,
    live_file: Path | None = None,
) -> MicroService:
    """Register and start a micro service with `health` and `ready` endpoints.

    `endpoints` maps endpoint name to a handler (subject = the name) or to an
    `EndpointConfig` for an explicit subject, queue group or metadata. `queue_group`
    is the default queue group of those endpoints (nats.micro's "q" when None).
    `live_file`: where to keep this process's liveness for `--check health`.
    """
    config = ServiceConfig(name=name, version=version, description=description,
                           metadata=dict(metadata or {}), queue_group=queue_group)
    service = MicroService(nc, config, health or ServiceHealth())
    await service.start()
    try:
        for ep_name, spec in (endpoints or {}).items():
            if isinstance(spec, EndpointConfig):
                await service.add_endpoint(replace(spec, name=ep_name))
            else:
                await service.add_endpoint(name=ep_name, handler=spec)
        await _add_probes(service)
        await nc.flush()
        if live_file is not None:
            service.keep_live_file(live_file)
    except BaseException:
        await service.stop()
        raise
    return service


async def _add_probes(service: MicroService) -> None:
    async def on_health(request: Request) -> None:
        await service._answer(request, service.health.health)

    async def on_ready(request: Request) -> None:
        await service._answer(request, service.health.readiness)

    # A queue group of its own per instance: every instance answers, like PING.
    for ep_name, subject, handler in (("health", health_subject(service.name), on_health),
                                      ("ready", ready_subject(service.name), on_ready)):
        await service.add_endpoint(name=ep_name, subject=subject, handler=handler,
                                   queue_group=service.id)
