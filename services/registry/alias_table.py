"""Each model's aliases, cached and kept fresh: what the scheduler routes by, what the
gateway tokenizes for, what telemetry's canary guard compares.

  1. A model not seen before (in a heartbeat, a request, a record): `track()` starts a
     KV watch on its aliases (one per model, restarted with back-off if it fails).
  2. Every revision replaces the cached `Aliases`; routing reads the cache, so a
     request never waits on the registry.
  3. `choose(model, user)` is one request's draw (canary with probability
     `canary_weight`, else prod; sticky per user when the request names one); ""
     when the registry has no entry, meaning any version.
"""

from __future__ import annotations

import asyncio
import random

from nats.errors import ConnectionClosedError

from services.registry.errors import RegistryError
from services.registry.routing import choose_version
from services.registry.store import Registry
from shared.logging import get_logger
from shared.registry import NAME_RE, Aliases

log = get_logger("registry.alias_table")

_RETRY_S = (0.5, 1.0, 2.0, 5.0)


class AliasTable:
    """Cached aliases of every model tracked, kept fresh by KV watches."""

    def __init__(self, registry: Registry, rng: random.Random | None = None) -> None:
        self.registry = registry
        self.rng = rng or random.Random()
        self.aliases: dict[str, Aliases] = {}
        self._watches: dict[str, asyncio.Task] = {}
        self._seen = asyncio.Condition()
        self._closed = False

    def track(self, model: str) -> None:
        """Follow `model`'s aliases from now on (idempotent; call on the event loop)."""
        if self._closed or model in self._watches or not NAME_RE.match(model):
            return
        self._watches[model] = asyncio.create_task(self._follow(model))

    def choose(self, model: str, user: str = "") -> str:
        """The version for one request: canary draw, else prod; "" = any version."""
        a = self.aliases.get(model)
        return choose_version(a, self.rng, user) if a is not None else ""

    def prod(self, model: str) -> str:
        a = self.aliases.get(model)
        return a.prod if a is not None else ""

    async def wait_for(self, model: str, predicate, timeout: float = 10.0) -> Aliases:
        """Until the cached aliases of `model` satisfy `predicate` (tests, benchmarks)."""
        self.track(model)

        def ok() -> bool:
            a = self.aliases.get(model)
            return a is not None and predicate(a)

        async with self._seen:
            await asyncio.wait_for(self._seen.wait_for(ok), timeout)
        return self.aliases[model]

    async def _follow(self, model: str) -> None:
        attempt = 0
        while not self._closed:
            try:
                async with self.registry.watch_aliases(model) as watch:
                    async for aliases in watch:
                        attempt = 0
                        await self._store(model, aliases)
            except asyncio.CancelledError:
                raise
            except ConnectionClosedError:
                return  # shutting down
            except RegistryError as exc:
                log.warning("alias_watch_refused", model=model, error=str(exc))
                return
            except Exception as exc:  # noqa: BLE001 - routing goes on with the cache
                log.warning("alias_watch_failed", model=model, error=str(exc))
            await asyncio.sleep(_RETRY_S[min(attempt, len(_RETRY_S) - 1)])
            attempt += 1

    async def _store(self, model: str, aliases: Aliases) -> None:
        if aliases.prod or aliases.canary:
            self.aliases[model] = aliases
        else:  # deleted, or never set: any version serves
            self.aliases.pop(model, None)
        log.info("aliases_seen", model=model, prod=aliases.prod or None,
                 canary=aliases.canary or None, canary_weight=aliases.canary_weight)
        async with self._seen:
            self._seen.notify_all()

    async def stop(self) -> None:
        self._closed = True
        watches, self._watches = list(self._watches.values()), {}
        for task in watches:
            task.cancel()
        if watches:  # bounded: a cancellation inside a client call may be swallowed
            await asyncio.wait(watches, timeout=2.0)
