"""A generation's chunks in order, or a clear end: the gateway's check that what it
passes on is every chunk of one dispatch attempt, once each, in order.

A lost nats-server can take chunks with it (the gateway's, or the worker's, path
through it), and a re-dispatch or a duplicate delivery can bring one twice. Every
chunk carries its number among its choice's chunks of that attempt (`GenChunk.seq`,
from 0); here, per choice:

  - the number expected: passed on;
  - a lower one (already passed on): dropped, so no token reaches the client twice;
  - a higher one (one or more lost on the way): the stream ends with a 503
    `stream_broken` error chunk, never with a silent gap;
  - the GenDone when a choice has not sent its last chunk (it was lost): the same.

A stream already under way when the gateway's own connection drops ends the same way
at once (services.gateway.generation): what was on its way may be gone, and its end
would otherwise come only at the stall timeout. Resuming such a stream from its last
delivered token is not done (docs/decisions/0053-node-loss.md).
"""

from __future__ import annotations

from shared.errors import ServiceError
from shared.messages import GenChunk, GenDone


def stream_broken(delivered: int) -> ServiceError:
    return ServiceError(
        503, f"the generation's path through the message bus was lost after {delivered} "
        "chunks (a server of the cluster was lost); its rest cannot be delivered: retry "
        "the request", code="stream_broken", retry_after=1.0)


class ChunkOrder:
    def __init__(self, n: int) -> None:
        self.expect = [0] * n  # per choice: the next chunk's number
        self.finished = [False] * n
        self.passed = 0  # chunks passed on, all choices
        self.dropped = 0  # duplicates dropped

    def take(self, ev: GenChunk | GenDone) -> bool:
        """Whether to pass `ev` on (False: a duplicate); ServiceError when a chunk
        was lost."""
        if isinstance(ev, GenDone):
            if not all(self.finished):
                raise stream_broken(self.passed)
            return True
        want = self.expect[ev.index]
        if ev.seq < want:
            self.dropped += 1
            return False
        if ev.seq > want:
            raise stream_broken(self.passed)
        self.expect[ev.index] = want + 1
        self.passed += 1
        if ev.finish_reason:
            self.finished[ev.index] = True
        return True
