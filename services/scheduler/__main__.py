"""python -m services.scheduler: process wiring only (services.lifecycle.serve)."""

from __future__ import annotations

from services.lifecycle import serve
from services.registry.store import open_or_none
from services.registry.seed import seed_registry
from services.scheduler.service import Scheduler
from shared.config import Config
from shared.scaling import check_settings


async def build(nc, config: Config):
    registry = await open_or_none(nc, "routing ignores versions")
    # First start: the bundled models reach the registry from here, in the
    # background (honcho stops the whole stack when a one-shot process exits).
    seeding = [seed_registry(registry)] if registry is not None else []
    return Scheduler(nc, config, registry=registry), seeding


if __name__ == "__main__":
    import sys

    from services.probe import run_check

    run_check(sys.argv[1:], "tensorbus-scheduler", "")
    serve("scheduler", build, check=check_settings)  # a fleet setting that cannot work exits 78
