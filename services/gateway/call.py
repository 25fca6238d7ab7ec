"""One request, whatever transport brought it: the wrapper NATS and HTTP share.

A `Call` holds the request's ids (the client's id for logs and telemetry, the wire
id it travels under), its deadline, encoding, user key and `Outcome`. `guarded()`
(the call itself, as an async context manager: no generator per request) binds the request id to every log line, maps any failure onto the error contract
(a ServiceError as it is; anything else a logged 500), and publishes the one
telemetry record when the request ends. The transport then renders `call.error`
in its own way. A streamed HTTP response outlives the handler: it `detach()`es the
call and `finish()`es it when the stream ends.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Mapping

from structlog.contextvars import bind_contextvars, reset_contextvars

from services.gateway.frontend import Frontend, new_request_id, wire_id
from services.gateway.outcome import Outcome
from shared.errors import ServiceError, internal
from shared.priority import BATCH, INTERACTIVE
from shared.logging import get_logger

log = get_logger("gateway")

MAX_CLIENT_ID = 64


@dataclass(slots=True)
class Call:
    front: Frontend
    rid: str  # the client's X-Request-Id (cut to 64), else a fresh id: logs, telemetry
    wire: str  # unique and one subject token: the id the request travels under
    deadline: float  # time.time() by which it must be answered (generation: its first token)
    out: Outcome
    msgpack: bool = False
    user: str = ""  # the Tensorbus-User header (sticky canary key)
    started: float = field(default_factory=time.perf_counter)
    error: ServiceError | None = None
    detached: bool = False
    _finished: bool = False
    _log_tokens: Mapping[str, Any] | None = None
    end_by: float = 0.0  # time.time() by which a generation must have ended
    parts: list[str] = field(default_factory=list)  # ids of the works it was cut into
    over_bus: bool = False  # a NATS request: its whole answer goes back as one bus message
    ignored: list[str] = field(default_factory=list)  # documented fields not acted on
    priority: int = INTERACTIVE  # its lane (shared.priority): the transport reads the header

    @property
    def batch(self) -> bool:
        """A batch-lane request: it may wait, so it is not refused for the work ahead
        or its deadline (the scheduler's batch lane waits for idle capacity)."""
        return self.priority >= BATCH

    @classmethod
    def open(cls, front: Frontend, endpoint: str, *, client_id: str | None,
             timeout_s: float | None, msgpack: bool = False, user: str = "") -> Call:
        started = time.perf_counter()
        rid = client_id[:MAX_CLIENT_ID] if client_id else new_request_id()
        wire = wire_id(rid) if client_id else rid
        return cls(front, rid, wire, front.deadline(timeout_s), Outcome(endpoint), msgpack,
                   user, started, end_by=front.end_by(timeout_s))

    def guarded(self) -> Call:
        """`async with call.guarded():` runs the body; a failure becomes `self.error`;
        the record goes out at the end (unless the call was detached to a stream that
        finishes it later)."""
        return self

    async def __aenter__(self) -> Call:
        self._log_tokens = bind_contextvars(request_id=self.rid)
        return self

    async def __aexit__(self, exc_type, exc, tb) -> bool:
        try:
            if exc is None or not isinstance(exc, Exception):
                return False  # done, or cancelled: nothing to answer
            if isinstance(exc, ServiceError):
                self.error = exc
            else:  # a bug must still answer the client
                log.error("request_crashed", exc_info=exc)
                self.error = internal()
            self.fail(self.error)
            return True
        finally:
            try:
                if not self.detached:
                    await self.finish()
            finally:
                assert self._log_tokens is not None  # bound by __aenter__
                reset_contextvars(**self._log_tokens)

    def fail(self, err: ServiceError) -> None:
        """Record `err` as the request's outcome (the transport answers with it)."""
        self.out.status, self.out.error_code = err.status, err.code
        if err.status >= 500 and err.status not in (503, 504):
            log.error("request_failed", status=err.status, error=err.message)

    def closed_by_client(self) -> None:
        self.out.status, self.out.error_code = 499, "client_closed"

    async def cancel(self, reason: str) -> None:
        """Tell the scheduler and worker to drop the request (held, queued or running),
        and every part it was cut into (services/gateway/split.py)."""
        for rid in [self.wire, *self.parts]:
            await self.front.inbox.cancel(rid, reason)

    def detach(self) -> None:
        self.detached = True

    async def finish(self) -> None:
        """Publish the request's telemetry record, once."""
        if not self._finished:
            self._finished = True
            await self.front.record(self.rid, self.out, self.started, self.wire)
