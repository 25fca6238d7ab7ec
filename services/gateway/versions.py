"""Registry models at the gateway: which version a request is tokenized for, and that
version's tokenizer files, never its weights.

Names the catalogue knows keep one tokenizer (the bundled one). For any other name,
per request:

  1. Aliases come from a KV watch per name that has some (`AliasTable`, the cache
     the scheduler routes by; until its first value arrives, one KV read).
  2. The version: the one the client pinned (`NAME@V`); else the draw the scheduler
     would make (`choose_version`: canary with its weight, sticky per user, else prod)
     when ready workers hold it or none is ready yet (a cold start loads prod); else
     prod, or another version, that ready workers hold (a promotion still loading);
     else earlier prods. A version whose files cannot be fetched is skipped.
  3. Its tokenizer files (`Registry.fetch_tokenizer`: tokenizer, chat template and
     configs, or a GGUF file's header) are fetched once, verified, into
     `cache_dir/NAME/VERSION/`; `ModelTable` keeps one entry per (name, version).
  4. The work is pinned to that version when another version an unpinned request
     could run on (those ready workers hold, prod, canary) has other tokenizer files:
     the ids were made for it. When all agree, the work stays unpinned and the
     scheduler routes it as before.
"""

from __future__ import annotations

import asyncio
import random
from pathlib import Path

from services.fleet import Fleet
from services.gateway.models import Resolved, Resolver, catalogue_resolver
from services.registry.errors import RegistryError
from services.registry.routing import choose_version
from services.registry.alias_table import AliasTable
from shared import catalog
from shared.logging import get_logger
from shared.registry import Aliases, ModelVersion

log = get_logger("gateway.versions")


def tokenizer_digest(mv: ModelVersion) -> tuple[tuple[str, str], ...]:
    """What tells two versions' tokenizer files apart: their paths and sha256s (a record
    from before `tokenizer` was stored: its files other than weights, or all of them)."""
    from services.registry.files import gateway_files

    files = mv.tokenizer or gateway_files(mv.files) or mv.files
    return tuple(sorted((e.path, e.sha256) for e in files))


class RegistryVersions:
    """A `ModelTable` resolver: `fallback` first (the catalogue), else the registry."""

    def __init__(self, registry, cache_dir: str | Path, fleet: Fleet | None = None,
                 fallback: Resolver = catalogue_resolver,
                 rng: random.Random | None = None) -> None:
        self.registry = registry
        self.cache = Path(cache_dir)
        self.fleet = fleet
        self.fallback = fallback
        self.aliases = AliasTable(registry, rng) if registry is not None else None
        self._records: dict[tuple[str, str], ModelVersion] = {}
        self._infos: dict[tuple[str, str], catalog.ModelInfo] = {}
        self._locks: dict[tuple[str, str], asyncio.Lock] = {}
        self._unlisted: set[str] = set()  # registry names (the fallback's list is fixed)

    async def __call__(self, name: str, version: str = "",
                       user: str = "") -> Resolved | catalog.ModelInfo | None:
        if name not in self._unlisted:
            found = await self.fallback(name, version, user)
            if found is not None or self.registry is None:
                return found
        if version:
            try:
                return Resolved(await self._info(name, version), version, version)
            except RegistryError as exc:  # not there: the scheduler answers the pin (503)
                log.warning("model_version_unusable", model=name, version=version,
                            error=str(exc))
        try:
            a = await self._aliases(name)
        except RegistryError as exc:
            log.warning("model_unresolved", model=name, error=str(exc))
            return None
        held = list(dict.fromkeys(v for w in (self.fleet.ready(name) if self.fleet else [])
                                  for v in w.hb.versions))
        assert self.aliases is not None  # a registry's name, as in _aliases
        drawn = choose_version(a, self.aliases.rng, user) if (a.prod or a.canary) else ""
        order = [drawn] if drawn and (drawn in held or not held) else []
        order += [a.prod] if a.prod in held else []
        order += held + [a.prod] + a.previous[::-1]
        for v in dict.fromkeys(x for x in order if x):
            try:
                info = await self._info(name, v)
                pin = await self._pin(name, v, held + [a.prod, a.canary])
            except RegistryError as exc:
                log.warning("model_version_unusable", model=name, version=v, error=str(exc))
                continue
            self._unlisted.add(name)  # a registry name: no fallback lookup from now on
            return Resolved(info, v, version or pin)
        return None

    async def _aliases(self, name: str) -> Aliases:
        """Cached by a watch, which starts once the name has aliases (a client's
        made-up names cost a KV read each, never a watch)."""
        assert self.aliases is not None  # past the fallback: there is a registry
        cached = self.aliases.aliases.get(name)
        if cached is not None:
            return cached
        a = await self.registry.aliases(name)
        if a.prod or a.canary:
            self.aliases.track(name)
        return a

    async def _record(self, name: str, version: str) -> ModelVersion:
        key = (name, version)
        if key not in self._records:  # a ready record never changes
            self._records[key] = await self.registry.require(name, version)
        return self._records[key]

    async def _pin(self, name: str, version: str, others: list[str]) -> str:
        """`version` when an unpinned request could run on a version with other
        tokenizer files, else "" (the scheduler's routing, unchanged)."""
        mine = tokenizer_digest(await self._record(name, version))
        for other in dict.fromkeys(o for o in others if o and o != version):
            try:
                theirs = tokenizer_digest(await self._record(name, other))
            except RegistryError:
                return version  # unknown: keep the ids with the version they were made for
            if theirs != mine:
                return version
        return ""

    async def _info(self, name: str, version: str) -> catalog.ModelInfo:
        key = (name, version)
        if key in self._infos:
            return self._infos[key]
        async with self._locks.setdefault(key, asyncio.Lock()):
            if key not in self._infos:
                path = await self.registry.fetch_tokenizer(name, version,
                                                           self.cache / name / version)
                log.info("model_from_registry", model=name, version=version)
                self._infos[key] = catalog.describe(name, path)
        return self._infos[key]

    async def stop(self) -> None:
        if self.aliases is not None:
            await self.aliases.stop()
