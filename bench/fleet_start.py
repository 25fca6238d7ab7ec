"""A worker's start on an empty disk, with and without the fleet's compiled programs.

    python -m bench.fleet_start [--model smollm2-135m-instruct] [--json]

One nats-server, the model seeded into its registry, then three processes in turn,
each with its own empty data directory (another machine's disk):

  cold     a worker with nothing on the shelf: it compiles its first set before
           `ready`, the rest in the background; stopped once the rest is compiled
           (or after --settle-cap s), it publishes what it compiled at its drain.
  warm     `tensorbus registry warm NAME`: compiles what is still missing, publishes.
  shelf    a worker with the shelf filled: pulls, loads, compiles nothing.

Per row: seconds from process start to `ready` and to every program compiled, the
programs compiled and loaded (JAX's cache misses and hits), and entries fetched or
published. The environment's `TENSORBUS_*` settings (the shapes) reach every process;
none set: the defaults, as a user starts a worker.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import tempfile
import time
from pathlib import Path

from services.registry.seed import seed_registry
from services.registry.store import Registry
from shared import catalog
from shared.bus import open_client
from shared.config import Config
from shared.natsd import NatsServer

REPO = Path(__file__).resolve().parents[1]


def _env(url: str, data_dir: Path, model: str) -> dict[str, str]:
    out = dict(os.environ)  # the workers' TENSORBUS_* settings pass through
    out.update(TENSORBUS_NATS_URL=url, TENSORBUS_DATA_DIR=str(data_dir),
               TENSORBUS_MODEL=model, TENSORBUS_LOG_FORMAT="json", HF_HUB_OFFLINE="1")
    return out


async def _worker(url: str, data_dir: Path, model: str, cap_s: float) -> dict:
    t0 = time.perf_counter()
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "services.worker", cwd=REPO, env=_env(url, data_dir, model),
        stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.PIPE, limit=1 << 22)
    row: dict = {"start": "?"}
    try:
        async with asyncio.timeout(cap_s):
            while line := await proc.stderr.readline():  # the JSON log
                try:
                    event = json.loads(line)
                except ValueError:
                    continue
                name = event.get("event")
                if name == "ready":
                    row.update(ready_s=round(time.perf_counter() - t0, 1),
                               programs=event.get("programs"), compiled=event.get("compiled"),
                               loaded=event.get("loaded"), fetched=event.get("fetched"))
                elif name == "programs_compiled_all" and not event["model"].endswith("-masked"):
                    row["all_s"] = round(time.perf_counter() - t0, 1)
                    break
    except TimeoutError:
        row["all_s"] = f">{cap_s:.0f}"
    if proc.returncode is None:
        proc.terminate()
    await proc.communicate()
    if "all_s" not in row:
        row["exit"] = proc.returncode  # it ended before its programs were compiled
    return row


async def _warm(url: str, data_dir: Path, model: str) -> dict:
    t0 = time.perf_counter()
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "services.cli", "registry", "warm", model, "--json", cwd=REPO,
        env=_env(url, data_dir, model), stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.DEVNULL)
    out, _ = await proc.communicate()
    if proc.returncode != 0:
        return {"exit": proc.returncode}
    summary = json.loads(out.decode().strip().splitlines()[-1])
    return {"all_s": round(time.perf_counter() - t0, 1), **summary}


async def _run(model: str, cap_s: float) -> list[dict]:
    with tempfile.TemporaryDirectory(prefix="fleet-start-") as tmp, \
            NatsServer(Path(tmp) / "nats") as server:
        nc = await open_client(server.url, Config.from_env())
        try:
            registry = await Registry.open(nc)
            info = catalog.resolve(model)
            if info is None:
                raise SystemExit(f"{model}: not a bundled model")
            await seed_registry(registry, [info])
        finally:
            await nc.drain()
        rows = []
        for start, run in (("cold", lambda d: _worker(server.url, d, model, cap_s)),
                           ("warm", lambda d: _warm(server.url, d, model)),
                           ("shelf", lambda d: _worker(server.url, d, model, cap_s))):
            row = await run(Path(tmp) / start)
            row["start"] = start
            rows.append(row)
            print(json.dumps(row), file=sys.stderr, flush=True)
        return rows


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m bench.fleet_start", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=catalog.SMOLLM2)
    p.add_argument("--settle-cap", type=float, default=900.0,
                   help="stop waiting for a worker's background compiles after this (s)")
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    rows = asyncio.run(_run(args.model, args.settle_cap))
    if args.json:
        print(json.dumps(rows))
        return
    print(f"{'start':6} {'ready s':>8} {'all s':>7} {'compiled':>9} {'loaded':>7} "
          f"{'fetched':>8} {'published':>9}")
    for r in rows:
        print(f"{r['start']:6} {r.get('ready_s', '-')!s:>8} {r.get('all_s', '-')!s:>7} "
              f"{r.get('compiled', '-')!s:>9} {r.get('loaded', '-')!s:>7} "
              f"{r.get('fetched', '-')!s:>8} {r.get('published', '-')!s:>9}")


if __name__ == "__main__":
    main()
