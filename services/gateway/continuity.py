"""A generation's chunks in order, or a clear end: the gateway passes on every chunk
of one dispatch once, in order, and resumes a deterministic generation whose path
broke (docs/decisions/0053-node-loss.md).

A lost nats-server can take chunks with it (the gateway's, or the worker's, path
through it), and a re-dispatch or a duplicate delivery can bring one twice. Every
chunk carries its number among its choice's chunks of that attempt (`GenChunk.seq`,
from 0); `ChunkOrder`, per choice:

  - the number expected: passed on;
  - a lower one (already passed on): dropped, so no token reaches the client twice;
  - a higher one (one or more lost on the way), or the GenDone when a choice has
    not sent its last chunk: the path broke (`StreamBroken`).

`events` reads a request's messages and handles a broken path:

  1. A stream under way when the gateway's own connection drops: the path broke
     (what was on its way may be gone; its end would otherwise come only at the
     stall timeout). One that delivered nothing yet, or whose scheduler's
     connection dropped: submitted again as an attempt of its own
     (`attempt` + RESUBMITTED; the first attempt heard from owns the stream, so two
     never mix), or left alone when under way (a scheduler is not on its path).
     One that found no scheduler subscribed ("no responders": the scheduler is
     between servers) was received by nobody: submitted again at the next report of
     a scheduler, as `Frontend.call` does, a few times within its deadline.
  2. A broken path of a deterministic generation (greedy or seeded, without the
     prompt's logprobs: `resumable`) is resumed: a new request (`<id>-r<n>`) that
     generates each choice not yet passed on whole, with its tokens already passed
     on as its `skip` (`GenerateWork.choices`, `skips`; one choice: `skip`), which
     the worker generates again and does not send (its detokenizer runs over them,
     so the text goes on exactly where it stopped). A choice keeps its index, so
     its draws (seed + index) too. The old request is cancelled, and anything late
     from it is dropped with its closed queue. Its GenDone counts the tokens of the
     choices left out as well; when every choice was passed on whole and only the
     GenDone was lost, the gateway writes it (`Progress.done`) rather than sending
     an empty request. At most MAX_RESUMES times.
  3. Any other broken path ends the stream with a 503 `stream_broken` error chunk
     that says how many chunks were delivered: never a silent gap.
  4. A lost worker (killed, its node gone, wedged): a resumable generation is sent
     with `resumes`, so the scheduler that dispatched it does not dispatch it again
     when the worker expires but tells the gateway (a WorkError `worker_lost`,
     `WorkerLost` here); it is resumed at once as in 2., from the last token passed
     on, its lost attempt cancelled. One attempt computes it at any time, and only
     its tokens reach the client. After `max_redispatch` (TENSORBUS_MAX_REDISPATCH)
     such resumptions the next loss ends it with a 500 that says so.
"""

from __future__ import annotations

import time
from typing import AsyncIterator, TypeGuard

import msgspec

from services.gateway.inbox import NoScheduler, PathLost
from services.gateway.schedulers import NO_SCHEDULER_TRIES
from shared.errors import ServiceError, internal
from shared.logging import get_logger
from shared.messages import GenChunk, GenDone, GenerateWork, Timing

log = get_logger("gateway")

RESUBMITTED = 1_000  # a stream the gateway submits again counts its attempts from here
MAX_RESUMES = 3


class StreamBroken(ServiceError):
    """A generation whose path through the bus broke (503 `stream_broken`)."""

    def __init__(self, delivered: int) -> None:
        super().__init__(
            503, f"the generation's path through the message bus was lost after {delivered} "
            "chunks (a server of the cluster was lost); its rest cannot be delivered: retry "
            "the request", code="stream_broken", retry_after=1.0)


class WorkerLost(Exception):
    """The worker generating the request was lost (its scheduler said so)."""

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


def _worker_lost(err: object) -> TypeGuard[ServiceError]:
    return isinstance(err, ServiceError) and err.code == "worker_lost"


def stream_broken(delivered: int) -> ServiceError:
    return StreamBroken(delivered)


class ChunkOrder:
    def __init__(self, n: int, choices: list[int] | None = None) -> None:
        """`choices`: those the attempt generates (None: all `n`); the others were
        passed on whole already."""
        self.expect = [0] * n  # per choice: the next chunk's number
        self.finished = [i not in choices for i in range(n)] if choices else [False] * n
        self.passed = 0  # chunks passed on, all choices
        self.dropped = 0  # duplicates dropped

    def take(self, ev: GenChunk | GenDone) -> bool:
        """Whether to pass `ev` on (False: a duplicate); StreamBroken when a chunk
        was lost."""
        if isinstance(ev, GenDone):
            if not all(self.finished):
                raise StreamBroken(self.passed)
            return True
        want = self.expect[ev.index]
        if ev.seq < want:
            self.dropped += 1
            return False
        if ev.seq > want:
            raise StreamBroken(self.passed)
        self.expect[ev.index] = want + 1
        self.passed += 1
        if ev.finish_reason:
            self.finished[ev.index] = True
        return True


def resumable(work: GenerateWork) -> bool:
    """Generated again the same from its start: greedy or seeded (each choice draws
    from seed + its index), without the prompt's logprobs."""
    s = work.sampling
    return (s.temperature == 0 or s.seed is not None) and work.prompt_logprobs < 0


class Progress:
    """What of a request's choices reached the client, over all its attempts."""

    def __init__(self, work: GenerateWork) -> None:
        self.work = work
        self.tokens = [0] * work.n  # per choice: tokens passed on
        self.finished = [False] * work.n  # per choice: its last chunk passed on
        self.chunks = 0

    def note(self, batch: list[GenChunk | GenDone]) -> list[GenChunk | GenDone]:
        """`batch`, passed on; its GenDone counting the tokens of choices that a
        resumption left out."""
        running = self.work.generated()
        for at, ev in enumerate(batch):
            if isinstance(ev, GenChunk):
                self.tokens[ev.index] += ev.tokens
                self.chunks += 1
                self.finished[ev.index] = self.finished[ev.index] or bool(ev.finish_reason)
            elif len(running) < self.work.n:
                whole = sum(t for i, t in enumerate(self.tokens) if i not in running)
                batch[at] = msgspec.structs.replace(
                    ev, completion_tokens=ev.completion_tokens + whole)
        return batch

    def resumed(self, work: GenerateWork, request_id: str, deadline: float) -> GenerateWork:
        """`work` sent again as `request_id`: the choices not passed on whole, each
        from its last token passed on."""
        left = [i for i in range(work.n) if not self.finished[i]]
        several = work.n > 1
        self.work = msgspec.structs.replace(
            work, request_id=request_id, attempt=0, reserved="", deadline=deadline,
            skip=0 if several else self.tokens[0], skips=list(self.tokens) if several else [],
            choices=left if several and len(left) < work.n else [])
        return self.work

    def done(self, out) -> GenDone:
        """The GenDone of a request whose every choice was passed on whole, its own lost."""
        w = self.work
        return GenDone(w.request_id, "", w.model, out.version, len(w.prompt), sum(self.tokens),
                       Timing(), w.attempt)


async def events(front, work: GenerateWork, out) -> AsyncIterator[list[GenChunk | GenDone]]:
    """The request's GenChunks and GenDone, as lists of those queued together; a
    broken path resumed (2.) or ended (3.); a lost worker's request resumed (4.)."""
    rid = work.request_id
    work.resumes = resumable(work)
    seen = Progress(work)
    broken = lost = 0  # resumptions for a broken path, for a lost worker
    cap = front.config.max_redispatch
    while True:
        try:
            if all(seen.finished):  # every choice passed on whole: only the GenDone lost
                yield [seen.done(out)]
                return
            async for batch in _leg(front, work, out):
                yield seen.note(batch)
            return
        except StreamBroken:
            if broken == MAX_RESUMES or not work.resumes:
                raise StreamBroken(seen.chunks) from None
            broken += 1
            why = "resumed"
        except WorkerLost as exc:
            if lost == cap:
                front.given_up += 1
                raise internal(
                    f"the request's worker was lost {lost + 1} times (the last: {exc.message}); "
                    f"not sent again past TENSORBUS_MAX_REDISPATCH={cap}") from None
            lost += 1
            why = "worker_lost"
        await front.inbox.cancel(work.request_id, why)
        deadline = time.time() + front.config.request_timeout_s
        work = seen.resumed(work, f"{rid}-r{broken + lost}",
                            min(deadline, work.end_by) if work.end_by else deadline)
        front.resumed += 1
        log.warning("stream_resumed", wire_id=work.request_id, skip=seen.tokens, reason=why)


async def _leg(front, work: GenerateWork, out) -> AsyncIterator[list[GenChunk | GenDone]]:
    """One request's messages (1. above); StreamBroken when its path broke."""
    rid, inbox = work.request_id, front.inbox
    order = ChunkOrder(work.n, work.generated())
    with front.dispatched(work, path_lost=True) as (reply, q):
        if not front.nc.is_connected:  # not sent yet: wait for the bus, in time
            await front.reconnected(work.deadline)
        await front.submit(work, reply)
        attempt = None  # the first dispatch attempt heard from owns the stream

        async def path_lost(lost: PathLost) -> None:
            if order.passed:  # under way: broken if chunks may be lost
                if lost.own:
                    raise StreamBroken(order.passed) from None
                return
            await front.reconnected(work.deadline)
            work.attempt += RESUBMITTED
            front.retried += 1
            inbox.retry_again(rid)
            await front.submit(work, reply)

        absent = 0

        async def no_scheduler(exc: NoScheduler) -> None:
            nonlocal absent
            if absent == NO_SCHEDULER_TRIES or not await front.schedulers.back(work.deadline):
                raise exc
            absent += 1
            front.retried += 1
            inbox.retry_again(rid)
            log.warning("request_retried", wire_id=rid, reason="no_scheduler")
            await front.submit(work, reply)

        while True:
            try:
                first = await inbox.next_result(q, rid, out)
            except PathLost as lost:
                await path_lost(lost)
                continue
            except NoScheduler as exc:  # nobody received it: sending it again is safe
                await no_scheduler(exc)
                continue
            except ServiceError as exc:
                if _worker_lost(exc):
                    raise WorkerLost(exc.message) from None
                raise
            ready, err = inbox.ready_results(q, out) if not q.empty() else ((), None)
            batch = []
            for ev in (first, *ready):
                if not isinstance(ev, (GenChunk, GenDone)):
                    continue
                if attempt is None:
                    attempt = ev.attempt
                elif ev.attempt != attempt:
                    continue
                if not order.take(ev):
                    continue
                out.version = ev.version or out.version
                if not out.first_token_at and isinstance(ev, GenChunk) and (
                        ev.tokens or ev.finish_reason):  # not a whole answer's progress note
                    out.first_token_at = time.perf_counter()
                batch.append(ev)
                if isinstance(ev, GenDone):
                    break
            if batch:
                yield batch
                if isinstance(batch[-1], GenDone):
                    return
            if isinstance(err, PathLost):  # queued behind what was read with it
                await path_lost(err)
            elif isinstance(err, NoScheduler) and not order.passed:
                await no_scheduler(err)
            elif _worker_lost(err):
                raise WorkerLost(err.message)
            elif err is not None:
                raise err
