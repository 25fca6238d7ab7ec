"""Where a worker's weights come from: the registry, else the bundled catalogue.

1. A pinned version is fetched as is; no version means the model's `prod` alias.
2. Files land in `cache_dir/NAME/VERSION/`, verified (a verified copy is reused).
3. Without a registry, or for a model the registry does not know (or has no prod
   for), the local catalogue directory is used and the version reads "local".
"""

from __future__ import annotations

from pathlib import Path

from services.registry.errors import VersionNotFound
from services.registry.store import Registry
from shared import catalog
from shared.logging import get_logger

LOCAL = "local"

log = get_logger("registry.source")


class ModelSource:
    def __init__(self, registry: Registry | None, cache_dir: Path) -> None:
        self.registry = registry
        self.cache_dir = Path(cache_dir)

    async def resolve(self, name: str, version: str | None = None) -> tuple[str, Path]:
        """(version, model directory) for `name`; raises VersionNotFound if nowhere."""
        if self.registry is not None and version != LOCAL:
            if version:
                if await self.registry.get(name, version) is None:
                    raise VersionNotFound(f"{name}@{version} is not in the registry")
                return version, await self._fetch(name, version)
            prod = (await self.registry.aliases(name)).prod
            if prod:
                return prod, await self._fetch(name, prod)
        return LOCAL, self._local(name)

    async def _fetch(self, name: str, version: str) -> Path:
        # A bundled model's files are copied from the install where they match.
        assert self.registry is not None  # resolve() fetches only with a registry
        return await self.registry.fetch(name, version, self.cache_dir / name / version,
                                         local=catalog.bundled_dir(name))  # fmt: skip

    def _local(self, name: str) -> Path:
        info = catalog.resolve(name)
        if info is None:
            raise VersionNotFound(f"{name} is neither in the registry nor bundled")
        log.info("model_from_catalogue", model=name, path=info.path)
        return Path(info.path)
