"""Reading results: one wildcard reply subscription for every request this gateway
has in flight, and each request's answers read off its own queue.

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
  4. A request reads its queue (`next_result`, `ready_results`): hold notices are
     noted in its `Outcome` in passing (`Held` starts the cold-start clock,
     `Accepted` sets `hold_s`), a WorkError is raised as the client's error, and at
     `EXPIRED` a Cancel goes out (the worker frees whatever it holds) and 504 is raised.

A message for a request that already finished is dropped, which is what makes
re-dispatched work idempotent towards the client (and keeps a late result of a
cancelled request from reaching anyone).
"""

from __future__ import annotations

import asyncio
import time
from typing import TYPE_CHECKING

import msgspec
from nats.aio.client import Client
from nats.aio.msg import Msg

from shared import subjects
from shared.errors import ServiceError, deadline_exceeded, internal, unavailable
from shared.logging import get_logger
from shared.messages import (
    Accepted,
    Cancel,
    Held,
    WorkError,
    encode,
    result_decoder,
    results_decoder,
)

if TYPE_CHECKING:
    from services.gateway.frontend import Outcome

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

    async def cancel(self, rid: str, reason: str) -> None:
        """Tell the workers (and a scheduler holding its room) to drop a request."""
        await self.nc.publish(subjects.CANCEL, encode(Cancel(rid, reason)))

    async def next_result(self, q: asyncio.Queue, rid: str, out: Outcome | None = None):
        """The next result for a request; errors raised as ServiceError.

        Hold notices are taken in passing: `Held` starts the cold-start clock, and
        `Accepted` (a held request released to a worker) sets `out.hold_s`."""
        while True:
            res = _taken(await self._next(q, rid, out), out)
            if res is not None:
                return res

    def ready_results(self, q: asyncio.Queue, out: Outcome | None = None
                      ) -> tuple[list, ServiceError | None]:
        """The results already queued for a request, without waiting, and the error
        that stopped the reading if one came (the results before it still count)."""
        got = []
        while not q.empty():
            item = q.get_nowait()
            if item is EXPIRED:
                q.put_nowait(item)  # the next wait reports it
                break
            try:
                res = _taken(item, out)
            except ServiceError as err:
                return got, err
            if res is not None:
                got.append(res)
        return got, None

    async def _next(self, q: asyncio.Queue, rid: str, out: Outcome | None):
        """The request's next queued item; at its deadline (`EXPIRED`, queued by the
        timer) a Cancel goes out and 504 is raised."""
        item = q.get_nowait() if not q.empty() else await q.get()
        if item is not EXPIRED:
            return item
        await self.cancel(rid, "deadline")
        if out is not None and out.held_at:  # still waiting for a worker to start
            out.hold_s = time.perf_counter() - out.held_at
            raise deadline_exceeded(
                f"no worker of model '{out.model}' became ready before the request's "
                f"deadline (held {out.hold_s:.1f} s for a cold start)")
        raise deadline_exceeded()

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


def as_service_error(err: WorkError) -> ServiceError:
    """A scheduler's or worker's WorkError as the error the client gets."""
    return ServiceError(err.status, err.message, code=err.code or None,
                        retry_after=err.retry_after)


def _taken(item, out: Outcome | None):
    """A queued item as a result: None for a hold notice (noted in `out`), an error
    raised as ServiceError."""
    if isinstance(item, ServiceError):
        raise item
    if isinstance(item, WorkError):
        if out is not None and item.version:  # a version's failure counts against it
            out.version, out.worker_id = item.version, item.worker_id
        raise as_service_error(item)
    if isinstance(item, Held):
        if out is not None:
            out.held_at = time.perf_counter()
        return None
    if isinstance(item, Accepted):
        if out is not None:
            out.hold_s, out.held_at = item.hold_s, 0.0
        return None
    return item
