"""Which versions of its model a worker holds, and how it moves between them.

  1. Start: the model's aliases name prod (and maybe a canary). Each is resolved with
     `ModelSource` (fetched into the cache, every sha256 verified before use) and built
     by the engine factory. Without a registry, or for a model the registry does not
     know, the local directory serves as version "local".
  2. A KV watch follows the aliases. The newest change wins: a change that arrives
     while another loads is applied once that load ends.
  3. A version the aliases name but the worker lacks is fetched (its compiled programs
     too, services/worker/fleet.py), built and warmed on
     the loader thread, so the engine thread keeps serving the old ones meanwhile.
  4. Switch, in one step on the event loop: unpinned work closed into a batch from now
     on runs on the new prod; a heartbeat goes out at once.
  5. Retire: a version no alias names any more stays loaded for a grace period (a
     scheduler that has not seen the new heartbeat may still send work pinned to it)
     and until no queued or computing batch uses it; then its engine is dropped.
  6. Any failure (a missing or incompatible version, a checksum mismatch, an engine
     that does not build) leaves what is served unchanged; the reason goes to the log
     and to the heartbeat's `last_error`.

Encoders and decoders move the same way. `LoadedModels` is the one place that holds
engines: the worker and its runner are told of every change by callback and look
engines up by version, so none keeps a stale one.
"""

from __future__ import annotations

import asyncio
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING, Awaitable, Callable, Generic, TypeVar, cast

from nats.errors import ConnectionClosedError

from engine.interface import Engine
from services.registry.errors import IncompatibleVersion, VersionNotFound
from services.registry.source import LOCAL, ModelSource
from services.worker.fleet import FleetPrograms
from shared import catalog
from shared.logging import get_logger
from shared.registry import Aliases

if TYPE_CHECKING:
    from services.registry.store import Registry

log = get_logger("worker.versions")

E = TypeVar("E", bound=Engine)
"""The engines a worker holds: `Encoder`, `Decoder`, or either until the first load."""

EngineFactory = Callable[[catalog.ModelInfo, str], E]
"""(model directory info, version) -> an engine, built but not yet warmed."""

_RETRY_S = (0.5, 1.0, 2.0, 5.0)  # back-off of a failed alias watch


class LoadedModels(Generic[E]):
    """The engines a worker holds, by version; which one is prod and which the canary.

    Read on the event loop and (engine lookups only) the engine thread; changed only
    on the event loop, and every change is reported to the `on_change` listeners at
    once (heartbeat now; the decoder runner's per-engine lanes follow).
    """

    def __init__(self, engine: E | None = None, version: str = LOCAL, kind: str = "") -> None:
        self.engines: dict[str, E] = {}
        self.prod = ""
        self.canary = ""
        self.kind = kind  # "encoder" | "decoder"; "" until the first version is built
        self.error = ""  # why what the aliases name is not (all) served; "" when it is
        self._listeners: list[Callable[[], None]] = []
        if engine is not None:
            self.engines[version] = engine
            self.prod = version

    def on_change(self, listener: Callable[[], None]) -> None:
        self._listeners.append(listener)

    def changed(self) -> None:
        for listener in list(self._listeners):
            listener()

    def serving(self) -> list[str]:
        """The versions traffic goes to, prod first (what heartbeats list)."""
        return [v for v in (self.prod, self.canary) if v]

    def holds(self, version: str) -> bool:
        return version in self.engines

    def resolve(self, requested: str) -> str:
        """The version that serves a request: the pinned one, else prod."""
        return requested or self.prod

    def engine_of(self, version: str = "") -> E:
        return self.engines[self.resolve(version)]

    @property
    def prod_engine(self) -> E | None:
        """The prod engine, or None before the first load."""
        return self.engines.get(self.prod)

    def switch(self, prod: str, canary: str, added: dict[str, E]) -> list[str]:
        """Install new engines and aliases; return the versions nothing names now."""
        self.engines.update(added)
        self.prod, self.canary = prod, canary
        self.changed()
        return [v for v in self.engines if v not in (prod, canary)]

    def drop(self, version: str) -> bool:
        """Forget a version nothing names, which frees its engine once the listeners
        let go of it too; False when it is named again (or was gone already)."""
        if version in (self.prod, self.canary) or version not in self.engines:
            return False
        del self.engines[version]
        self.changed()
        return True

    def report(self, errors: list[str]) -> None:
        self.error = "; ".join(errors)
        self.changed()


InUse = Callable[[str], Awaitable[None]]
"""version -> returns once no running or queued work needs that version."""


class HotSwap(Generic[E]):
    """Loads a worker's versions from the registry and follows its aliases."""

    def __init__(self, model: str, models: LoadedModels[E], source: ModelSource | None,
                 factory: EngineFactory[E], *, in_use: InUse, grace_s: float,
                 model_dir: str = "", fleet: FleetPrograms | None = None) -> None:
        self.model = model
        self.models = models  # filled by start(), changed by apply() and retirement
        self.source = source
        self.registry = source.registry if source is not None else None
        self.factory = factory
        self.in_use = in_use
        self.model_dir = model_dir  # a fixed local directory: version "local", no watch
        self.grace_s = grace_s
        self.fleet = fleet  # the fleet's compiled programs, pulled before a build
        self.loader = ThreadPoolExecutor(1, thread_name_prefix="loader")
        self.swaps = 0  # completed switches, for tests and benchmarks
        self._target: Aliases | None = None
        self._changed = asyncio.Event()
        self._retiring: dict[str, asyncio.Task] = {}
        self._closed = False

    @property
    def follows(self) -> bool:
        return self.registry is not None and not self.model_dir

    # ------------------------------------------------------------------ start
    async def start(self) -> None:
        """Load the versions to serve first (built, not warmed); never an empty set."""
        aliases = await self._current()
        if self.follows and not aliases.prod:
            aliases = await self._seed() or aliases
        prod = aliases.prod or LOCAL
        errors = []
        try:
            engines = {prod: await self._build(prod)}
        except Exception as exc:  # noqa: BLE001 - fall back to the bundled copy
            if prod == LOCAL:
                raise
            errors.append(self._describe(prod, exc))
            prod = LOCAL
            engines = {prod: await self._build(prod)}
        canary = ""
        if self._wants_canary(aliases, prod):
            try:
                engines[aliases.canary] = await self._build(aliases.canary)
                canary = aliases.canary
            except Exception as exc:  # noqa: BLE001 - serve prod alone
                errors.append(self._describe(aliases.canary, exc))
        self.models.switch(prod, canary, engines)
        self.models.report(errors)
        log.info("versions_loaded", model=self.model, prod=prod, canary=canary or None)

    async def _seed(self) -> Aliases | None:
        """First start of a bundled model: seed it ourselves rather than start on
        `local` and warm everything twice when the scheduler's seeding lands."""
        info = catalog.resolve(self.model)
        if info is None:
            return None
        from services.registry.seed import seed_bundled

        assert self.registry is not None  # start() seeds only when it follows a registry
        try:
            await seed_bundled(self.registry, [info])
        except Exception as exc:  # noqa: BLE001 - e.g. no write permission: serve local
            log.info("seed_skipped", model=self.model, error=f"{type(exc).__name__}: {exc}")
            return None
        return await self._current()

    async def _current(self) -> Aliases:
        if not self.follows:
            return Aliases()
        assert self.registry is not None  # it follows one
        try:
            return await self.registry.aliases(self.model)
        except Exception as exc:  # noqa: BLE001 - an unusable registry: serve locally
            log.warning("aliases_unreadable", model=self.model, error=str(exc))
            return Aliases()

    @staticmethod
    def _wants_canary(aliases: Aliases, prod: str) -> bool:
        return bool(aliases.canary) and aliases.canary != prod

    # ------------------------------------------------------------------ follow
    async def run(self) -> None:
        """Follow the aliases until cancelled (a no-op without a registry)."""
        if not self.follows:
            return
        async with asyncio.TaskGroup() as tg:
            tg.create_task(self._watch())
            while True:
                await self._changed.wait()
                self._changed.clear()
                target, self._target = self._target, None
                if target is None:
                    continue
                try:
                    await self.apply(target)
                except Exception as exc:  # noqa: BLE001 - a bug here must not stop serving
                    log.exception("apply_failed", model=self.model)
                    self.models.report([f"alias change not applied: {exc}"])

    async def _watch(self) -> None:
        assert self.registry is not None  # run() watches only when it follows one
        attempt = 0
        while not self._closed:
            try:
                async with self.registry.watch_aliases(self.model) as watch:
                    async for aliases in watch:
                        attempt = 0
                        self._target = aliases
                        self._changed.set()
            except asyncio.CancelledError:
                raise
            except ConnectionClosedError:
                return  # shutting down
            except Exception as exc:  # noqa: BLE001 - keep serving, watch again
                log.warning("alias_watch_failed", model=self.model, error=str(exc))
            await asyncio.sleep(_RETRY_S[min(attempt, len(_RETRY_S) - 1)])
            attempt += 1

    async def apply(self, aliases: Aliases) -> None:
        """Serve what `aliases` name, keeping what works when a version cannot load."""
        models = self.models
        prod = aliases.prod or models.prod  # a deleted alias keeps what is served
        canary = aliases.canary if self._wants_canary(aliases, prod) else ""
        errors, added = [], {}
        t0 = time.perf_counter()
        for version in (prod, canary):
            if version and not models.holds(version) and version not in added:
                try:
                    added[version] = await self._build(version, warm=True)
                except Exception as exc:  # noqa: BLE001 - refused, old one stays
                    errors.append(self._describe(version, exc))
        if prod not in added and not models.holds(prod):
            prod = models.prod
        if canary and canary not in added and not models.holds(canary):
            canary = ""
        changed = (prod, canary) != (models.prod, models.canary)
        models.error = "; ".join(errors)
        unused = models.switch(prod, canary, added)  # one report: versions and errors
        if changed:
            self.swaps += 1
            log.info("version_switched", model=self.model, prod=prod, canary=canary or None,
                     seconds=round(time.perf_counter() - t0, 3))
        for version in unused:
            old = self._retiring.pop(version, None)
            if old is not None:  # demoted again: its grace starts over
                old.cancel()
            self._retiring[version] = asyncio.create_task(self._retire(version))

    async def _retire(self, version: str) -> None:
        await asyncio.sleep(self.grace_s)
        await self.in_use(version)
        if not self.models.drop(version):  # in the same step: nothing can start on it
            return  # named again meanwhile
        log.info("version_retired", model=self.model, version=version)
        self._retiring.pop(version, None)

    async def stop(self) -> None:
        self._closed = True
        for task in list(self._retiring.values()):
            task.cancel()
        self.loader.shutdown(wait=False)

    # ------------------------------------------------------------------ loading
    async def _build(self, version: str, warm: bool = False) -> E:
        """Fetch (verified), describe, check the kind, build and maybe warm one version."""
        info = await self._fetch(version)
        kind = self.models.kind
        if not kind:  # the first version built fixes what this worker serves
            self.models.kind = kind = info.kind
        if info.kind != kind:
            raise IncompatibleVersion(
                f"{self.model}@{version} is of kind {info.kind}; this worker serves kind {kind}")
        if self.fleet is not None and version != LOCAL:
            await self.fleet.pull(version)
        loop = asyncio.get_running_loop()
        t0 = time.perf_counter()
        engine = await loop.run_in_executor(self.loader, self._make, info, version, warm)
        log.info("version_built", model=self.model, version=version, warm=warm,
                 seconds=round(time.perf_counter() - t0, 3))
        return engine

    def _make(self, info: catalog.ModelInfo, version: str, warm: bool) -> E:
        """Runs on the loader thread."""
        engine = self.factory(info, version)
        if warm:
            engine.warmup(False)  # a decoder's structured outputs' programs too
        return engine

    async def _fetch(self, version: str) -> catalog.ModelInfo:
        if version == LOCAL:
            info = catalog.resolve(self.model, self.model_dir)
            if info is None:
                raise VersionNotFound(
                    f"{self.model} is neither in the registry nor bundled; set TENSORBUS_MODEL_DIR")
            return info
        # A version other than local comes from the registry (and so the source).
        record = await cast("Registry", self.registry).get(self.model, version)
        if record is None:
            raise VersionNotFound(f"{self.model}@{version} is not in the registry")
        kind = self.models.kind
        if kind and record.kind != kind:
            raise IncompatibleVersion(
                f"{self.model}@{version} is of kind {record.kind}; this worker serves kind {kind}")
        _, path = await cast(ModelSource, self.source).resolve(self.model, version)
        return catalog.describe(self.model, Path(path))

    # ------------------------------------------------------------------ errors
    def _describe(self, version: str, exc: Exception) -> str:
        msg = f"cannot serve {self.model}@{version}: {type(exc).__name__}: {exc}"
        log.error("version_refused", model=self.model, version=version,
                  error=f"{type(exc).__name__}: {exc}")
        return msg
