"""python -m services.worker: process wiring only (services.lifecycle.serve)."""

from __future__ import annotations

from pathlib import Path

from services.lifecycle import serve
from services.registry.source import ModelSource
from services.registry.store import open_or_none
from services.worker.engines import build_engine, cache_folder, engine_settings
from services.worker.fleet import FleetPrograms
from services.worker.service import Worker
from shared.config import Config


def check(config: Config) -> None:
    engine_settings(config, config.model)  # an unknown engine or dtype exits 78 here


async def build(nc, config: Config):
    # A fixed TENSORBUS_MODEL_DIR is served as version "local" and never swapped.
    registry = None if config.model_dir else await open_or_none(nc, "serving the local directory")
    source = ModelSource(registry, Path(config.data_dir) / "models")
    # The fleet's compiled programs come with the registry, for the JAX engine's workers.
    jax = registry is not None and engine_settings(config, config.model)[0] == "jax"
    fleet = FleetPrograms(registry, config.model, cache_folder(config)) if jax else None
    worker = Worker(nc, config, model=config.model, source=source, fleet=fleet,
                    engine_factory=lambda info, version: build_engine(config, info))
    return worker, []


if __name__ == "__main__":
    import sys

    from services.probe import run_check

    run_check(sys.argv[1:], "tensorbus-worker", "")
    serve("worker", build, client_name=lambda config: f"worker-{config.model}", check=check)
