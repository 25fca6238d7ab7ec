"""A burst far above capacity against the real encoder: admitted work must finish.

    .venv/bin/python -m bench.burst [--requests 3000] [--inputs 8] [--timeout 30]
        [--engine-nice N] [--gateways 1]

  1. Start nats-server, gateway (`--gateways` of them, one queue group), scheduler
     and one encoder worker (the bundled all-MiniLM-L6-v2, JAX) as processes, plus a
     no-op responder process that answers every request on `bench.noop` at once
     with a 429-shaped reply and keeps the gateway's request records
     (`telemetry.v1.requests`), so the client does the same work in the burst as
     against the floor.
  2. Unloaded: a few requests of `--inputs` long inputs (113-128 tokens each), one at
     a time: the scheduler times the model's batches, and this gives the lone latency.
  3. Floor: the same number of requests at once to the no-op responder: what this
     client and nats-server alone need to send them and hear back.
  4. The burst: `--requests` requests at once, each with `Tensorbus-Timeout:
     --timeout`. Every request must be answered: 200, or 429 with Retry-After; an
     admitted request ending in 504 is the failure this guards against. The client
     measures each answer's latency; the gateway's own time for every 429 comes from
     its request records, and so does when (from the burst's start, one clock) the
     gateway began and finished each refusal: the client's 429 latency splits into
     the wait before the gateway reads the request and what follows. CPU milliseconds
     per request of every process over the burst (bench.capacity's /proc reading).
  5. Right after: one request at a time again, against the unloaded latency.

Prints one JSON object; bench/out/burst.json keeps it.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

import msgspec

from bench import harness
from bench.harness import REPO, cpu_all, cpu_s, per_request
from services.supervisor import Supervisor, die_with_parent, wait_ready
from shared import catalog, subjects
from shared.bus import connect
from shared.errors import HEADER_CODE, HEADER_MESSAGE, HEADER_RETRY_AFTER
from shared.telemetry import RequestRecord, record_decoder
from bench.support.load import one, summary
from bench.support.workload import long_inputs

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
    return harness.pct_ms(values, q, digits=1)


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


async def run(n: int, inputs: int, timeout: float, workdir: Path, engine_nice: int = 0,
              gateways: int = 1) -> dict:
    data_dir = workdir / "data"
    harness.seed_jax_cache(data_dir)
    env = harness.service_env(**ENV, TENSORBUS_DATA_DIR=str(data_dir))
    with Supervisor(workdir, env=env) as sup:
        nice = {"TENSORBUS_ENGINE_NICE": str(engine_nice)} if engine_nice else {}
        harness.start_stack(sup, gateways=gateways, telemetry=False, workers={"w1": nice})
        rec_path = workdir / "records.msgpack"
        noop = subprocess.Popen([sys.executable, "-m", "bench.burst", "--noop", sup.nats_url,
                                 "--records", str(rec_path)], cwd=REPO, preexec_fn=die_with_parent)
        nc = await connect(sup.nats_url, "bench-client")
        try:
            await wait_ready(nc, MODEL, 1, timeout=600)
            warm = bodies(12, inputs)
            await one_at_a_time(nc, warm[:4], timeout)  # first batches of each shape
            lone = await one_at_a_time(nc, warm[4:], timeout)
            burst = bodies(n, inputs)
            floor, floor_wall = await at_once(nc, NOOP, burst, timeout)
            burst_wall = time.time()
            before = cpu_all(sup)
            before["noop"] = cpu_s(noop.pid)
            outs, wall = await at_once(nc, subjects.EMBEDDINGS, burst, timeout)
            cpu_after = cpu_all(sup)
            cpu_after["noop"] = cpu_s(noop.pid)
            cpu = per_request(before, cpu_after, n)
            after = await one_at_a_time(nc, warm[4:], timeout)
            await nc.flush()
            await asyncio.sleep(1)  # the last records' flight, not synchronisation
        finally:
            await nc.close()
            noop.terminate()
            noop.wait()
    # The gateway's records of the burst's refusals (the lone requests are all 200)
    records = [r for r in map(record_decoder.decode, msgspec.msgpack.decode(rec_path.read_bytes()))
               if isinstance(r, RequestRecord) and r.finished_at >= burst_wall]
    codes = Counter(str(o.status) for o in outs)
    refused = [o.took for o in outs if o.status == 429]
    gw_refused = [r.total_s for r in records if r.status == 429]
    # when the gateway had answered each refusal, from the burst's start (one clock:
    # the client and the gateway run on this machine)
    gw_done = [r.finished_at - burst_wall for r in records if r.status == 429]
    gw_start = [r.finished_at - r.total_s - burst_wall for r in records if r.status == 429]
    return {
        **harness.run_info(f"python -m bench.burst --requests {n} --inputs {inputs} "
                           f"--timeout {timeout:g} --engine-nice {engine_nice} "
                           f"--gateways {gateways}"),
        "burst": {"sent": n, "answered_200": codes.get("200", 0), "refused_429": codes.get("429", 0),
                  "deadline_504": codes.get("504", 0), "other": {k: v for k, v in codes.items()
                                                                if k not in ("200", "429", "504")},
                  "wall_s": round(wall, 2),
                  "retry_after_s": sorted({o.retry_after for o in outs if o.retry_after})[:1]
                  + sorted({o.retry_after for o in outs if o.retry_after})[-1:],
                  **summary(outs)},
        "refusal_ms": {"gateway_p50": pct(gw_refused, 50), "gateway_p99": pct(gw_refused, 99),
                       "gateway_records": len(gw_refused),
                       # refused after tokenizing (by the scheduler): the late ones
                       "gateway_over_100ms": sum(1 for t in gw_refused if t > 0.1),
                       "gateway_start_p50": pct(gw_start, 50), "gateway_start_p99": pct(gw_start, 99),
                       "gateway_done_p50": pct(gw_done, 50), "gateway_done_p99": pct(gw_done, 99),
                       "client_p50": pct(refused, 50), "client_p99": pct(refused, 99)},
        # over the whole burst (until its last answer), per request sent; worker = compute
        "cpu_ms_per_request": cpu,
        "noop_floor_ms": {"p50": pct([o.took for o in floor], 50),
                          "p99": pct([o.took for o in floor], 99), "wall_s": round(floor_wall, 2)},
        "lone_ms": {"p50": pct(lone, 50), "max": pct(lone, 100)},
        "after_ms": {"p50": pct(after, 50), "max": pct(after, 100)},
    }


async def noop_responder(url: str, records_path: str | None) -> None:
    """Answers every request on `bench.noop` at once, shaped like a 429; keeps the
    gateway's request records (here, not in the client, so that the client's work in
    the burst is the same as against the floor) and writes them out on SIGTERM."""
    nc = await connect(url, "bench-noop")
    kept: list[bytes] = []
    stop = asyncio.Event()
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)

    async def keep(msg) -> None:
        kept.append(msg.data)

    if records_path:
        await nc.subscribe(subjects.TELEMETRY_REQUESTS, cb=keep, pending_msgs_limit=1_000_000,
                           pending_bytes_limit=1 << 30)
    headers = {HEADER_CODE: "429", HEADER_MESSAGE: "no-op", HEADER_RETRY_AFTER: "1"}
    body = b'{"error":{"message":"no-op","type":"rate_limit_exceeded","code":"overloaded"}}'

    async def cb(msg) -> None:
        await nc.publish(msg.reply, body, headers=headers)

    await nc.subscribe(NOOP, cb=cb, pending_msgs_limit=1_000_000, pending_bytes_limit=1 << 30)
    await nc.flush()
    await stop.wait()
    await nc.drain()
    if records_path:
        Path(records_path).write_bytes(msgspec.msgpack.encode(kept))


def main() -> None:
    ap = harness.parser(__doc__)
    ap.add_argument("--requests", type=int, default=3000)
    ap.add_argument("--inputs", type=int, default=8)
    ap.add_argument("--timeout", type=float, default=30.0)
    ap.add_argument("--engine-nice", type=int, default=0,
                    help="the worker's TENSORBUS_ENGINE_NICE (its engine threads' nice value)")
    ap.add_argument("--gateways", type=int, default=1, help="gateway processes")
    ap.add_argument("--noop", metavar="NATS_URL", help=argparse.SUPPRESS)
    ap.add_argument("--records", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.noop:
        asyncio.run(noop_responder(args.noop, args.records))
        return
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    with tempfile.TemporaryDirectory() as d:
        res = asyncio.run(run(args.requests, args.inputs, args.timeout, Path(d), args.engine_nice,
                              args.gateways))
    print(json.dumps(res, indent=2))
    harness.write_json("burst.json", res)


if __name__ == "__main__":
    main()
