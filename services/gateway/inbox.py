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
     responders: 503; an undecodable body: 500), which the reader raises; when the
     request's time is up an `Expired` joins its queue (one timer per request, not
     one per wait: a stream waits once per token). Its time is its deadline until
     its first token; from its first GenChunk on (noted as it arrives, whatever
     the reader's pace) its time is up when no chunk came for its stall timeout,
     or at its `end_by` (docs/protocol.md, "Deadlines"). A `Held` may move the
     deadline later (`until`: the model's measured cold start). The first chunk sets the
     timer again; a later one only writes its time, and the timer, when it rings
     early, sets itself again for the time now due.
  4. A request reads its queue (`next_result`, `ready_results`): hold notices are
     noted in its `Outcome` in passing (`Held` starts the cold-start clock,
     `Accepted` sets `hold_s`), a WorkError is raised as the client's error, and at
     `Expired` a Cancel goes out (the worker frees whatever it holds) and 504 is
     raised, saying which bound it was.

A message for a request that already finished is dropped, which is what makes
re-dispatched work idempotent towards the client (and keeps a late result of a
cancelled request from reaching anyone).
"""

from __future__ import annotations

import asyncio
import math
import time
from dataclasses import dataclass

import msgspec
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription

from services.gateway.outcome import Outcome
from shared import subjects
from shared.errors import ServiceError, deadline_exceeded, internal, out_of_time
from shared.logging import get_logger
from shared.messages import (
    Accepted,
    Cancel,
    GenChunk,
    Held,
    WorkError,
    encode,
    result_decoder,
    results_decoder,
)

log = get_logger("gateway.inbox")


@dataclass(slots=True)
class Expired:
    """Queued when a request's time is up: `why` is the bound it passed."""

    why: str  # "deadline" (no first token) | "stall" | "max_time"
    seconds: float  # that bound, for the message


class PathLost(Exception):
    """Queued for a retryable request when the gateway's connection (`own`) or a
    scheduler's dropped while it was out: its answer may have been lost with that
    path (services.gateway.frontend `call` asks once more; a stream, see
    services.gateway.generation `events`)."""

    def __init__(self, own: bool = True) -> None:
        super().__init__()
        self.own = own


class NoScheduler(ServiceError):
    """A submission that found no scheduler subscribed (NATS "no responders"): none
    runs, or one is between servers (services.gateway.frontend `call` may wait)."""

    def __init__(self) -> None:
        super().__init__(503, "no scheduler is running; retry shortly", code="no_worker",
                         retry_after=1.0)


@dataclass(slots=True)
class Clock:
    """A request's time: `deadline` (UNIX seconds) until its first token; after it,
    `stall_s` after its latest token (0 = unbounded), and `end_by` at the latest
    (0 = no bound)."""

    q: asyncio.Queue
    deadline: float
    stall_s: float = 0.0
    end_by: float = 0.0
    last: float = 0.0  # UNIX seconds of its latest token (0: none yet)
    handle: asyncio.TimerHandle | None = None

    def due(self) -> tuple[float, Expired]:
        """When its time is up, and what to queue then."""
        if not self.last:
            return self.deadline, Expired("deadline", 0.0)
        stall = self.last + self.stall_s if self.stall_s > 0 else math.inf
        end = self.end_by or math.inf
        if stall < end:
            return stall, Expired("stall", self.stall_s)
        return end, Expired("max_time", 0.0)


class ReplyInbox:
    def __init__(self, nc: Client) -> None:
        self.nc = nc
        self.prefix = nc.new_inbox()
        self.group = subjects.reply_group(self.prefix)  # where workers send Results
        self._queues: dict[str, asyncio.Queue] = {}
        self._clocks: dict[str, Clock] = {}
        self._retryable: set[str] = set()  # open requests a lost path may retry (once)
        self._sub: Subscription | None = None

    async def start(self) -> None:
        self._sub = await self.nc.subscribe(
            self.prefix + ".*", cb=self._on_msg,
            pending_msgs_limit=1_000_000, pending_bytes_limit=1 << 30)

    async def stop(self) -> None:
        if self._sub is not None:
            await self._sub.unsubscribe()
            self._sub = None

    def open(self, request_id: str, deadline: float, stall_s: float = 0.0,
             end_by: float = 0.0, retry: bool = False) -> tuple[str, asyncio.Queue]:
        """The request's reply subject and queue; an `Expired` is queued when its
        time (a `Clock` of these bounds, UNIX seconds) is up; with `retry`, a
        `PathLost` when a path drops (`path_lost`)."""
        q: asyncio.Queue = asyncio.Queue()
        self._queues[request_id] = q
        if retry:
            self._retryable.add(request_id)
        clock = self._clocks[request_id] = Clock(q, deadline, stall_s, end_by)
        self._arm(clock)
        return f"{self.prefix}.{request_id}", q

    def _arm(self, clock: Clock) -> None:
        due, _ = clock.due()
        loop = asyncio.get_running_loop()
        delay = max(0.0, due - time.time()) if due != math.inf else 86_400.0
        clock.handle = loop.call_at(loop.time() + delay, self._ring, clock)

    def _ring(self, clock: Clock) -> None:
        """The timer: the request's time is up, or (tokens came meanwhile) it is due
        later, and the timer is set again for then."""
        due, expired = clock.due()
        if due > time.time():
            self._arm(clock)
        else:
            clock.handle = None
            clock.q.put_nowait(expired)

    def _token(self, clock: Clock, now: float) -> None:
        """A GenChunk of the request arrived at `now`. Later chunks only put its time
        off (the timer sees it when it rings); the first may bring it forward (a
        stall timeout shorter than what was left of the deadline): set it again."""
        first = not clock.last
        clock.last = now
        if first and clock.handle is not None:
            clock.handle.cancel()
            self._arm(clock)

    def path_lost(self, own: bool = True) -> None:
        """This gateway's connection (`own`), or a scheduler's, dropped: every
        retryable request out now is told, once."""
        for rid in self._retryable:
            self._queues[rid].put_nowait(PathLost(own))
        self._retryable.clear()

    def retry_again(self, request_id: str) -> None:
        """A request submitted again: told again when a path drops."""
        if request_id in self._queues:
            self._retryable.add(request_id)

    def close(self, request_id: str) -> None:
        self._retryable.discard(request_id)
        self._queues.pop(request_id, None)
        clock = self._clocks.pop(request_id, None)
        if clock is not None and clock.handle is not None:
            clock.handle.cancel()

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
                      ) -> tuple[list, ServiceError | PathLost | None]:
        """The results already queued for a request, without waiting, and the error
        (or the lost path) that stopped the reading if one came (the results before it
        still count)."""
        got: list = []
        while not q.empty():
            item = q.get_nowait()
            if isinstance(item, Expired):
                q.put_nowait(item)  # the next wait reports it
                break
            try:
                res = _taken(item, out)
            except (ServiceError, PathLost) as err:
                return got, err
            if res is not None:
                got.append(res)
        return got, None

    async def _next(self, q: asyncio.Queue, rid: str, out: Outcome | None):
        """The request's next queued item; when its time is up (`Expired`, queued by
        the timer) a Cancel goes out and 504 is raised."""
        item = q.get_nowait() if not q.empty() else await q.get()
        if not isinstance(item, Expired):
            return item
        await self.cancel(rid, item.why)
        if item.why != "deadline":
            raise out_of_time(item.why, item.seconds)
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
        rid = msg.subject[len(self.prefix) + 1:]
        q = self._queues.get(rid)
        if q is not None:
            item = _decoded(msg)
            if isinstance(item, GenChunk):
                self._token(self._clocks[rid], time.time())
            elif isinstance(item, Held) and item.until > self._clocks[rid].deadline:
                # held through a cold start that needs longer: the timer sees it
                self._clocks[rid].deadline = item.until
            q.put_nowait(item)

    def _demux(self, data: bytes) -> None:
        try:
            items = results_decoder.decode(data).items
        except msgspec.DecodeError as exc:
            log.error("results_undecodable", error=str(exc)[:200])
            return
        queues, clocks, now = self._queues, self._clocks, time.time()
        for item in items:
            q = queues.get(item.request_id)
            if q is not None:
                if isinstance(item, GenChunk):  # tokens flow: the stall bound starts again
                    self._token(clocks[item.request_id], now)
                q.put_nowait(item)


def _decoded(msg: Msg) -> object:
    """One request's message: its result, or the error it stands for."""
    if msg.headers and msg.headers.get("Status") == "503" and not msg.data:
        return NoScheduler()
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
    if isinstance(item, (ServiceError, PathLost)):
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
