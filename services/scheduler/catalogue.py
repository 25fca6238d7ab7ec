"""The models a scheduler knows, served or not: what its scaling decisions cover.

  1. Seeded at start with the bundled catalogue (name and kind) and the names in
     `TENSORBUS_FLEET`.
  2. `note()` adds what the bus shows: a heartbeat's model and kind, a submitted
     request's model (the gateway resolved it, so it exists).
  3. `refresh()` adds the registry's models (their kind from the prod version's
     record, read once per name); called in the background (`run`: every
     REFRESH_S), never on a request's path.
"""

from __future__ import annotations

import asyncio

from shared import catalog
from shared.config import parse_fleet
from shared.logging import get_logger

log = get_logger("scheduler.catalogue")

REFRESH_S = 10.0  # how often the registry's model list is read again


class Catalogue:
    def __init__(self, fleet_spec: str = "", registry=None,
                 bundled: list[catalog.ModelInfo] | None = None) -> None:
        self.registry = registry
        self.kinds: dict[str, str] = {}  # name -> encoder | decoder | "" (unknown yet)
        for info in catalog.bundled() if bundled is None else bundled:
            self.kinds[info.name] = info.kind
        for name in parse_fleet(fleet_spec):
            self.kinds.setdefault(name, "")

    def note(self, model: str, kind: str = "") -> None:
        if kind or model not in self.kinds:
            self.kinds[model] = kind or self.kinds.get(model, "")

    def names(self) -> list[str]:
        return sorted(self.kinds)

    def kind(self, model: str) -> str:
        return self.kinds.get(model, "")

    async def refresh(self) -> None:
        if self.registry is None:
            return
        for name in await self.registry.list_models():
            if self.kinds.get(name):
                continue
            self.note(name, await self._kind(name))

    async def run(self, stop: asyncio.Event) -> None:
        """`refresh()` every REFRESH_S until `stop`; a failed read is logged, and the
        scheduler's decisions go on with what is known."""
        while not stop.is_set():
            try:
                await self.refresh()
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # noqa: BLE001 - decisions go on with what is known
                log.warning("catalogue_refresh_failed", error=f"{type(exc).__name__}: {exc}")
            await asyncio.sleep(REFRESH_S)

    async def _kind(self, name: str) -> str:
        aliases = await self.registry.aliases(name)
        mv = await self.registry.get(name, aliases.prod) if aliases.prod else None
        if mv is None:
            versions = await self.registry.versions(name)
            mv = versions[-1] if versions else None
        return mv.kind if mv is not None else ""
