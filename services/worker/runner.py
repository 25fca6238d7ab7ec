"""What a worker runs, seen from the worker: one small interface and a narrow outbox.

A worker owns the NATS side (inbox, heartbeats, drain) and hands each request to a
`Runner`: the encoder runner (`batcher.EncoderRunner`, dynamic batching) or the
decoder runner (`generation.DecoderRunner`, continuous batching). A runner never sees
the Worker; it gets an `Outbox` (stage a result or an error, flush them to the
gateways, report what finished) and the `LoadedModels` (which engine serves which
version, looked up when used).
"""

from __future__ import annotations

import asyncio
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Callable, Protocol, TypeVar

from nats.aio.client import Client

from shared import subjects
from shared.costs import GenCostBook
from shared.errors import ServiceError
from shared.logging import get_logger
from shared.messages import Results, WorkDone, WorkError, WorkRequest, encode

log = get_logger("worker.outbox")

W = TypeVar("W", bound=WorkRequest)


@dataclass
class Gauges:
    """A runner's load, as the heartbeat reports it."""

    # The heartbeat's fields of the same names (shared.telemetry.Heartbeat): each
    # value once, for encoders and decoders alike.
    queue_depth: int  # requests (encoders) or sequences (decoders) not started yet
    in_flight: int  # requests computing (encoders) or sequences holding a slot (decoders)
    max_batch: int  # inputs per batch (encoders) or decode slots (decoders)
    occupancy: float  # mean fill of a batch or of the slots since the last heartbeat
    steps: int  # engine calls finished since start (forward-progress check)
    kv_blocks_total: int = 0  # decoders: KV cache blocks of every loaded engine
    kv_blocks_used: int = 0  # of those, held by sequences
    prefix_cache_queries: int = 0  # prompt tokens looked up, since start
    prefix_cache_hits: int = 0  # of those, tokens reused
    preemptions: int = 0  # since start
    spec_decode_drafts: int = 0  # speculative verify passes (one draft each), since start
    spec_decode_draft_tokens: int = 0  # draft tokens they checked
    spec_decode_accepted_tokens: int = 0  # of those, accepted
    prefix_block: int = 0  # decoders: tokens per prefix key (0: none)
    prefix_keys: list[int] = field(default_factory=list)  # short keys of cached prefixes


class Runner(Protocol[W]):
    """Batches a worker's requests onto its engines. One per worker. `W`: the
    WorkRequest it runs (EmbedWork | GenerateWork)."""

    @property
    def work_type(self) -> type[W]:
        """The WorkRequest it runs; others are refused."""

    @property
    def costs(self) -> GenCostBook | None:
        """A cost fitted to its own steps (decoders); None: warm-up's."""

    def submit(self, work: W) -> None:
        """Queue one request; its answer goes out through the outbox."""

    def cancel(self, request_id: str) -> None:
        """Stop a request early: one still queued is never computed; either way its
        scheduler hears it is done (an encoder batch already computing finishes)."""

    @property
    def queue_depth(self) -> int: ...

    @property
    def in_flight(self) -> int: ...

    @property
    def steps(self) -> int: ...

    @property
    def compiling(self) -> bool:
        """Whether a step waits on a program being compiled (slow, not stalled)."""

    def gauges(self) -> Gauges:
        """Load for the heartbeat (reading it restarts the occupancy window)."""

    def uses(self, version: str) -> bool:
        """Whether running or queued work needs `version` loaded."""

    async def wait_unused(self, version: str) -> None:
        """Until nothing running or queued needs `version`."""

    async def drain(self) -> None:
        """Take nothing new; return when everything held is answered."""

    async def run(self) -> None:
        """The batching loop, until cancelled or drained."""


class Outbox:
    """Where a runner's answers go: the request's gateway, and the dispatching
    scheduler's done subject. All a runner may say on the bus.

    Answers are staged, not sent one by one: `flush()` sends everything staged as
    one `Results` message per gateway (the work's `group` subject), so a decode step
    of 16 streams costs each gateway one message instead of 16. Work without a
    `group` (a requester that is not a gateway) gets each answer on its `reply`
    alone, in the same order. The decoder runner holds the outbox over each step
    (`held()`: one flush at its end); `done()` flushes first (the scheduler hears a
    request finished only after its answer went out), which ends each encoder
    batch; anything else staged is flushed when the event loop next runs, so no
    answer waits on a later step.
    """

    def __init__(self, nc: Client, worker_id: str, model: str,
                 prod: Callable[[], str] = lambda: "") -> None:
        self.nc = nc
        self.worker_id = worker_id
        self.model = model
        self.prod = prod  # the version unpinned work runs on now
        self._staged: list[tuple[str, str, object]] = []  # (group, reply, message)
        self._sending = asyncio.Lock()  # flushes go out whole and in order
        self._soon: asyncio.Handle | None = None
        self._flushes: set[asyncio.Task] = set()  # the loop keeps only weak references
        self._held = 0  # inside held(): no flush until it ends

    @property
    def max_payload(self) -> int:
        """The largest message the bus carries (0: unknown)."""
        return self.nc.max_payload

    async def publish(self, work: WorkRequest, message) -> None:
        """Stage a result for the requester of `work` (EmbedResult, GenChunk, GenDone)."""
        self._stage(work, message)

    async def error(self, work: WorkRequest, err: ServiceError, version: str = "") -> None:
        """`version`: the one that failed it, when known; else the pinned one or prod
        (telemetry counts the failure against it: canary rollback)."""
        self._stage(work, WorkError(
            work.request_id, err.status, err.message, err.code, err.retry_after,
            self.worker_id, version or work.version or self.prod()))

    def _stage(self, work: WorkRequest, message) -> None:
        if not work.reply and not work.group:
            return
        self._staged.append((work.group, work.reply, message))
        if self._soon is None and not self._held:
            self._soon = asyncio.get_running_loop().call_soon(self._flush_later)

    def _flush_later(self) -> None:
        self._soon = None
        if self._staged and not self._held:
            task = asyncio.get_running_loop().create_task(self._flush_logged())
            self._flushes.add(task)
            task.add_done_callback(self._flushes.discard)

    async def _flush_logged(self) -> None:
        try:
            await self.flush()
        except Exception as exc:  # noqa: BLE001 - the bus is down: the requests time out
            log.warning("results_not_sent", error=repr(exc))

    @asynccontextmanager
    async def held(self):
        """What is staged inside goes out together, at the end (a runner's step spans
        awaits: the engine thread frees slots while the step's chunks wait)."""
        self._held += 1
        try:
            yield
        finally:
            self._held -= 1
        if not self._held:
            await self.flush()

    async def flush(self) -> None:
        """Send everything staged: one message per gateway, in staging order."""
        if not self._staged:
            return
        staged, self._staged = self._staged, []
        async with self._sending:
            for subject, payload in grouped(staged, self.nc.max_payload):
                await self.nc.publish(subject, payload)

    async def done(self, done: dict[str, list[str]], compute_s: float = 0.0, tokens: int = 0) -> None:
        """These requests are finished: one WorkDone per dispatching scheduler."""
        await self.flush()
        for sched_id, ids in done.items():
            if sched_id and ids:
                await self.nc.publish(subjects.sched_done(sched_id),
                                      encode(WorkDone(self.worker_id, ids, compute_s, tokens)))

    async def refuse(self, work: WorkRequest, err: ServiceError) -> None:
        """Answer `work` with an error and report it finished."""
        await self.error(work, err)
        await self.done({work.sched_id: [work.request_id]})


def grouped(staged: list[tuple[str, str, object]], max_payload: int) -> list[tuple[str, bytes]]:
    """(subject, payload) to publish for `staged` (group, reply, message) entries: one
    `Results` per group, in the order of its first entry, split where one would
    exceed `max_payload`; an entry without a group is its own message to its reply."""
    groups: dict[str, list] = {}
    out: list[tuple[str, object]] = []
    for group, reply, message in staged:
        if not group:
            out.append((reply, message))
        elif group in groups:
            groups[group].append(message)
        else:
            groups[group] = items = [message]
            out.append((group, items))
    sent: list[tuple[str, bytes]] = []
    for subject, what in out:
        if isinstance(what, list):
            sent += [(subject, payload) for payload in _packed(what, max_payload)]
        else:
            sent.append((subject, encode(what)))
    return sent


def _packed(items: list, max_payload: int) -> list[bytes]:
    """`Results(items)` encoded, halved until each part fits (one item always goes)."""
    payload = encode(Results(items))
    if len(payload) <= max_payload or len(items) == 1:
        return [payload]
    half = len(items) // 2
    return _packed(items[:half], max_payload) + _packed(items[half:], max_payload)
