"""python -m services.orchestrator: process wiring only (services.lifecycle.serve).

It exits on its own for a fleet setting that cannot work, such as a malformed
TENSORBUS_FLEET (exit 78, with the entry at fault), or when one of its own tasks
fails (exit 1): a crashed, killed or misconfigured worker never stops it, so
`honcho start` keeps running.
"""

from __future__ import annotations

from services.lifecycle import serve
from services.orchestrator.service import Orchestrator, registry_catalogue
from services.registry.store import open_or_none
from shared.config import Config
from shared.scaling import check_settings


async def build(nc, config: Config):
    registry = await open_or_none(nc, "managing the bundled models only")
    return Orchestrator(nc, config, registry_catalogue(registry)), []


if __name__ == "__main__":
    import sys

    from services.probe import run_check

    run_check(sys.argv[1:], "tensorbus-orchestrator", "")
    serve("orchestrator", build, check=check_settings)  # a fleet setting that cannot work exits 78
