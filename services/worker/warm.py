"""`tensorbus registry warm NAME[@VERSION]`: compile a version's programs ahead, once,
for the fleet (run it before a promote, on a machine like the workers').

It builds the engine a worker would build with the same `TENSORBUS_*` settings (shapes
come from them: run it with the workers' environment), pulls what the registry already
holds for this machine's fingerprint, compiles every program of the served form
(`compile_ahead=all`, the compute forms measured), and publishes what it compiled
(services/worker/fleet.py). A worker of the same fingerprint that starts afterwards
loads those programs instead of compiling them (structured outputs run on the same
programs: a token mask is one of their arguments).
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import threading
import time
from pathlib import Path

import msgspec

from engine.jaxrt import MapLimit
from services.registry.errors import RegistryError
from services.registry.source import LOCAL, ModelSource
from services.registry.store import Registry
from services.worker.engines import build_engine, cache_folder, engine_settings
from services.worker.fleet import FleetPrograms
from shared import catalog
from shared.bus import open_client
from shared.config import Config
from shared.logging import configure_logging


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="tensorbus registry warm", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model", help="NAME or NAME@VERSION (default: the prod version)")
    p.add_argument("--timeout", type=float, default=3600.0,
                   help="give up compiling after this many seconds (default 3600)")
    p.add_argument("--json", action="store_true", help="print the summary as JSON")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    name, _, version = args.model.partition("@")
    config = msgspec.structs.replace(Config.from_env(), model=name, compile_ahead="all")
    configure_logging("warm", level="warning", fmt=config.log_format)
    if engine_settings(config, name)[0] != "jax":
        print(f"{name}: the torch engine compiles nothing ahead; nothing to warm")
        return 0
    try:
        summary = asyncio.run(_warm(config, name, version, args.timeout))
    except RegistryError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    if args.json:
        sys.stdout.write(msgspec.json.encode(summary).decode() + "\n")
    else:
        print(f"{name}@{summary['version']}: {summary['compiled']} compiled, "
              f"{summary['loaded']} loaded from the cache ({summary['fetched']} fetched), "
              f"{summary['published']} published in {summary['seconds']} s")
    return 0


async def _warm(config: Config, name: str, version: str, timeout: float) -> dict:
    t0 = time.perf_counter()
    nc = await open_client(config.nats_url, config, name="tensorbus-warm", connect_timeout=2,
                           max_reconnect_attempts=2, allow_reconnect=True)
    try:
        registry = await Registry.open(nc)
        version, path = await ModelSource(registry, Path(config.data_dir) / "models").resolve(
            name, version or None)
        if version == LOCAL:
            raise RegistryError(f"{name} has no version in the registry to warm: push it first")
        fleet = FleetPrograms(registry, name, cache_folder(config))
        await fleet.pull(version)
        info = catalog.describe(name, path)
        loop = asyncio.get_running_loop()
        await loop.run_in_executor(None, _compile_all, config, info, timeout)
        await fleet.publish(settle_s=0.0)  # every compile has ended
        return {"model": name, "version": version, **fleet.summary(),
                "seconds": round(time.perf_counter() - t0, 1)}
    finally:
        await nc.drain()


def _compile_all(config: Config, info: catalog.ModelInfo, timeout: float) -> None:
    """Build the engine and compile every program it serves, its compute forms measured."""
    engine = build_engine(config, info)
    try:
        _compile(engine, info, timeout)
    except MapLimit as exc:  # what compiled is published all the same
        print(f"warning: stopped compiling: {exc}", file=sys.stderr)
    engine.close(wait_s=timeout)


def _compile(engine, info: catalog.ModelInfo, timeout: float) -> None:
    engine.warmup(True)
    if info.kind == "decoder":
        joined = threading.Event()
        engine.on_compiled(joined.set)
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            stats = engine.stats()
            if stats.tune_due:
                engine.tune(8)
                continue
            if stats.compiled >= stats.programs and stats.forms_measured >= stats.forms_total:
                break
            joined.wait(1.0)
            joined.clear()
