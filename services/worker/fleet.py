"""A worker's share of the fleet's compiled programs (services/registry/programs.py).

  1. Before a version is built, the programs the registry holds for it and for this
     process's fingerprint are pulled into the local compilation cache folder: the
     engine's compiles of those shapes become reads.
  2. Every `PUBLISH_S` (and once more when the worker stops), the cache entries that
     appeared in the folder since this process started, and that it did not pull, are
     published under the newest version built here: the programs this worker compiled
     itself. An entry still being written (changed in the last `SETTLE_S`) waits for
     the next round.

Workers that share one data directory (several models on one machine) may publish
each other's entries too; they are keyed by program, so a stray one is never loaded
by a program it does not belong to, only stored.
"""

from __future__ import annotations

import asyncio
import os
import time
from pathlib import Path

from services.registry.programs import ENTRY_RE
from shared.logging import get_logger

log = get_logger("worker.fleet")

PUBLISH_S = 10.0
SETTLE_S = 2.0
MAX_FAILURES = 3


class FleetPrograms:
    def __init__(self, registry, model: str, folder: Path) -> None:
        self.registry = registry
        self.model = model
        self.folder = Path(folder)
        self.fetched = self.refused = self.published = 0
        self._known: set[str] | None = None  # entries not ours to publish
        self._version = ""  # newest version built here: where our entries go
        self._fp: dict[str, str] | None = None
        self._fp_id = ""
        self._failures = 0  # failed publish rounds in a row

    def _fingerprint(self) -> tuple[dict[str, str], str]:
        if self._fp is None:
            from engine import jaxrt  # jax: only a worker of the JAX engine holds this

            self._fp = jaxrt.fingerprint()
            self._fp_id = jaxrt.fingerprint_id(self._fp)
        return self._fp, self._fp_id

    def _entries(self) -> set[str]:
        try:
            return {n for n in os.listdir(self.folder) if ENTRY_RE.match(n)}
        except FileNotFoundError:
            return set()

    async def pull(self, version: str) -> int:
        """The registry's programs of `version` into the folder -> how many arrived."""
        if self._known is None:
            self._known = self._entries()  # what this process found: not its own work
        fp, fp_id = self._fingerprint()
        t0 = time.perf_counter()
        try:
            fetched, refused = await self.registry.programs.pull(
                self.model, version, fp, fp_id, self.folder)
        except Exception as exc:  # noqa: BLE001 - a registry hiccup: compile instead
            log.warning("programs_pull_failed", model=self.model, version=version,
                        error=f"{type(exc).__name__}: {exc}")
            fetched = refused = 0
        self._known |= self._entries()
        self._version = version
        self.fetched += fetched
        self.refused += refused
        log.info("programs_pulled", model=self.model, version=version, fingerprint=fp_id,
                 fetched=fetched, refused=refused, seconds=round(time.perf_counter() - t0, 3))
        return fetched

    async def publish(self, settle_s: float = SETTLE_S) -> int:
        """This process's new cache entries into the registry -> how many went;
        `settle_s`: leave entries changed more recently than that for a later round."""
        if self._known is None or not self._version:
            return 0
        fp, fp_id = self._fingerprint()
        now = time.time()
        sent = 0
        for name in sorted(self._entries() - self._known):
            path = self.folder / name
            try:
                if now - path.stat().st_mtime < settle_s:
                    continue  # JAX may still be writing it
                await self.registry.programs.publish(self.model, self._version, fp, fp_id, path)
            except FileNotFoundError:
                pass  # evicted meanwhile
            self._known.add(name)
            sent += 1
        if sent:
            self.published += sent
            log.info("programs_published", model=self.model, version=self._version,
                     fingerprint=fp_id, published=sent, total=self.published)
        return sent

    async def run(self) -> None:
        """Publish now (the first set, for the next worker), then every PUBLISH_S,
        until cancelled or publishing is off."""
        while True:
            await self.publish_quietly()
            if self._failures >= MAX_FAILURES:
                return
            await asyncio.sleep(PUBLISH_S)

    async def publish_quietly(self) -> None:
        """One round; MAX_FAILURES failed rounds in a row turn publishing off (a
        worker of the secured configuration may read the registry, never write it:
        there `tensorbus registry warm`, run by the deploy role, fills the shelf)."""
        if self._failures >= MAX_FAILURES:
            return
        try:
            await self.publish()
            self._failures = 0
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001 - the next round tries again
            self._failures += 1
            off = self._failures >= MAX_FAILURES
            log.warning("programs_publish_off" if off else "programs_publish_failed",
                        model=self.model, error=f"{type(exc).__name__}: {exc}")

    def summary(self) -> dict[str, int]:
        """Programs compiled and loaded by this process (JAX's cache misses and hits),
        and entries fetched, refused and published."""
        from engine import jaxrt  # jax: only a worker of the JAX engine holds this

        return {**jaxrt.compile_counts(), "fetched": self.fetched, "refused": self.refused,
                "published": self.published}
