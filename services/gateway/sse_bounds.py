"""Bounds on one SSE reader: a client that stops reading a stream must not hold the
gateway's memory or a worker's slot for ever.

A write to the client waits while its connection's buffers are full (its TCP window
closed); meanwhile the request's chunks queue at the gateway and the pipeline joins
them into the next write. So a stream is cancelled when

  - one write makes no progress for TENSORBUS_SSE_WRITE_TIMEOUT_S (`write_timeout`), or
  - the chunks waiting for one write pass TENSORBUS_SSE_MAX_BUFFER_BYTES (`buffer`):
    the client reads, but slower than the model writes.

Cancelled, the stream's body generator is closed (which sends the request's Cancel
upstream, as a client that disconnects does: the worker frees the slot), the
connection is aborted (a plain close would wait for the unread bytes to drain),
the event is logged with the request id and counted in
`tensorbus_gateway_sse_streams_cancelled_total{reason}`.
"""

from __future__ import annotations

import asyncio
from typing import Callable

from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from shared.logging import get_logger

log = get_logger("gateway.sse")


class BoundedStream(StreamingResponse):
    """A StreamingResponse whose every write has `write_timeout_s` and whose every
    chunk (the events ready together) at most `max_buffer` bytes."""

    def __init__(self, body, *, rid: str, write_timeout_s: float, max_buffer: int,
                 cancelled: Callable[[str], None], **kwargs) -> None:
        super().__init__(body, **kwargs)
        self.rid = rid
        self.write_timeout_s = write_timeout_s
        self.max_buffer = max_buffer
        self.cancelled = cancelled
        self._receive: Receive | None = None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        self._receive = receive
        await super().__call__(scope, receive, send)

    async def stream_response(self, send: Send) -> None:
        start = {"type": "http.response.start", "status": self.status_code,
                 "headers": self.raw_headers}
        if not await self._write(send, start, 0):
            return
        async for chunk in self.body_iterator:
            data = chunk.encode(self.charset) if isinstance(chunk, str) else chunk
            if len(data) > self.max_buffer:
                await self._cancel("buffer", len(data))
                return
            if not await self._write(send, {"type": "http.response.body", "body": data,
                                            "more_body": True}, len(data)):
                return
        await self._write(send, {"type": "http.response.body", "body": b"",
                                 "more_body": False}, 0)

    async def _write(self, send: Send, message, size: int) -> bool:
        try:
            await asyncio.wait_for(send(message), self.write_timeout_s)
            return True
        except TimeoutError:
            await self._cancel("write_timeout", size)
            return False

    async def _cancel(self, reason: str, size: int) -> None:
        log.warning("sse_stream_cancelled", request_id=self.rid, reason=reason, bytes=size,
                    write_timeout_s=self.write_timeout_s, max_buffer=self.max_buffer)
        self.cancelled(reason)
        _abort(self._receive)
        aclose = getattr(self.body_iterator, "aclose", None)
        if aclose is not None:
            await aclose()  # its end sends the request's Cancel and its record


def _abort(receive: Receive | None) -> None:
    """Drop the connection without waiting for its unread bytes: uvicorn's receive
    is a method of the request's cycle, which holds the transport."""
    transport = getattr(getattr(receive, "__self__", None), "transport", None)
    if transport is not None:
        transport.abort()
