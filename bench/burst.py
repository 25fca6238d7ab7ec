"""A burst far above capacity against the real encoder: admitted work must finish.

    .venv/bin/python -m bench.burst [--requests 3000] [--inputs 8] [--timeout 30]

  1. Start nats-server, gateway, scheduler and one encoder worker (the bundled
     all-MiniLM-L6-v2, JAX) as processes, plus a no-op responder process that answers
     every request on `bench.noop` at once with a 429-shaped reply.
  2. Unloaded: a few requests of `--inputs` long inputs (113-128 tokens each), one at
     a time: the scheduler times the model's batches, and this gives the lone latency.
  3. Floor: the same number of requests at once to the no-op responder: what this
     client and nats-server alone need to send them and hear back.
  4. The burst: `--requests` requests at once, each with `Tensorbus-Timeout:
     --timeout`. Every request must be answered: 200, or 429 with Retry-After; an
     admitted request ending in 504 is the failure this guards against. The client
     measures each answer's latency; the gateway's own time for every 429 comes from
     its request records on `telemetry.v1.requests`.
  5. Right after: one request at a time again, against the unloaded latency.

Prints one JSON object; bench/out/burst.json keeps it.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

import msgspec
import numpy as np

from bench.load import one, summary
from bench.workload import long_inputs
from services.supervisor import Supervisor, wait_ready
from shared import catalog, subjects
from shared.bus import connect
from shared.errors import HEADER_CODE, HEADER_MESSAGE, HEADER_RETRY_AFTER
from shared.telemetry import RequestRecord, record_decoder

REPO = Path(__file__).resolve().parent.parent
MODEL = catalog.ENCODER
NOOP = "bench.noop"
ENV = {
    "TENSORBUS_BATCH_BUCKETS": "1,8,16,32", "TENSORBUS_SEQ_BUCKETS": "16,128",
    "TENSORBUS_MAX_BATCH": "32", "TENSORBUS_HTTP_PORT": "-1", "TENSORBUS_LOG_LEVEL": "warning",
    "TENSORBUS_MODEL_DIR": str(catalog.bundled_dir(MODEL)),  # version "local", no download
}


def bodies(n: int, inputs: int) -> list[bytes]:
    texts = long_inputs(512)
    return [msgspec.json.encode({"model": MODEL, "input": [texts[(i * inputs + k) % 512]
                                                           for k in range(inputs)]})
            for i in range(n)]


def pct(values: list[float], q: float) -> float:
    return round(float(np.percentile(np.asarray(values) * 1000, q)), 1) if values else float("nan")


async def one_at_a_time(nc, data: list[bytes], timeout: float) -> list[float]:
    out = []
    for b in data:
        o = await one(nc, subjects.EMBEDDINGS, b, timeout + 5, {"Tensorbus-Timeout": f"{timeout:g}"})
        assert o.status == 200, o
        out.append(o.took)
    return out


async def at_once(nc, subject: str, data: list[bytes], timeout: float):
    headers = {"Tensorbus-Timeout": f"{timeout:g}"}
    t0 = time.monotonic()
    outs = await asyncio.gather(*(one(nc, subject, b, timeout + 10, headers) for b in data))
    return outs, time.monotonic() - t0


async def run(n: int, inputs: int, timeout: float, workdir: Path) -> dict:
    data_dir = workdir / "data"
    # compiled buckets of earlier runs, if any (the test suite's cache by default)
    cache = Path(os.environ.get("TENSORBUS_TEST_CACHE", REPO / ".data" / "test-jax-cache"))
    if cache.is_dir():
        shutil.copytree(cache, data_dir / "jax-cache")
    with Supervisor(workdir, env={**ENV, "TENSORBUS_DATA_DIR": str(data_dir)}) as sup:
        sup.start_nats()
        for name in ("gateway", "scheduler"):
            sup.start(name, f"services.{name}")
        sup.start("w1", "services.worker", TENSORBUS_WORKER_ID="w1")
        noop = subprocess.Popen([sys.executable, "-m", "bench.burst", "--noop", sup.nats_url],
                                cwd=REPO)
        nc = await connect(sup.nats_url, "bench-client")
        records: list[RequestRecord] = []

        async def on_record(msg) -> None:
            rec = record_decoder.decode(msg.data)
            if isinstance(rec, RequestRecord):
                records.append(rec)

        try:
            await wait_ready(nc, MODEL, 1, timeout=600)
            await nc.subscribe(subjects.TELEMETRY_REQUESTS, cb=on_record)
            warm = bodies(12, inputs)
            await one_at_a_time(nc, warm[:4], timeout)  # first batches of each shape
            lone = await one_at_a_time(nc, warm[4:], timeout)
            burst = bodies(n, inputs)
            floor, floor_wall = await at_once(nc, NOOP, burst, timeout)
            records.clear()
            outs, wall = await at_once(nc, subjects.EMBEDDINGS, burst, timeout)
            after = await one_at_a_time(nc, warm[4:], timeout)
            await nc.flush()
            await asyncio.sleep(1)  # the last records' flight, not synchronisation
        finally:
            await nc.close()
            noop.terminate()
            noop.wait()
    codes = Counter(str(o.status) for o in outs)
    refused = [o.took for o in outs if o.status == 429]
    gw_refused = [r.total_s for r in records if r.status == 429]
    return {
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "machine": f"{platform.machine()}, {os.cpu_count()} cores (shared)",
        "load_average_1m": round(os.getloadavg()[0], 2),
        "command": f"python -m bench.burst --requests {n} --inputs {inputs} --timeout {timeout:g}",
        "burst": {"sent": n, "answered_200": codes.get("200", 0), "refused_429": codes.get("429", 0),
                  "deadline_504": codes.get("504", 0), "other": {k: v for k, v in codes.items()
                                                                if k not in ("200", "429", "504")},
                  "wall_s": round(wall, 2),
                  "retry_after_s": sorted({o.retry_after for o in outs if o.retry_after})[:1]
                  + sorted({o.retry_after for o in outs if o.retry_after})[-1:],
                  **summary(outs)},
        "refusal_ms": {"gateway_p50": pct(gw_refused, 50), "gateway_p99": pct(gw_refused, 99),
                       "gateway_records": len(gw_refused),
                       "client_p50": pct(refused, 50), "client_p99": pct(refused, 99)},
        "noop_floor_ms": {"p50": pct([o.took for o in floor], 50),
                          "p99": pct([o.took for o in floor], 99), "wall_s": round(floor_wall, 2)},
        "lone_ms": {"p50": pct(lone, 50), "max": pct(lone, 100)},
        "after_ms": {"p50": pct(after, 50), "max": pct(after, 100)},
    }


async def noop_responder(url: str) -> None:
    """Answers every request on `bench.noop` at once, shaped like a 429."""
    nc = await connect(url, "bench-noop")
    headers = {HEADER_CODE: "429", HEADER_MESSAGE: "no-op", HEADER_RETRY_AFTER: "1"}
    body = b'{"error":{"message":"no-op","type":"rate_limit_exceeded","code":"overloaded"}}'

    async def cb(msg) -> None:
        await nc.publish(msg.reply, body, headers=headers)

    await nc.subscribe(NOOP, cb=cb, pending_msgs_limit=1_000_000, pending_bytes_limit=1 << 30)
    await nc.flush()
    await asyncio.Event().wait()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--requests", type=int, default=3000)
    ap.add_argument("--inputs", type=int, default=8)
    ap.add_argument("--timeout", type=float, default=30.0)
    ap.add_argument("--noop", metavar="NATS_URL", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.noop:
        asyncio.run(noop_responder(args.noop))
        return
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    with tempfile.TemporaryDirectory() as d:
        res = asyncio.run(run(args.requests, args.inputs, args.timeout, Path(d)))
    print(json.dumps(res, indent=2))
    out = REPO / "bench" / "out"
    out.mkdir(parents=True, exist_ok=True)
    (out / "burst.json").write_text(json.dumps(res, indent=2))


if __name__ == "__main__":
    main()
