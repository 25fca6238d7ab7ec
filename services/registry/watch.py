"""Following a model's aliases through a KV watch (what triggers a worker's hot swap)."""

from __future__ import annotations

import msgspec
from nats.js.kv import KV_DEL, KV_PURGE, KeyValue, StopIterSentinel

from shared.registry import Aliases, AliasChange

_aliases = msgspec.json.Decoder(Aliases)


def decode_aliases(data: bytes) -> Aliases:
    return _aliases.decode(data)


def alias_change(revision: int, a: Aliases) -> AliasChange:
    return AliasChange(revision, a.updated_at, a.change, a.prod, a.canary, a.canary_weight, a.by,
                       a.reason, a.figures, a.guard is not None)


class AliasWatch:
    """Async iterator of a model's `Aliases`, one per KV revision.

    With `include_current` the value at the time of the first `__anext__` comes first
    (when there is one), so a consumer needs no separate read to start. A deleted key
    yields empty `Aliases()`. Use as `async with` (or call `stop()`) to end the watch
    promptly; breaking out of a bare `async for` leaves the subscription until GC.
    """

    def __init__(self, kv, key: str, include_current: bool = True) -> None:
        self._kv = kv
        self._key = key
        self._include_current = include_current
        self._watcher: KeyValue.KeyWatcher | None = None
        self._caught_up = False
        self._stopped = False

    async def start(self) -> "AliasWatch":
        if self._watcher is None and not self._stopped:
            self._watcher = await self._kv.watch(self._key)
        return self

    async def stop(self) -> None:
        """End the watch; a pending `__anext__` raises StopAsyncIteration. Idempotent."""
        self._stopped = True
        watcher, self._watcher = self._watcher, None
        if watcher is not None:
            await watcher.stop()

    async def __aenter__(self) -> "AliasWatch":
        return await self.start()

    async def __aexit__(self, *exc) -> None:
        await self.stop()

    def __aiter__(self) -> "AliasWatch":
        return self

    async def __anext__(self) -> Aliases:
        await self.start()
        while not self._stopped:
            # start() set it; only stop() clears it, and that sets _stopped first.
            assert self._watcher is not None
            entry = await self._watcher.updates(timeout=None)
            if isinstance(entry, StopIterSentinel):
                break
            if entry is None:  # end of the initial value; changes follow
                self._caught_up = True
                continue
            if not self._caught_up and not self._include_current:
                continue
            if entry.operation in (KV_DEL, KV_PURGE):
                return Aliases()
            return decode_aliases(entry.value)
        raise StopAsyncIteration
