"""The OpenAI-compatible HTTP API, in the gateway process, over the same Frontend.

Routes are an explicit list (Starlette). Bodies are read with a hard size limit,
API keys are checked when configured, streaming uses Server-Sent Events ending with
`data: [DONE]`, and a client that disconnects mid-stream cancels its request.
"""

from __future__ import annotations

import asyncio
import hmac
import socket
import time

import msgspec
import structlog
from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from starlette.applications import Starlette
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from services.gateway import codec
from services.gateway.codec import VERSION_HEADER
from services.gateway.frontend import USER_HEADER, Frontend, Outcome, new_request_id, wire_id
from services.gateway.openapi import openapi_document
from shared.errors import ServiceError, internal, too_large
from shared.logging import get_logger

log = get_logger("gateway.http")
_json = msgspec.json.Encoder()
DISCONNECT_POLL_S = 0.25  # how often a stream waiting for its first chunk checks its client


class HttpMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        self.requests = Counter("tensorbus_gateway_http_requests_total",
                                "HTTP requests by route and status", ["route", "status"],
                                registry=registry)
        self.in_flight = Gauge("tensorbus_gateway_http_in_flight_requests",
                               "HTTP requests being served", registry=registry)


def error_response(err: ServiceError) -> Response:
    headers = {}
    if err.retry_after is not None:
        headers["Retry-After"] = f"{max(1, round(err.retry_after))}"
    if err.status == 401:
        headers["WWW-Authenticate"] = "Bearer"
    return Response(_json.encode(err.to_body()), status_code=err.status,
                    media_type="application/json", headers=headers)


def build_app(front: Frontend, generation, ready) -> Starlette:
    config = front.config
    keys = config.api_key_set
    registry = CollectorRegistry()
    metrics = HttpMetrics(registry)
    spec = openapi_document()

    def authorised(request: Request) -> bool:
        if not keys:
            return True
        auth = request.headers.get("authorization", "")
        scheme, _, token = auth.partition(" ")
        return scheme.lower() == "bearer" and any(
            hmac.compare_digest(token.strip().encode(), k.encode()) for k in keys)

    def check_headers(request: Request) -> None:
        # uvicorn's h11 limit only bounds a header block that arrives in pieces.
        size = sum(len(k) + len(v) + 4 for k, v in request.scope["headers"])
        if size > config.max_header_bytes:
            raise ServiceError(431, f"the request headers take {size} bytes; the limit is "
                               f"{config.max_header_bytes}", code="headers_too_large")

    async def read_body(request: Request) -> bytes:
        declared = request.headers.get("content-length")
        if declared and declared.isdigit() and int(declared) > config.max_payload:
            raise too_large(f"the request body is {declared} bytes; the limit is {config.max_payload}")
        chunks, size = [], 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > config.max_payload:
                raise too_large(f"the request body exceeds the limit of {config.max_payload} bytes")
            chunks.append(chunk)
        return b"".join(chunks)

    async def serve(request: Request, endpoint: str) -> Response:
        started = time.perf_counter()
        client_id = request.headers.get("x-request-id")
        rid = client_id[:64] if client_id else new_request_id()  # logs, telemetry, echo
        wire = wire_id(rid) if client_id else rid  # unique, one subject token
        out = Outcome(endpoint)
        metrics.in_flight.inc()
        streaming = False
        with structlog.contextvars.bound_contextvars(request_id=rid):
            try:
                check_headers(request)
                if not authorised(request):
                    raise ServiceError(401, "a valid API key is required (Authorization: Bearer KEY)",
                                       code="invalid_api_key")
                body = await read_body(request)
                deadline = front.deadline(_timeout(request))
                if endpoint == "embeddings":
                    resp = await front.embeddings(body, False, wire, deadline, out,
                                                  request.headers.get(USER_HEADER, ""))
                    return Response(_json.encode(resp), media_type="application/json",
                                    headers=_headers(rid, out))
                prep = await generation.prepare(body, endpoint, False, wire, deadline, out,
                                                request.headers.get(USER_HEADER, ""))
                if not prep.work.stream:
                    resp = await generation.complete(prep, deadline, out)
                    return Response(_json.encode(resp), media_type="application/json",
                                    headers=_headers(rid, out))
                # The response starts when the first chunk arrives: its headers name the
                # version, and an error before it is an HTTP status, not an SSE event.
                chunks = generation.chunks(prep, deadline, out)
                first = await _first_chunk(request, chunks)
                streaming = True
                return StreamingResponse(
                    _sse(front, chunks, first, prep, out, started, metrics, endpoint, rid),
                    media_type="text/event-stream",
                    headers={"Cache-Control": "no-cache", **_headers(rid, out)})
            except ServiceError as err:
                out.status, out.error_code = err.status, err.code
                return error_response(err)
            except ClientDisconnect:
                out.status, out.error_code = 499, "client_closed"
                await front.cancel(wire, "client disconnected")  # frees a held or queued one
                return Response(status_code=499)
            except Exception:  # noqa: BLE001 - a bug still answers the client
                log.exception("http_request_crashed")
                out.status, out.error_code = 500, "internal_error"
                return error_response(internal())
            finally:
                if not streaming:
                    metrics.in_flight.dec()
                    metrics.requests.labels(endpoint, str(out.status)).inc()
                    await front.record(rid, out, started)

    async def embeddings(request: Request) -> Response:
        return await serve(request, "embeddings")

    async def completions(request: Request) -> Response:
        return await serve(request, "completions")

    async def chat(request: Request) -> Response:
        return await serve(request, "chat.completions")

    async def models(request: Request) -> Response:
        if not authorised(request):
            return error_response(ServiceError(401, "a valid API key is required", code="invalid_api_key"))
        front.fleet.expire()
        return Response(_json.encode(front.model_list()), media_type="application/json")

    async def healthz(request: Request) -> Response:
        return JSONResponse({"status": "ok"})

    async def readyz(request: Request) -> Response:
        # The gateway's own readiness: serving and connected to the bus. Not the
        # workers': at zero workers requests are held, so the front door stays open.
        ok = ready() and front.nc.is_connected
        return JSONResponse({"ready": ok}, status_code=200 if ok else 503)

    async def prometheus(request: Request) -> Response:
        return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)

    async def openapi(request: Request) -> Response:
        return JSONResponse(spec)

    routes = [
        Route("/v1/embeddings", embeddings, methods=["POST"]),
        Route("/v1/completions", completions, methods=["POST"]),
        Route("/v1/chat/completions", chat, methods=["POST"]),
        Route("/v1/models", models, methods=["GET"]),
        Route("/healthz", healthz, methods=["GET"]),
        Route("/readyz", readyz, methods=["GET"]),
        Route("/metrics", prometheus, methods=["GET"]),
        Route("/openapi.json", openapi, methods=["GET"]),
    ]
    async def not_found(request, exc):
        return error_response(ServiceError(404, "no such route", code="not_found"))

    async def bad_method(request, exc):
        return error_response(ServiceError(405, f"{request.method} is not allowed here",
                                           code="method_not_allowed"))

    return Starlette(routes=routes, exception_handlers={404: not_found, 405: bad_method})


async def _first_chunk(request: Request, chunks):
    """The stream's first chunk (None when it has none). Until it arrives no response
    has started, so nothing else notices a client that leaves meanwhile (a request
    held through a cold start, or queued): look every DISCONNECT_POLL_S."""
    task = asyncio.ensure_future(anext(chunks, None))
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=DISCONNECT_POLL_S)
            if done:
                return task.result()
            if await request.is_disconnected():
                raise ClientDisconnect()
    finally:
        if not task.done():
            task.cancel()  # closes the stream: its inbox and its waiting count
            await asyncio.gather(task, return_exceptions=True)


def _headers(rid: str, out: Outcome) -> dict[str, str]:
    headers = {"X-Request-Id": rid}
    if out.version:
        headers[VERSION_HEADER] = out.version
    return headers


async def _sse(front, chunks, first, prep, out, started, metrics, endpoint, rid: str):
    wire = prep.work.request_id
    finished = False
    try:
        if first is not None:
            yield b"data: " + _json.encode(first) + b"\n\n"
            async for chunk in chunks:
                yield b"data: " + _json.encode(chunk) + b"\n\n"
        finished = True
    except ServiceError as err:
        out.status, out.error_code = err.status, err.code
        yield b"data: " + _json.encode(err.to_body()) + b"\n\n"
        finished = True
    except (asyncio.CancelledError, GeneratorExit):
        out.status, out.error_code = 499, "client_closed"
        raise
    finally:
        if not finished and out.status == 200:
            out.status, out.error_code = 499, "client_closed"
        if out.status == 499:
            await front.cancel(wire, "client disconnected")
        metrics.in_flight.dec()
        metrics.requests.labels(endpoint, str(out.status)).inc()
        await front.record(rid, out, started)
    yield b"data: [DONE]\n\n"


def _timeout(request: Request) -> float | None:
    raw = request.headers.get("tensorbus-timeout")
    try:
        v = float(raw) if raw else None
    except ValueError:
        return None
    return v if v and v > 0 and v == v else None


async def serve_http(app: Starlette, host: str, port: int, max_header_bytes: int,
                     started: asyncio.Event | None = None, bound: list | None = None):
    """Run uvicorn inside this event loop until cancelled."""
    import uvicorn

    cfg = uvicorn.Config(app, host=host, port=port, log_level="warning", access_log=False,
                         h11_max_incomplete_event_size=max_header_bytes, lifespan="off",
                         timeout_graceful_shutdown=5)
    server = uvicorn.Server(cfg)
    server.install_signal_handlers = lambda: None  # the process owns signals
    task = asyncio.create_task(server.serve(sockets=[listen_socket(host, port)]))
    while not server.started:
        if task.done():
            await task
            raise RuntimeError("HTTP server failed to start")
        await asyncio.sleep(0.01)
    if bound is not None:
        bound.extend(s.getsockname()[1] for srv in server.servers for s in srv.sockets)
    if started is not None:
        started.set()
    return server, task


def listen_socket(host: str, port: int) -> socket.socket:
    """The HTTP listening socket, with SO_REUSEPORT: several gateway processes
    (`honcho start -c gateway=2`) bind the same port and the kernel spreads the
    connections over them."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    # IPPROTO_TCP explicitly: asyncio sets TCP_NODELAY only on sockets that say so,
    # and without it Nagle's algorithm costs each HTTP reply ~40 ms.
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    sock.bind((host, port))
    sock.set_inheritable(True)
    return sock
