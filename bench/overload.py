"""Overload: ten times capacity for 30 s against real processes.

    .venv/bin/python -m bench.overload [--seconds 30] [--factor 10] [--queue 16]

  1. Start nats-server, gateway, scheduler and one encoder worker as processes, with
     the fleet queue bounded at `--queue` requests per worker.
  2. Unloaded: one client at a time for a few seconds -> p99 of a lone request; then
     closed-loop clients at the batch size -> capacity (requests/s) and its p99.
  3. Overload: an open loop at `factor` x capacity for `seconds`. Every request ends
     200 or 429 (with Retry-After); nothing may be lost.
  4. After: one client again, at once -> p99 must be back to the unloaded figure.
  5. RSS of every process before and after the overload.

Prints one JSON object; bench/out/overload.json keeps it.
"""

from __future__ import annotations

import asyncio
import json
import os
import tempfile
import time
from pathlib import Path

from bench import harness
from bench.harness import memory
from shared import subjects
from bench.support.faults import MODEL, running
from bench.support.load import ClosedLoop, open_loop, summary
from bench.support.workload import embed_body, short_inputs


async def closed(nc, bodies, clients: int, seconds: float) -> dict:
    lg = ClosedLoop(nc, subjects.EMBEDDINGS, bodies, clients, timeout=30).start()
    await asyncio.sleep(seconds)  # a measurement window, not synchronisation
    outcomes = await lg.stop()
    return {**summary(outcomes), "rps": round(len(outcomes) / seconds, 1)}


async def run(seconds: float, factor: float, queue: int, workdir: Path) -> dict:
    bodies = [embed_body(MODEL, t) for t in short_inputs(512)]
    env = {"TENSORBUS_MAX_QUEUE_PER_WORKER": str(queue), "TENSORBUS_LOG_LEVEL": "warning"}
    async with running(workdir, ("w1",), **env) as (sup, nc):
        await closed(nc, bodies, 4, 2)  # warm the paths (first batches of each size)
        lone = await closed(nc, bodies, 1, 5)
        capacity = await closed(nc, bodies, 16, 5)
        mem_before, cpu_before = memory(sup), harness.cpu_all(sup)
        rate = factor * capacity["rps"]
        t0 = time.monotonic()
        outcomes = await open_loop(nc, subjects.EMBEDDINGS, bodies, rate, seconds, timeout=30)
        wall = time.monotonic() - t0
        mem_after, cpu_after = memory(sup), harness.cpu_all(sup)
        after = await closed(nc, bodies, 1, 5)
    over = summary(outcomes)
    return {
        **harness.run_info(f"python -m bench.overload --seconds {seconds:g} --factor {factor:g} "
                           f"--queue {queue}"),
        "queue_per_worker": queue,
        "unloaded_lone": lone, "capacity_c16": capacity,
        "offered_rps": round(rate, 1), "achieved_send_rps": round(len(outcomes) / wall, 1),
        "overload": over,
        "accepted_p99_vs_lone_p99": round(over.get("ok_p99_ms", float("nan")) / lone["ok_p99_ms"], 2),
        "accepted_p99_vs_capacity_p99": round(over.get("ok_p99_ms", float("nan"))
                                              / capacity["ok_p99_ms"], 2),
        "after": after,
        "after_p99_vs_lone_p99": round(after["ok_p99_ms"] / lone["ok_p99_ms"], 2),
        "rss_mb_before": mem_before, "rss_mb_after": mem_after,
        # share of one core each process used during the overload
        "cpu_cores_during_overload": {k: round((cpu_after[k] - cpu_before[k]) / wall, 2)
                                      for k in cpu_before},
    }


def main() -> None:
    ap = harness.parser(__doc__)
    ap.add_argument("--seconds", type=float, default=30.0)
    ap.add_argument("--factor", type=float, default=10.0)
    ap.add_argument("--queue", type=int, default=16, help="TENSORBUS_MAX_QUEUE_PER_WORKER")
    args = ap.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    with tempfile.TemporaryDirectory() as d:
        res = asyncio.run(run(args.seconds, args.factor, args.queue, Path(d)))
    print(json.dumps(res, indent=2))
    harness.write_json("overload.json", res)


if __name__ == "__main__":
    main()
