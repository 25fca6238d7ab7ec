"""The OpenAI-compatible HTTP API, in the gateway process, over the same Frontend.

Routes are an explicit list (Starlette). Bodies are read with a hard size limit,
API keys are checked when configured, streaming uses Server-Sent Events ending with
`data: [DONE]`, and a client that disconnects cancels its request: mid-stream, and
before a response starts (held for a cold start, queued, or generating a whole
answer), when the server's `http.disconnect` message says it left.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import socket
from functools import partial
from typing import Any, cast

import msgspec
from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from starlette.applications import Starlette
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from services.gateway import batches
from services.gateway.body_budget import BodyBudget, Share
from services.gateway.codec import IGNORED_HEADER, VERSION_HEADER
from services.gateway.call import Call
from services.gateway.frontend import USER_HEADER, Frontend
from services.gateway.openapi import openapi_document
from services.gateway.pipeline import Pipeline, Route as PipelineRoute
from services.gateway.responses import Responses
from services.gateway.sse_bounds import BoundedStream
from services.gateway.tei import RerankRoute, TeiEmbed
from shared import VERSION, priority
from shared.errors import ServiceError, too_large
from shared.logging import get_logger

log = get_logger("gateway.http")
_json = msgspec.json.Encoder()


class HttpMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        self.requests = Counter("tensorbus_gateway_http_requests_total",
                                "HTTP requests by route and status", ["route", "status"],
                                registry=registry)
        self.in_flight = Gauge("tensorbus_gateway_http_in_flight_requests",
                               "HTTP requests being served", registry=registry)
        self.sse_cancelled = Counter("tensorbus_gateway_sse_streams_cancelled_total",
                                     "SSE streams cancelled because their client stopped "
                                     "reading", ["route", "reason"], registry=registry)
        self.body_bytes = Gauge("tensorbus_gateway_http_inflight_body_bytes",
                                "bytes of HTTP request bodies being read and parsed",
                                registry=registry)


def error_response(err: ServiceError) -> Response:
    headers = {}
    if err.retry_after is not None:
        headers["Retry-After"] = f"{max(1, round(err.retry_after))}"
    if err.status == 401:
        headers["WWW-Authenticate"] = "Bearer"
    return Response(_json.encode(err.to_body()), status_code=err.status,
                    media_type="application/json", headers=headers)


def build_app(front: Frontend, pipeline_routes: list[PipelineRoute], ready) -> Starlette:
    config = front.config
    keys = config.api_key_set
    registry = CollectorRegistry()
    metrics = HttpMetrics(registry)
    spec = openapi_document()
    budget = BodyBudget(config.max_inflight_body_bytes, metrics.body_bytes)

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

    def body_limit(cut: bool) -> tuple[int, str]:
        """(bytes, name) of the largest body taken: TENSORBUS_MAX_PAYLOAD, or the bus's
        own max_payload when smaller (what the connected nats-server announced, read
        per request: a reconnect may land on another server). A NATS client cannot
        send more than that either, so both transports meet one limit, as a 413.
        An endpoint that cuts large requests into parts (`cut`: embeddings) takes
        bodies up to TENSORBUS_MAX_BODY over HTTP."""
        if cut:
            return config.max_body, "TENSORBUS_MAX_BODY"
        bus = front.nc.max_payload
        if 0 < bus < config.max_payload:
            return bus, "the message bus's max_payload"
        return config.max_payload, "TENSORBUS_MAX_PAYLOAD"

    async def read_body(request: Request, cut: bool, share: Share) -> bytes:
        """The body, within its own limit and the gateway's budget of bodies in
        memory at once (`share`: its stated length up front, else as it arrives)."""
        limit, name = body_limit(cut)
        declared = request.headers.get("content-length")
        if declared and declared.isdigit() and int(declared) > limit:
            raise too_large(f"the request body is {declared} bytes; the limit is {limit} bytes "
                            f"({name})")
        if declared and declared.isdigit():
            share.hold(int(declared))
        chunks, size = [], 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise too_large(f"the request body exceeds the limit of {limit} bytes ({name})")
            share.hold(size)
            chunks.append(chunk)
        return b"".join(chunks)

    async def serve(pipe: Pipeline[Any], cut: bool, request: Request) -> Response:
        call = Call.open(front, pipe.name, client_id=request.headers.get("x-request-id"),
                         timeout_s=_timeout(request), user=request.headers.get(USER_HEADER, ""))
        metrics.in_flight.inc()
        try:
            async with call.guarded():
                try:
                    return await answer(pipe, cut, request, call)
                except ClientDisconnect:
                    call.closed_by_client()
                    await call.cancel("client disconnected")  # frees a held or queued one
                    return Response(status_code=499)
            assert call.error is not None  # the body failed: guarded() kept its error
            return error_response(call.error)
        finally:
            if not call.detached:
                metrics.in_flight.dec()
                metrics.requests.labels(pipe.name, str(call.out.status)).inc()

    async def answer(pipe: Pipeline[Any], cut: bool, request: Request, call: Call) -> Response:
        check_headers(request)
        call.priority = priority.parse(request.headers.get(priority.HEADER))
        if not authorised(request):
            raise ServiceError(401, "a valid API key is required (Authorization: Bearer KEY)",
                               code="invalid_api_key")
        with budget.share() as share:  # given back once the body is parsed
            prep = await pipe.prepare(await read_body(request, cut, share), call)
        if not prep.stream:
            resp = await _unless_gone(request, pipe.whole(prep, call))
            return Response(_json.encode(resp), media_type="application/json",
                            headers=_headers(call))
        # The response starts when the first chunk arrives: its headers name the
        # version, and an error before it is an HTTP status, not an SSE event.
        chunks = pipe.chunks(prep, call)  # lists of chunks ready together
        first = await _unless_gone(request, anext(chunks, None))
        call.detach()  # the stream finishes the call: record and metrics at its end
        done = getattr(pipe, "sse_done", True)  # Responses streams end without [DONE]
        return BoundedStream(_sse(call, chunks, first, metrics, done), rid=call.rid,
                             write_timeout_s=config.sse_write_timeout_s,
                             max_buffer=config.sse_max_buffer_bytes,
                             cancelled=lambda why: metrics.sse_cancelled.labels(pipe.name, why).inc(),
                             media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", **_headers(call)})

    async def models(request: Request) -> Response:
        if not authorised(request):
            return error_response(ServiceError(401, "a valid API key is required", code="invalid_api_key"))
        front.fleet.expire()
        return Response(_json.encode(front.model_list()), media_type="application/json")

    async def model(request: Request) -> Response:
        """GET /v1/models/{id}: one card (OpenAI's retrieve), or 404."""
        if not authorised(request):
            return error_response(ServiceError(401, "a valid API key is required", code="invalid_api_key"))
        front.fleet.expire()
        name = request.path_params["model"]
        card = next((c for c in front.model_list().data if c.id == name), None)
        if card is None:
            return error_response(ServiceError(404, f"the model '{name}' does not exist",
                                               code="model_not_found"))  # fmt: skip
        return Response(_json.encode(card), media_type="application/json")

    async def stored(request: Request) -> Response:
        """GET / DELETE /v1/responses/{id} (services.gateway.responses)."""
        assert responses is not None  # the route is there only with the pipeline
        try:
            if not authorised(request):
                raise ServiceError(401, "a valid API key is required", code="invalid_api_key")
            rid = request.path_params["id"]
            got = await (responses.retrieve(rid) if request.method == "GET"
                         else responses.delete(rid))
        except ServiceError as err:
            return error_response(err)
        return Response(_json.encode(got), media_type="application/json")

    async def input_items(request: Request) -> Response:
        """GET /v1/responses/{id}/input_items (services.gateway.response_items)."""
        assert responses is not None  # the route is there only with the pipeline
        try:
            if not authorised(request):
                raise ServiceError(401, "a valid API key is required", code="invalid_api_key")
            got = await responses.input_items(request.path_params["id"], request.query_params)
        except ServiceError as err:
            return error_response(err)
        return Response(_json.encode(got), media_type="application/json")

    async def healthz(request: Request) -> Response:
        return JSONResponse({"status": "ok"})

    async def health(request: Request) -> Response:
        return Response(status_code=200)  # vLLM's /health: 200, empty body

    async def version(request: Request) -> Response:
        return JSONResponse({"version": VERSION})

    async def readyz(request: Request) -> Response:
        # The gateway's own readiness: serving and connected to the bus. Not the
        # workers': at zero workers requests are held, so the front door stays open.
        ok = ready() and front.nc.is_connected
        return JSONResponse({"ready": ok}, status_code=200 if ok else 503)

    async def prometheus(request: Request) -> Response:
        return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)

    async def openapi(request: Request) -> Response:
        return JSONResponse(spec)

    responses = cast("Responses | None", next(
        (r.pipeline for r in pipeline_routes if isinstance(r.pipeline, Responses)), None))
    routes = [
        *(Route(path, partial(serve, r.pipeline, r.cut), methods=["POST"])
          for r in pipeline_routes for path in (r.path, *ALIASES.get(r.path, ()))),
        # Text Embeddings Inference's (services.gateway.tei); /rerank takes its body too.
        Route("/embed", partial(serve, TeiEmbed(front), True), methods=["POST"]),
        Route("/rerank", partial(serve, RerankRoute(front), False), methods=["POST"]),
        *([Route("/v1/responses/{id}", stored, methods=["GET", "DELETE"]),
           Route("/v1/responses/{id}/input_items", input_items, methods=["GET"])]
          if responses else []),
        *batches.routes(front.nc, config, authorised),  # /v1/files, /v1/batches
        Route("/v1/models", models, methods=["GET"]),
        Route("/v1/models/{model:path}", model, methods=["GET"]),
        Route("/healthz", healthz, methods=["GET"]),
        Route("/health", health, methods=["GET"]),
        Route("/version", version, methods=["GET"]),
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


# The paths other servers use for the same endpoints: vLLM's unversioned ones, and
# Cohere v2's rerank (its client's shape is the one /v1/rerank reads); vLLM's /rerank
# is TEI's too (below).
ALIASES = {
    "/v1/tokenize": ("/tokenize",), "/v1/detokenize": ("/detokenize",),
    "/v1/rerank": ("/v2/rerank",), "/v1/score": ("/score",),
}  # fmt: skip


async def _unless_gone(request: Request, answer):
    """What awaitable `answer` gives, or ClientDisconnect when the client leaves
    first. Until a response starts nothing else notices a client that leaves (a
    request held through a cold start, queued, or generating a whole answer): the
    body is read, so the next ASGI message is `http.disconnect`, sent when the
    connection closes. The caller then sends the request's Cancel."""
    task = asyncio.ensure_future(answer)
    gone = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait((task, gone), return_when=asyncio.FIRST_COMPLETED)
        if task.done():
            return task.result()
        raise ClientDisconnect()
    finally:
        for t in (task, gone):
            t.cancel()  # a no-op when done; closes a stream's inbox and waiting count
        await asyncio.gather(task, gone, return_exceptions=True)


async def _disconnected(request: Request) -> None:
    """Returns when the server says the client left."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


def _headers(call: Call) -> dict[str, str]:
    headers = {"X-Request-Id": call.rid}
    if call.out.version:
        headers[VERSION_HEADER] = call.out.version
    if call.ignored:
        headers[IGNORED_HEADER] = ", ".join(call.ignored)
    return headers


def _events(ready: list) -> bytes:
    """SSE events for chunks ready together: one transport write. A Responses event
    (shared.api_responses: it has a `type`) is named by it (`event: TYPE`)."""
    return b"".join([_named(chunk) + b"data: " + _json.encode(chunk) + b"\n\n"
                     for chunk in ready])


def _named(chunk) -> bytes:
    kind = getattr(chunk, "type", None)
    return b"event: " + kind.encode() + b"\n" if isinstance(kind, str) else b""


async def _sse(call: Call, chunks, first, metrics: HttpMetrics, done: bool = True):
    """The response body, ending with `data: [DONE]` unless `done` is false (the
    Responses API's streams end with their last event). While the client reads
    slowly, the send of one write waits and the worker's chunks queue up meanwhile;
    the pipeline then coalesces them, so a slow reader gets fewer, larger events
    rather than a growing backlog."""
    out = call.out
    finished = False
    try:
        if first is not None:
            yield _events(first)
            async for ready in chunks:
                yield _events(ready)
        finished = True
    except ServiceError as err:
        call.fail(err)
        yield b"data: " + _json.encode(err.to_body()) + b"\n\n"
        finished = True
    except (asyncio.CancelledError, GeneratorExit):
        call.closed_by_client()
        raise
    finally:
        if not finished and out.status == 200:
            call.closed_by_client()
        if out.status == 499:
            await call.cancel("client disconnected")
        metrics.in_flight.dec()
        metrics.requests.labels(out.endpoint, str(out.status)).inc()
        await call.finish()
    if done:
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

    # proxy_headers off: nothing here reads the client's address, and the middleware
    # that rewrites it from X-Forwarded-For is one more layer on every request.
    cfg = uvicorn.Config(app, host=host, port=port, log_level="warning", access_log=False,
                         proxy_headers=False,
                         h11_max_incomplete_event_size=max_header_bytes, lifespan="off",
                         timeout_graceful_shutdown=5)
    server = uvicorn.Server(cfg)
    # The process owns signals: its stop drains (not ready, then HTTP, then the work in
    # flight). uvicorn's `serve` would take SIGINT and SIGTERM for the time it runs,
    # close HTTP first and hand the signal on only after.
    server.capture_signals = contextlib.nullcontext  # type: ignore[method-assign,assignment]
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
