"""What a worker runs, seen from the worker: one small interface and a narrow outbox.

A worker owns the NATS side (inbox, heartbeats, drain) and hands each request to a
`Runner`: the encoder runner (`batcher.EncoderRunner`, dynamic batching) or the
decoder runner (`generation.DecoderRunner`, continuous batching). A runner never sees
the Worker; it gets an `Outbox` (publish a result, an error, report what finished) and
the `LoadedModels` (which engine serves which version, looked up when used).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Protocol

from nats.aio.client import Client

from shared import subjects
from shared.errors import ServiceError
from shared.messages import WorkDone, WorkError, WorkRequest, encode


@dataclass
class Gauges:
    """A runner's load, as the heartbeat reports it."""

    queue_depth: int  # requests (encoders) or sequences (decoders) not started yet
    in_flight: int  # requests computing (encoders) or sequences holding a slot (decoders)
    capacity: int  # inputs per batch (encoders) or decode slots (decoders)
    occupancy: float  # mean fill of a batch or of the slots since the last heartbeat
    steps: int  # engine calls finished since start (forward-progress check)
    slots_total: int = 0  # decoders: KV slots of the engines traffic goes to
    slots_used: int = 0
    kv_usage: float = 0.0  # decoders: fraction of the KV cache blocks held (all engines)
    running: int = 0  # decoders: sequences holding a slot (prefilling or decoding)
    waiting: int = 0  # decoders: sequences queued for a slot or cache room
    kv_blocks_total: int = 0
    kv_blocks_used: int = 0
    prefix_cache_queries: int = 0  # prompt tokens looked up, since start
    prefix_cache_hits: int = 0  # of those, tokens reused
    preemptions: int = 0  # since start
    prefix_block: int = 0  # decoders: tokens per prefix key (0: none)
    prefix_keys: list[int] = field(default_factory=list)  # short keys of cached prefixes


class Runner(Protocol):
    """Batches a worker's requests onto its engines. One per worker."""

    work_type: type  # the WorkRequest it runs (EmbedWork | GenerateWork); others are refused

    def submit(self, work: WorkRequest) -> None:
        """Queue one request; its answer goes out through the outbox."""

    def cancel(self, request_id: str) -> None:
        """Stop a request early (a no-op where a request is one engine call)."""

    @property
    def queue_depth(self) -> int: ...

    @property
    def in_flight(self) -> int: ...

    @property
    def steps(self) -> int: ...

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
    """Where a runner's answers go: the request's reply subject, and the dispatching
    scheduler's done subject. All a runner may say on the bus."""

    def __init__(self, nc: Client, worker_id: str, model: str,
                 prod: Callable[[], str] = lambda: "") -> None:
        self.nc = nc
        self.worker_id = worker_id
        self.model = model
        self.prod = prod  # the version unpinned work runs on now

    async def publish(self, reply: str, message) -> None:
        """A result for the requester (EmbedResult, GenChunk, GenDone)."""
        if reply:
            await self.nc.publish(reply, encode(message))

    async def error(self, work: WorkRequest, err: ServiceError, version: str = "") -> None:
        """`version`: the one that failed it, when known; else the pinned one or prod
        (telemetry counts the failure against it: canary rollback)."""
        if work.reply:
            await self.nc.publish(work.reply, encode(WorkError(
                work.request_id, err.status, err.message, err.code, err.retry_after,
                self.worker_id, version or work.version or self.prod())))

    async def done(self, done: dict[str, list[str]], compute_s: float = 0.0, tokens: int = 0) -> None:
        """These requests are finished: one WorkDone per dispatching scheduler."""
        for sched_id, ids in done.items():
            if sched_id and ids:
                await self.nc.publish(subjects.sched_done(sched_id),
                                      encode(WorkDone(self.worker_id, ids, compute_s, tokens)))

    async def refuse(self, work: WorkRequest, err: ServiceError) -> None:
        """Answer `work` with an error and report it finished."""
        await self.error(work, err)
        await self.done({work.sched_id: [work.request_id]})
