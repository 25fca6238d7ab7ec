"""A model's aliases: which version is prod, which is the canary and for what share.

Aliases are one KV key per model. Every change is one revision-checked update:

1. Read the key (absent means empty `Aliases`).
2. Compute the new value from the current one (`promote`, `canary`, `rollback`,
   `abort_canary`); no change means no write.
3. Write it with the revision read in 1 (create when absent); when someone else wrote
   first, start again from 1.

The key's history (64 revisions) is the record of who served what, when: every
revision carries its change, its author and, for a service's change, its reason.
"""

from __future__ import annotations

from datetime import datetime, timezone
from typing import Awaitable, Callable, Protocol

import msgspec
from nats.js.errors import KeyNotFoundError, KeyWrongLastSequenceError, NotFoundError
from nats.js.kv import KV_DEL, KV_OP, KV_PURGE

from services.registry.errors import (
    IncompatibleVersion,
    InvalidWeight,
    NothingToRollBack,
    RegistryError,
)
from services.registry.keys import META_PREFIX, META_STREAM, alias_key, check_name
from services.registry.watch import AliasWatch, alias_change, decode_aliases
from shared.logging import get_logger
from shared.registry import Aliases, AliasChange, CanaryGuard, ModelVersion

log = get_logger("registry")

MAX_PREVIOUS = 32  # prod versions remembered for rollback
_CAS_ATTEMPTS = 16


class Versions(Protocol):
    """What aliases need to know about versions (`Registry` is one)."""

    async def get(self, name: str, version: str) -> ModelVersion | None: ...

    async def require(self, name: str, version: str) -> ModelVersion: ...


class AliasBook:
    """Reads and changes aliases; an alias only ever points at a ready version."""

    def __init__(self, js, kv, versions: Versions, actor: str) -> None:
        self._js = js
        self._kv = kv
        self._versions = versions
        self._actor = actor

    # --- reading

    async def aliases(self, name: str) -> Aliases:
        check_name("model name", name)
        entry = await self._entry(alias_key(name))
        return Aliases() if entry is None else decode_aliases(entry.value)

    async def history(self, name: str) -> list[AliasChange]:
        """Every kept revision of the model's aliases, oldest first: the stream's
        messages on the key's subject, one get each (a KV `history()` rests on a watch,
        whose end marker can come early: see `Registry._scan`)."""
        check_name("model name", name)
        subject = META_PREFIX + alias_key(name)
        out: list[AliasChange] = []
        seq = 1
        while True:
            try:
                msg = await self._js.get_msg(META_STREAM, seq=seq, subject=subject, next=True)
            except NotFoundError:
                return out
            if (msg.headers or {}).get(KV_OP) not in (KV_DEL, KV_PURGE) and msg.data:
                out.append(alias_change(msg.seq, decode_aliases(msg.data)))
            seq = msg.seq + 1

    def watch(self, name: str, include_current: bool = True) -> AliasWatch:
        """Async iterator of `Aliases`: the current value first, then every change."""
        check_name("model name", name)
        return AliasWatch(self._kv, alias_key(name), include_current)

    # --- changing

    async def promote(self, name: str, version: str) -> Aliases:
        """Point `prod` at `version`; the old prod is remembered for rollback."""
        mv = await self._versions.require(name, version)

        async def change(cur: Aliases) -> Aliases | None:
            if cur.prod == version:
                return None
            await self._check_kind(name, cur, mv)
            previous = (cur.previous + [cur.prod])[-MAX_PREVIOUS:] if cur.prod else cur.previous
            canary_stays = cur.canary and cur.canary != version
            return self._stamp(cur, "promote", prod=version, previous=previous,
                               canary=cur.canary if canary_stays else "",
                               canary_weight=cur.canary_weight if canary_stays else 0.0,
                               guard=cur.guard if canary_stays else None)

        return await self._change(name, change)

    async def canary(self, name: str, version: str, weight: float,
                     guard: CanaryGuard | None = None) -> Aliases:
        """Send `weight` of the traffic to `version`, the rest to prod; with a `guard`
        the telemetry service rolls it back on its own (CanaryGuard)."""
        weight = float(weight)
        if not 0.0 <= weight <= 1.0:  # NaN fails too
            raise InvalidWeight(f"canary weight must be within [0, 1], got {weight}")
        if guard is not None and not (guard.window_s > 0 and guard.min_requests >= 1
                                      and guard.error_margin >= 0 and guard.p95_margin >= 0):
            raise RegistryError(f"automatic rollback needs a window > 0, at least 1 request "
                                f"and margins >= 0, got {guard}")
        mv = await self._versions.require(name, version)

        async def change(cur: Aliases) -> Aliases:
            if not cur.prod:
                raise RegistryError(f"{name} has no prod version: promote one before a canary")
            if cur.prod == version:
                raise RegistryError(f"{name}@{version} is already prod")
            await self._check_kind(name, cur, mv)
            return self._stamp(cur, "canary", canary=version, canary_weight=weight, guard=guard)

        return await self._change(name, change)

    async def rollback(self, name: str) -> Aliases:
        """Move prod back to the version before it and clear the canary."""

        async def change(cur: Aliases) -> Aliases:
            if not cur.previous:
                raise NothingToRollBack(f"{name} has no earlier prod version to roll back to")
            return self._stamp(cur, "rollback", prod=cur.previous[-1],
                               previous=cur.previous[:-1], canary="", canary_weight=0.0,
                               guard=None)

        return await self._change(name, change)

    async def abort_canary(self, name: str, version: str, reason: str,
                           figures: dict[str, float]) -> Aliases | None:
        """Clear the canary if it is still `version` (prod stays), recording why and
        on what figures: the automatic rollback. None when the canary had changed."""
        done = False

        async def change(cur: Aliases) -> Aliases | None:
            nonlocal done
            if cur.canary != version:
                return None
            done = True
            return self._stamp(cur, "auto-rollback", canary="", canary_weight=0.0, guard=None,
                               reason=reason, figures=figures)

        new = await self._change(name, change)
        return new if done else None

    async def promote_if_unset(self, name: str, version: str, change: str = "seed") -> bool:
        """Create the aliases with prod = `version` unless the model has aliases already."""
        await self._versions.require(name, version)
        new = self._stamp(Aliases(), change, prod=version)
        try:
            await self._kv.create(alias_key(name), msgspec.json.encode(new))
        except KeyWrongLastSequenceError:
            return False
        return True

    async def _check_kind(self, name: str, cur: Aliases, mv: ModelVersion) -> None:
        if not cur.prod:
            return
        prod = await self._versions.get(name, cur.prod)
        if prod is not None and prod.kind != mv.kind:
            raise IncompatibleVersion(
                f"{name}@{mv.version} is a {mv.kind} but {name} serves a {prod.kind} "
                f"(prod {cur.prod}); push it under another name"
            )

    def _stamp(self, cur: Aliases, change: str, **fields) -> Aliases:
        fields.setdefault("reason", "")  # a reason belongs to the revision that gave it
        fields.setdefault("figures", {})
        return msgspec.structs.replace(cur, updated_at=datetime.now(timezone.utc),
                                       change=change, by=self._actor, **fields)

    async def _change(
        self, name: str, change: Callable[[Aliases], Awaitable[Aliases | None]]
    ) -> Aliases:
        """Steps 1-3: read, change, write with a revision check; retry when someone
        else won."""
        key = alias_key(name)
        for _ in range(_CAS_ATTEMPTS):
            entry = await self._entry(key)
            cur = Aliases() if entry is None else decode_aliases(entry.value)
            new = await change(cur)
            if new is None:
                return cur
            try:
                if entry is None:
                    await self._kv.create(key, msgspec.json.encode(new))
                else:
                    await self._kv.update(key, msgspec.json.encode(new), last=entry.revision)
            except KeyWrongLastSequenceError:
                continue
            log.info("aliases_changed", model=name, change=new.change, prod=new.prod,
                     canary=new.canary, canary_weight=new.canary_weight, by=new.by,
                     reason=new.reason or None)
            return new
        raise RegistryError(f"aliases of {name} changed concurrently too often; try again")

    async def _entry(self, key: str):
        try:
            return await self._kv.get(key)
        except KeyNotFoundError:
            return None
