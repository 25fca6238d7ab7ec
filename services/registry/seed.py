"""Put the bundled models into an empty registry (run from a service on first start).

`seed_registry` runs once in the background when the scheduler process starts: the
bundled models reach an empty registry from inside a service, so the Procfile holds
long-running processes only.

Idempotent and safe to race: a model with any version is left alone; version "1" is
reserved with a KV create, so of two seeding processes one uploads and the other skips;
prod is set with a KV create too, so it never overrides a later promotion.
"""

from __future__ import annotations

import asyncio
import importlib.metadata
from pathlib import Path

from services.registry.errors import VersionExists
from services.registry.store import Registry
from shared import catalog, gguf
from shared.catalog import ModelInfo
from shared.logging import get_logger

SEED_VERSION = "1"

log = get_logger("registry.seed")

# What made each bundled model, beyond what the directory says itself.
_LINEAGE = {
    catalog.ENCODER: {"data": "sentence-transformers training pairs (see data_config.json)"},
    catalog.DEMO_LM: {
        "source": "script:scripts/train_demo_lm.py",
        "data": "pydoc_data.topics and standard-library docstrings (CPython 3.11)",
    },
    catalog.SMOLLM2: {"model": "SmolLM2-135M-Instruct by HuggingFaceTB (Apache-2.0), GGUF Q4_1"},
}


async def seed_registry(registry: Registry, models: list[ModelInfo] | None = None) -> list[str]:
    """Push the bundled models an empty registry lacks; errors are logged, not raised."""
    try:
        pushed = await seed_bundled(registry, models)
    except asyncio.CancelledError:
        raise
    except Exception as exc:  # noqa: BLE001 - serving goes on; workers fall back to local
        log.error("registry_seed_failed", error=f"{type(exc).__name__}: {exc}")
        return []
    if pushed:
        log.info("registry_seeded", models=pushed)
    else:
        log.info("registry_seed_skipped", reason="every bundled model has a version")
    return pushed


async def seed_bundled(registry: Registry, models: list[ModelInfo] | None = None) -> list[str]:
    """Push each model not yet in the registry as version "1" and make it prod.

    Returns the names this call uploaded (empty when everything was there already).
    """
    models = catalog.bundled() if models is None else models
    pushed = []
    for info in models:
        if await _has_versions(registry, info.name):
            log.debug("seed_skip", model=info.name)
        else:
            try:
                await _upload(registry, info)
                pushed.append(info.name)
            except VersionExists:
                log.info("seed_raced", model=info.name)  # another process is seeding it
        if await registry.get(info.name, SEED_VERSION) is not None:
            await registry.promote_if_unset(info.name, SEED_VERSION)
    return pushed


async def _upload(registry: Registry, info: ModelInfo) -> None:
    """A GGUF model goes in as its one file, unchanged (as `registry import-gguf`)."""
    gguf_file = gguf.find_file(info.path)
    if gguf_file is not None:
        await registry.import_gguf(gguf_file, info.name, version=SEED_VERSION,
                                   lineage=lineage_of(info), progress=False)
    else:
        await registry.push(info.path, info.name, version=SEED_VERSION,
                            lineage=lineage_of(info), progress=False)


async def _has_versions(registry: Registry, name: str) -> bool:
    # Ready ones only: a reservation left by a crashed seeder is retried (and taken
    # over by push once stale) instead of blocking the model forever.
    return bool(await registry.versions(name))


def lineage_of(info: ModelInfo) -> dict[str, str]:
    out = {"source": _source(Path(info.path))}
    out.update(_LINEAGE.get(info.name, {}))
    return out


def _source(path: Path) -> str:
    """The installed distribution that ships `path`, else the path inside the repo."""
    path = path.resolve()
    for top, dists in importlib.metadata.packages_distributions().items():
        dist = importlib.metadata.distribution(dists[0])
        if _within(path, Path(str(dist.locate_file(top))).resolve()):
            return f"pypi:{dist.metadata['Name']}=={dist.version}"
    if _within(path, catalog.REPO_ROOT):
        return f"repo:{path.relative_to(catalog.REPO_ROOT).as_posix()}"
    return str(path)


def _within(path: Path, root: Path) -> bool:
    return path == root or root in path.parents
