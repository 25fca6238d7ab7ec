"""Soak: half of capacity for many minutes against real processes (not run in CI).

    .venv/bin/python -m bench.soak [--minutes 10] [--share 0.5]

  1. Start nats-server, gateway, scheduler, one encoder worker and telemetry as
     processes; measure capacity with closed-loop clients at the batch size.
  2. An open loop at `share` x capacity, minute after minute: per minute the requests
     sent, succeeded, failed by code, lost, p50/p99, and the RSS of every process.
  3. Memory at start and end: a leak shows as RSS that keeps growing minute by minute.

Prints one JSON line per minute and a final JSON object (bench/out/soak.json).
"""

from __future__ import annotations

import asyncio
import json
import os
import tempfile
from pathlib import Path

from bench import harness
from bench.harness import memory
from bench.overload import closed
from shared import subjects
from bench.support.faults import MODEL, running
from bench.support.load import open_loop, summary
from bench.support.workload import embed_body, short_inputs


async def run(minutes: int, share: float, workdir: Path) -> dict:
    bodies = [embed_body(MODEL, t) for t in short_inputs(512)]
    async with running(workdir, ("w1",), TENSORBUS_LOG_LEVEL="warning") as (sup, nc):
        sup.start("telemetry", "services.telemetry")
        await closed(nc, bodies, 4, 2)  # warm-up
        capacity = await closed(nc, bodies, 16, 10)
        rate = share * capacity["rps"]
        start_mem = memory(sup)
        print(json.dumps({"capacity_rps": capacity["rps"], "rate": round(rate, 1),
                          "rss_mb": start_mem}), flush=True)
        per_minute = []
        for m in range(minutes):
            outcomes = await open_loop(nc, subjects.EMBEDDINGS, bodies, rate, 60, timeout=30)
            row = {"minute": m + 1, **summary(outcomes), "rss_mb": memory(sup),
                   "alive": all(p.alive() for p in sup.procs.values())}
            print(json.dumps(row), flush=True)
            per_minute.append(row)
        end_mem = memory(sup)
    total = {k: sum(r[k] for r in per_minute) for k in ("sent", "succeeded", "lost")}
    failed: dict[str, int] = {}
    for r in per_minute:
        for code, n in r["failed"].items():
            failed[code] = failed.get(code, 0) + n
    return {
        **harness.run_info(f"python -m bench.soak --minutes {minutes} --share {share:g}"),
        "capacity": capacity, "rate_rps": round(rate, 1), **total, "failed": failed,
        "p99_ms_first_minute": per_minute[0].get("ok_p99_ms") if per_minute else None,
        "p99_ms_last_minute": per_minute[-1].get("ok_p99_ms") if per_minute else None,
        "rss_mb_start": start_mem, "rss_mb_end": end_mem, "minutes": per_minute,
    }


def main() -> None:
    ap = harness.parser(__doc__)
    ap.add_argument("--minutes", type=int, default=10)
    ap.add_argument("--share", type=float, default=0.5, help="of the measured capacity")
    args = ap.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    with tempfile.TemporaryDirectory() as d:
        res = asyncio.run(run(args.minutes, args.share, Path(d)))
    print(json.dumps({k: v for k, v in res.items() if k != "minutes"}, indent=2))
    harness.write_json("soak.json", res)


if __name__ == "__main__":
    main()
