"""One wildcard reply subscription for every request this gateway has in flight.

Each request gets the subject `<prefix>.<request_id>`; whatever arrives there (results,
stream chunks, refusals, NATS "no responders" statuses) lands in that request's queue.
A message for a request that already finished is dropped, which is what makes
re-dispatched work idempotent towards the client.
"""

from __future__ import annotations

import asyncio

from nats.aio.client import Client
from nats.aio.msg import Msg


class ReplyInbox:
    def __init__(self, nc: Client) -> None:
        self.nc = nc
        self.prefix = nc.new_inbox()
        self._queues: dict[str, asyncio.Queue[Msg]] = {}
        self._sub = None

    async def start(self) -> None:
        self._sub = await self.nc.subscribe(
            self.prefix + ".*", cb=self._on_msg,
            pending_msgs_limit=1_000_000, pending_bytes_limit=1 << 30)

    async def stop(self) -> None:
        if self._sub is not None:
            await self._sub.unsubscribe()
            self._sub = None

    def open(self, request_id: str) -> tuple[str, asyncio.Queue[Msg]]:
        q: asyncio.Queue[Msg] = asyncio.Queue()
        self._queues[request_id] = q
        return f"{self.prefix}.{request_id}", q

    def close(self, request_id: str) -> None:
        self._queues.pop(request_id, None)

    @property
    def open_count(self) -> int:
        return len(self._queues)

    async def _on_msg(self, msg: Msg) -> None:
        rid = msg.subject[len(self.prefix) + 1:]
        q = self._queues.get(rid)
        if q is not None:
            q.put_nowait(msg)
