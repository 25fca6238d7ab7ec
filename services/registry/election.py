"""The registry through a JetStream election: a lost server that led the registry's
streams (or JetStream's meta group) leaves them without a leader for a few seconds,
and every call meanwhile fails with a timeout or a 503. A push or an alias change
started then succeeds after the election instead (docs/decisions/0053-node-loss.md).

  1. `through(fn)`: `fn()` again after such a failure, with a growing pause (0.1 s
     to 1 s), for up to ELECTION_S; any other failure is raised at once.
  2. `SteadyKV`: the registry's KV bucket, its reads and writes through (1). A write
     whose earlier try was stored although its ack was lost finds the key already at
     a newer revision: when the key now holds exactly the bytes it wrote (every value
     carries its author and time), that write is taken as done, not as a conflict.
  3. File uploads are tried again whole, each from its first byte
     (services.registry.push): an object put under the same name replaces the
     earlier one.
"""

from __future__ import annotations

import asyncio
import time

import nats.errors
from nats.js.errors import (
    KeyNotFoundError,
    KeyWrongLastSequenceError,
    NoStreamResponseError,
    ServiceUnavailableError,
)

from shared.logging import get_logger

log = get_logger("registry")

ELECTION_S = 30.0  # longer than a stream's or the meta group's election after a lost server
TRANSIENT = (nats.errors.TimeoutError, nats.errors.NoRespondersError,
             nats.errors.ConnectionReconnectingError, NoStreamResponseError,
             ServiceUnavailableError)


async def through(fn, what: str, bound: float = ELECTION_S):
    """`await fn()`, tried again after a transient JetStream failure for up to `bound`
    seconds."""
    end = time.monotonic() + bound
    pause = 0.1
    while True:
        try:
            return await fn()
        except TRANSIENT as exc:
            if time.monotonic() + pause > end:
                raise
            log.warning("registry_retry", what=what, error=str(exc) or type(exc).__name__)
        await asyncio.sleep(pause)  # a back-off before the next try, not a synchronisation
        pause = min(pause * 2, 1.0)


class SteadyKV:
    """A nats-py KeyValue whose get, create and update go through elections; the
    rest is the bucket's own."""

    def __init__(self, kv) -> None:
        self._kv = kv

    def __getattr__(self, name: str):
        return getattr(self._kv, name)

    async def get(self, key: str):
        return await through(lambda: self._kv.get(key), f"get {key}")

    async def create(self, key: str, value: bytes) -> int:
        return await self._write(key, value, lambda: self._kv.create(key, value))

    async def update(self, key: str, value: bytes, last: int | None = None) -> int:
        return await self._write(key, value, lambda: self._kv.update(key, value, last=last))

    async def _write(self, key: str, value: bytes, write) -> int:
        tries = 0

        async def once() -> int:
            nonlocal tries
            tries += 1
            try:
                return await write()
            except KeyWrongLastSequenceError as conflict:
                if tries > 1:  # an earlier try of this write may be the one stored
                    try:
                        entry = await self._kv.get(key)
                    except KeyNotFoundError:
                        raise conflict from None
                    if entry.value == value:
                        return entry.revision
                raise
        return await through(once, f"write {key}")
