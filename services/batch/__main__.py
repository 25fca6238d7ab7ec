"""`python -m services.batch`: process wiring only (services.lifecycle.serve).

Any number of runners side by side: a lease per batch (lease.py) gives each batch
to one of them (docs/operations.md, "The batch runner")."""

from __future__ import annotations

from services.lifecycle import serve
from shared.config import Config

from .runner import SERVICE_NAME, BatchRunner


async def build(nc, config: Config):
    return BatchRunner(nc, config), []


if __name__ == "__main__":
    import sys

    from services.probe import run_check

    run_check(sys.argv[1:], SERVICE_NAME, "")  # this host's runner (its id starts with it)
    serve("batch", build, client_name=SERVICE_NAME)
