"""A lease per batch: several batch runners share the batches, never one batch.

The lease is the KV key `leases.<batch_id>` in the batches bucket
(services/batchstore.py), its value `{runner, renewed_at}` (for people; the rules
use only revisions). Every write is a compare-and-set on the key's revision:

- take: `create`, which only one runner wins; a key its holder released (deleted)
  is free again.
- renew: the holder `update`s it at the revision it wrote last, every third of
  `ttl_s` (TENSORBUS_BATCH_LEASE_S). A conflict means another runner took it over:
  the lease is lost and its job stops. A renewal that fails otherwise (the bus
  away a moment) is tried again while the lease cannot yet have been taken over.
- take over: a runner that sees a lease's revision unchanged for `ttl_s` of its own
  monotonic clock (no clocks are compared between machines) holds a dead runner's
  lease: it `update`s it at that revision, which one runner wins.
- release: when the job ends (its batch final, or the runner stopping) the holder
  deletes it at its own revision, so another runner may take it at once.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable

import msgspec
from nats.errors import Error as NatsError
from nats.js.errors import KeyDeletedError, KeyNotFoundError, KeyWrongLastSequenceError

from shared.logging import get_logger

log = get_logger("batch")
_encode = msgspec.json.Encoder().encode


@dataclass
class Lease:
    batch_id: str
    revision: int
    renewed: float = field(default=0.0)  # the holder's clock at its last write

    @property
    def key(self) -> str:
        return f"leases.{self.batch_id}"


class Leases:
    """This runner's side of the leases: `take`, `renew`, `release`."""

    def __init__(self, kv, owner: str, ttl_s: float,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.kv = kv
        self.owner = owner
        self.ttl_s = ttl_s
        self.clock = clock
        self.seen: dict[str, tuple[int, float]] = {}  # others' leases: revision, first seen

    @property
    def renew_s(self) -> float:
        return max(self.ttl_s / 3, 0.05)

    async def take(self, batch_id: str) -> Lease | None:
        """The batch's lease, now this runner's; None while another runner holds it
        (it is taken over once it has not moved for `ttl_s`)."""
        key = f"leases.{batch_id}"
        try:
            entry = await self.kv.get(key)
        except (KeyNotFoundError, KeyDeletedError):
            entry = None
        now = self.clock()
        if entry is None:
            try:
                revision = await self.kv.create(key, self._value())
            except KeyWrongLastSequenceError:
                return None  # another runner was first
            self.seen.pop(batch_id, None)
            return Lease(batch_id, revision, now)
        seen = self.seen.get(batch_id)
        if seen is None or seen[0] != entry.revision:
            self.seen[batch_id] = (entry.revision, now)  # its holder is alive
            return None
        if now - seen[1] < self.ttl_s:
            return None
        try:
            revision = await self.kv.update(key, self._value(), last=entry.revision)
        except KeyWrongLastSequenceError:
            return None  # renewed after all, or another runner took it first
        self.seen.pop(batch_id, None)
        log.warning("batch_lease_taken_over", batch_id=batch_id, runner=self.owner,
                    silent_s=round(now - seen[1], 1))
        return Lease(batch_id, revision, now)

    async def renew(self, lease: Lease) -> bool:
        """False once the lease is lost (another runner holds it)."""
        now = self.clock()
        try:
            lease.revision = await self.kv.update(lease.key, self._value(), last=lease.revision)
        except KeyWrongLastSequenceError:
            log.warning("batch_lease_lost", batch_id=lease.batch_id, runner=self.owner)
            return False
        except NatsError as exc:  # not answered: ours while no one can have taken it
            log.warning("batch_lease_not_renewed", batch_id=lease.batch_id, error=str(exc))
            return now - lease.renewed < self.ttl_s
        lease.renewed = now
        return True

    async def release(self, lease: Lease) -> None:
        try:
            await self.kv.delete(lease.key, last=lease.revision)
        except KeyWrongLastSequenceError:
            pass  # no longer ours
        except NatsError as exc:  # taken over once it stops moving
            log.warning("batch_lease_not_released", batch_id=lease.batch_id, error=str(exc))

    def forget(self, batch_id: str) -> None:
        self.seen.pop(batch_id, None)

    def _value(self) -> bytes:
        return _encode({"runner": self.owner, "renewed_at": int(time.time())})
