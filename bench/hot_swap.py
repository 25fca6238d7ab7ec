"""Hot swap and cold start of a worker serving the bundled encoder from the registry.

    .venv/bin/python -m bench.hot_swap [--batch-buckets 1,4] [--seq-buckets 16,64]
                                       [--clients 4] [--out bench/out/hot_swap.json]
    .venv/bin/python -m bench.hot_swap --decoder [--streams 8]
                                       [--out bench/out/hot_swap_decoder.json]

One run, every service a real process against a fresh nats-server (JetStream):
  1. The bundled encoder is pushed as versions 1 and 2 (the same weights; the
     registry does not care) and version 1 is made prod.
  2. Cold start, process start -> heartbeat state `ready`, three times in one data
     directory: `first` (nothing cached: fetch, build, compile), `empty_cache` (model
     files cached, JAX compilation cache emptied), `warm_cache` (both cached). Phases:
     process start -> first heartbeat (imports, connect) -> `warming` -> `ready`.
  3. Hot swap under closed-loop load: gateway, scheduler and one worker run; `clients`
     loops send embeddings; version 2 is promoted, then rolled back (each once the
     previous old version was retired). Each swap time is alias change -> first reply
     whose `Tensorbus-Model-Version` is the new version: fetch (verified), build and
     warm-up on the loader thread while version 1 serves. Failed requests are counted
     over the whole load.
With `--decoder`, step 3 only, for the demo LM (two versions, same weights): `streams`
closed-loop streaming completions (32 tokens); each swap time is alias change -> first
chunk whose `Tensorbus-Model-Version` is the new version; a stream whose chunks name
two versions is counted as mixed, one that ends in an error as failed.
Prints one JSON document (and writes it to --out). Figures from a shared CPU are noisy.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import tempfile
import time
from pathlib import Path

import msgspec

from bench import harness
from shared import catalog, subjects
from shared.errors import HEADER_CODE

MODEL = catalog.ENCODER
VERSION_HEADER = "Tensorbus-Model-Version"


async def push_versions(nc, model: str = MODEL) -> None:
    from services.registry.store import Registry

    reg = await Registry.open(nc)
    path = catalog.bundled_dir(model)
    for v in ("1", "2"):
        await reg.push(path, model, version=v, progress=False)
    await reg.promote(model, "1")


class Heartbeats:
    """First time each (worker, state) was heard, monotonic."""

    def __init__(self) -> None:
        self.seen: dict[tuple[str, str], float] = {}
        self.changed = asyncio.Event()

    async def start(self, nc) -> None:
        from shared.telemetry import heartbeat_decoder

        async def on_hb(msg) -> None:
            hb = heartbeat_decoder.decode(msg.data)
            self.seen.setdefault((hb.worker_id, "any"), time.monotonic())
            self.seen.setdefault((hb.worker_id, hb.state), time.monotonic())
            self.changed.set()

        await nc.subscribe(subjects.TELEMETRY_WORKERS, cb=on_hb)

    async def wait(self, worker_id: str, state: str, timeout: float = 600.0) -> float:
        end = time.monotonic() + timeout
        while (worker_id, state) not in self.seen:
            self.changed.clear()
            await asyncio.wait_for(self.changed.wait(), max(0.01, end - time.monotonic()))
        return self.seen[(worker_id, state)]


async def cold_start(sup, hbs: Heartbeats, env: dict, worker_id: str) -> dict:
    t0 = time.monotonic()
    proc = sup.start(worker_id, "services.worker", TENSORBUS_WORKER_ID=worker_id, **env)
    ready = await hbs.wait(worker_id, "ready")
    up = hbs.seen[(worker_id, "any")]
    warming = hbs.seen.get((worker_id, "warming"), ready)
    proc.signal(15)
    await asyncio.to_thread(proc.wait, 60)
    return {"total_s": ready - t0, "to_first_heartbeat_s": up - t0,
            "loading_s": warming - up, "warming_s": ready - warming}


async def cold_starts(sup, hbs: Heartbeats, env: dict, data_dir: Path) -> dict:
    out = {}
    out["first"] = await cold_start(sup, hbs, env, "cold-first")
    shutil.rmtree(data_dir / "jax-cache", ignore_errors=True)
    out["empty_cache"] = await cold_start(sup, hbs, env, "cold-empty")
    out["warm_cache"] = await cold_start(sup, hbs, env, "cold-warm")
    for k, v in out.items():
        print(f"cold start {k}: {v['total_s']:.2f} s (load {v['loading_s']:.2f} s, "
              f"warm-up {v['warming_s']:.2f} s)", flush=True)
    return out


class Load:
    """Closed-loop embedding clients; every reply's (arrival, version) is kept."""

    def __init__(self, nc, clients: int) -> None:
        self.nc, self.clients = nc, clients
        self.replies: list[tuple[float, str]] = []
        self.ok = self.failed = 0
        self.stop = asyncio.Event()
        self.tick = asyncio.Event()

    async def run(self) -> None:
        await asyncio.gather(*(self._client(i) for i in range(self.clients)))

    async def _client(self, i: int) -> None:
        body = msgspec.json.encode({"model": MODEL, "input": [f"client {i} says hello"]})
        while not self.stop.is_set():
            try:
                msg = await self.nc.request(subjects.EMBEDDINGS, body, timeout=30)
            except Exception:  # noqa: BLE001 - counted
                self.failed += 1
                continue
            h = msg.headers or {}
            if int(h.get(HEADER_CODE, 200)) != 200:
                self.failed += 1
                continue
            self.ok += 1
            self.replies.append((time.monotonic(), h.get(VERSION_HEADER, "")))
            self.tick.set()

    async def wait_version(self, version: str, since: float, timeout: float = 300.0) -> float:
        """Seconds from `since` to the first reply by `version` that arrived after it."""
        end, i = time.monotonic() + timeout, 0
        while True:
            for t, v in self.replies[i:]:
                if t >= since and v == version:
                    return t - since
            i = len(self.replies)
            self.tick.clear()
            await asyncio.wait_for(self.tick.wait(), max(0.01, end - time.monotonic()))


async def swaps(sup, nc, env: dict, clients: int, settle_s: float = 3.0) -> dict:
    from services.registry.store import Registry
    from services.supervisor import wait_ready

    harness.start_stack(sup, nats=False, telemetry=False, workers={"swap-worker": {}}, **env)
    await wait_ready(nc, MODEL, 1)
    reg = await Registry.open(nc)
    load = Load(nc, clients)
    task = asyncio.create_task(load.run())
    try:
        await load.wait_version("1", 0.0)
        out = {}
        for version, move in (("2", lambda: reg.promote(MODEL, "2")),
                              ("1", lambda: reg.rollback(MODEL))):
            # Past the retire grace (3 heartbeats), so the old version is really
            # gone: moving back within the grace would find it still loaded.
            await asyncio.sleep(settle_s)
            t0 = time.monotonic()
            await move()
            out[f"to_{version}_s"] = await load.wait_version(version, t0)
            print(f"hot swap -> {version}: {out[f'to_{version}_s']:.2f} s", flush=True)
    finally:
        load.stop.set()
        await task
    out.update(requests_ok=load.ok, requests_failed=load.failed, clients=clients)
    return out


class StreamLoad(Load):
    """Closed-loop streaming completions; every chunk's (arrival, version) is kept."""

    def __init__(self, nc, clients: int, model: str) -> None:
        super().__init__(nc, clients)
        self.model = model
        self.mixed = 0
        self.chunks = 0

    async def _client(self, i: int) -> None:
        k = i
        while not self.stop.is_set():
            body = msgspec.json.encode({"model": self.model, "prompt": f"Stream {k} says",
                                        "max_tokens": 32, "ignore_eos": True, "stream": True,
                                        "temperature": 0.7, "seed": k})
            k += self.clients
            inbox = self.nc.new_inbox()
            sub = await self.nc.subscribe(inbox)
            versions, ok = set(), True
            try:
                await self.nc.publish(subjects.COMPLETIONS, body, reply=inbox)
                while True:
                    msg = await sub.next_msg(timeout=30)
                    h = msg.headers or {}
                    if int(h.get(HEADER_CODE, 200)) != 200:
                        ok = False
                        break
                    if msg.data == b"[DONE]":
                        break
                    v = h.get(VERSION_HEADER, "")
                    versions.add(v)
                    self.chunks += 1
                    self.replies.append((time.monotonic(), v))
                    self.tick.set()
            except Exception:  # noqa: BLE001 - counted
                ok = False
            finally:
                await sub.unsubscribe()
            if not ok:
                self.failed += 1
            else:
                self.ok += 1
                self.mixed += len(versions) > 1


async def decoder_swaps(sup, nc, env: dict, streams: int, settle_s: float = 3.0) -> dict:
    from services.registry.store import Registry
    from services.supervisor import wait_ready

    model = catalog.DEMO_LM
    harness.start_stack(sup, nats=False, telemetry=False,
                        workers={"swap-worker": {"TENSORBUS_MODEL": model}}, **env)
    await wait_ready(nc, model, 1)
    reg = await Registry.open(nc)
    load = StreamLoad(nc, streams, model)
    task = asyncio.create_task(load.run())
    out: dict = {}
    try:
        await load.wait_version("1", 0.0)
        for version, move in (("2", lambda: reg.promote(model, "2")),
                              ("1", lambda: reg.rollback(model))):
            await asyncio.sleep(settle_s)
            t0 = time.monotonic()
            await move()
            out[f"to_{version}_s"] = await load.wait_version(version, t0)
            print(f"decoder hot swap -> {version}: {out[f'to_{version}_s']:.2f} s "
                  f"(load {os.getloadavg()[0]:.2f})", flush=True)
        await asyncio.sleep(settle_s)
    finally:
        load.stop.set()
        await task
    out.update(streams_ok=load.ok, streams_failed=load.failed, streams_mixed=load.mixed,
               chunks=load.chunks, streams=streams, loadavg_1m=round(os.getloadavg()[0], 2))
    return out


async def run_decoder(args) -> dict:
    import nats

    from services.supervisor import Supervisor

    work = Path(tempfile.mkdtemp(prefix="tensorbus-bench-swap-"))
    env = dict(TENSORBUS_DATA_DIR=str(work / "data"), TENSORBUS_LOG_LEVEL="warning",
               TENSORBUS_MAX_CONTEXT="128", TENSORBUS_DECODE_SLOTS="16")
    try:
        with Supervisor(work) as sup:
            sup.start_nats()
            nc = await nats.connect(sup.nats_url)
            try:
                await push_versions(nc, catalog.DEMO_LM)
                swap = await decoder_swaps(sup, nc, env, args.streams)
            finally:
                await nc.close()
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return {**harness.run_info("python -m bench.hot_swap --decoder --streams "
                               f"{args.streams}"),
            "model": catalog.DEMO_LM, "max_context": 128, "hot_swap": swap}


async def run(args) -> dict:
    import nats

    from services.supervisor import Supervisor

    work = Path(tempfile.mkdtemp(prefix="tensorbus-bench-swap-"))
    data_dir = work / "data"
    env = dict(TENSORBUS_BATCH_BUCKETS=args.batch_buckets, TENSORBUS_SEQ_BUCKETS=args.seq_buckets,
               TENSORBUS_MAX_BATCH=str(max(harness.csv_ints(args.batch_buckets))),
               TENSORBUS_DATA_DIR=str(data_dir), TENSORBUS_LOG_LEVEL="warning",
               TENSORBUS_MODEL=MODEL)
    try:
        with Supervisor(work) as sup:
            sup.start_nats()
            nc = await nats.connect(sup.nats_url)
            try:
                await push_versions(nc)
                hbs = Heartbeats()
                await hbs.start(nc)
                cold = await cold_starts(sup, hbs, env, data_dir)
                swap = await swaps(sup, nc, env, args.clients)
            finally:
                await nc.close()
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return {**harness.run_info(f"python -m bench.hot_swap --batch-buckets {args.batch_buckets} "
                               f"--seq-buckets {args.seq_buckets} --clients {args.clients}"),
            "buckets": {"batch": args.batch_buckets, "seq": args.seq_buckets},
            "cold_start": cold, "hot_swap": swap}


def main() -> None:
    p = harness.parser(__doc__)
    p.add_argument("--batch-buckets", default="1,4")
    p.add_argument("--seq-buckets", default="16,64")
    p.add_argument("--clients", type=int, default=4)
    p.add_argument("--decoder", action="store_true",
                   help="the demo LM's hot swap under streams instead (no cold starts)")
    p.add_argument("--streams", type=int, default=8, help="with --decoder: concurrent streams")
    p.add_argument("--out", default="")
    args = p.parse_args()
    res = asyncio.run(run_decoder(args) if args.decoder else run(args))
    harness.write_json(args.out or ("hot_swap_decoder.json" if args.decoder else "hot_swap.json"),
                       res)
    print(json.dumps(res, indent=2))


if __name__ == "__main__":
    main()
