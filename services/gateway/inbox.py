"""One wildcard reply subscription for every request this gateway has in flight.

  1. Each request gets the subject `<prefix>.<request_id>`; whatever arrives there
     (a result, a refusal, `Held` / `Accepted`, a NATS "no responders" status) lands
     in that request's queue.
  2. Workers send what one decode step or one encoder batch produced for this
     gateway's requests as one `Results` message to `<prefix>.results`
     (`subjects.reply_group`); each of its items lands in its request's queue, in
     order, as if it had come alone.
  3. Queues hold decoded results, or the ServiceError a message stands for (no
     responders: 503; an undecodable body: 500), which the reader raises; at the
     request's deadline `EXPIRED` joins its queue (one timer per request, not one
     per wait: a stream waits once per token).

A message for a request that already finished is dropped, which is what makes
re-dispatched work idempotent towards the client (and keeps a late result of a
cancelled request from reaching anyone).
"""

from __future__ import annotations

import asyncio
import time

import msgspec
from nats.aio.client import Client
from nats.aio.msg import Msg

from shared import subjects
from shared.errors import internal, unavailable
from shared.logging import get_logger
from shared.messages import result_decoder, results_decoder

log = get_logger("gateway.inbox")

EXPIRED = object()  # queued at a request's deadline


class ReplyInbox:
    def __init__(self, nc: Client) -> None:
        self.nc = nc
        self.prefix = nc.new_inbox()
        self.group = subjects.reply_group(self.prefix)  # where workers send Results
        self._queues: dict[str, asyncio.Queue] = {}
        self._timers: dict[str, asyncio.TimerHandle] = {}
        self._sub = None

    async def start(self) -> None:
        self._sub = await self.nc.subscribe(
            self.prefix + ".*", cb=self._on_msg,
            pending_msgs_limit=1_000_000, pending_bytes_limit=1 << 30)

    async def stop(self) -> None:
        if self._sub is not None:
            await self._sub.unsubscribe()
            self._sub = None

    def open(self, request_id: str, deadline: float) -> tuple[str, asyncio.Queue]:
        """The request's reply subject and queue; `EXPIRED` is queued at `deadline`
        (UNIX seconds)."""
        q: asyncio.Queue = asyncio.Queue()
        self._queues[request_id] = q
        loop = asyncio.get_running_loop()
        self._timers[request_id] = loop.call_at(
            loop.time() + max(0.0, deadline - time.time()), q.put_nowait, EXPIRED)
        return f"{self.prefix}.{request_id}", q

    def close(self, request_id: str) -> None:
        self._queues.pop(request_id, None)
        timer = self._timers.pop(request_id, None)
        if timer is not None:
            timer.cancel()

    @property
    def open_count(self) -> int:
        return len(self._queues)

    @property
    def pending(self) -> int:
        """Messages received and not yet handed to their requests (a backlog)."""
        return self._sub.pending_msgs if self._sub is not None else 0

    async def _on_msg(self, msg: Msg) -> None:
        if msg.subject == self.group:
            self._demux(msg.data)
            return
        q = self._queues.get(msg.subject[len(self.prefix) + 1:])
        if q is not None:
            q.put_nowait(_decoded(msg))

    def _demux(self, data: bytes) -> None:
        try:
            items = results_decoder.decode(data).items
        except msgspec.DecodeError as exc:
            log.error("results_undecodable", error=str(exc)[:200])
            return
        queues = self._queues
        for item in items:
            q = queues.get(item.request_id)
            if q is not None:
                q.put_nowait(item)


def _decoded(msg: Msg) -> object:
    """One request's message: its result, or the error it stands for."""
    if msg.headers and msg.headers.get("Status") == "503" and not msg.data:
        return unavailable("no scheduler is running; retry shortly")
    try:
        return result_decoder.decode(msg.data)
    except msgspec.DecodeError:
        return internal()
