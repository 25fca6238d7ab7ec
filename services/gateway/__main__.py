"""python -m services.gateway: process wiring only (services.lifecycle.serve)."""

from __future__ import annotations

from pathlib import Path

from services.fleet import Fleet
from services.gateway.frontend import Frontend
from services.gateway.models import ModelTable
from services.gateway.reasoning import check_setting
from services.gateway.service import Gateway
from services.gateway.versions import RegistryVersions
from services.lifecycle import serve
from services.registry.store import Registry, open_or_none
from shared.config import Config
from shared.scaling import check_settings


def frontend(nc, config: Config, registry: Registry | None) -> Frontend:
    """The gateway's core, resolving unbundled model names through the registry."""
    fleet = Fleet(expiry_s=config.worker_expiry_s)
    cache = Path(config.data_dir) / "gateway-models"
    return Frontend(nc, config, fleet, ModelTable(fleet, RegistryVersions(registry, cache, fleet)))


def check(config: Config) -> None:
    """Settings that cannot work exit 78 before anything starts: the fleet's, and
    TENSORBUS_REASONING_PARSER's values."""
    check_settings(config)
    check_setting(config)


async def build(nc, config: Config):
    registry = await open_or_none(nc, "bundled catalogue only")
    return Gateway(nc, config, frontend(nc, config, registry)), []


if __name__ == "__main__":
    serve("gateway", build, check=check)
