"""The gateway's cost of a refusal alone: every request refused, no engine running.

    .venv/bin/python -m bench.refusals [--requests 3000] [--inputs 8] [--rounds 5]

  1. Start nats-server and one gateway as processes, and the no-op responder of
     bench.burst (the floor: this client and nats-server alone).
  2. This process plays a ready worker and a scheduler: a heartbeat of a ready
     encoder worker and a load report of work far above the queue bound, every
     0.5 s. So the gateway refuses every request before tokenizing (429), as it
     does in bench.burst once the queue is full, but with nothing else on the cores.
  3. Each round: `--requests` requests of `--inputs` long inputs at once to the no-op
     responder, then to the gateway; latency p50 / p99 of each, and CPU milliseconds
     per request of the gateway, nats-server and the client (/proc).

Prints one JSON object; bench/out/refusals.json keeps it.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

from bench import harness
from bench.burst import MODEL, NOOP, at_once, bodies, pct
from bench.harness import REPO, cpu_all, per_request
from services.supervisor import Supervisor, die_with_parent
from shared import subjects
from shared.bus import connect
from shared.messages import ModelLoad, SchedLoad, encode
from shared.telemetry import Heartbeat
from shared.telemetry import encode as encode_record


async def play_fleet(nc, stop: asyncio.Event) -> None:
    """A ready worker and a scheduler whose queue holds ~500 s of work."""
    while not stop.is_set():
        hb = Heartbeat(worker_id="bench-worker", model=MODEL, kind="encoder", state="ready",
                       versions=["local"], queue_depth=0, in_flight=0, max_batch=32,
                       batch_occupancy=0.0, steps=1, rss_bytes=0, device="cpu",
                       sent_at=time.time())  # fmt: skip
        await nc.publish(subjects.TELEMETRY_WORKERS, encode_record(hb))
        load = ModelLoad(MODEL, requests=500, inputs=4000, tokens=500_000, cost_per_token=0.001)
        await nc.publish(subjects.SCHED_LOAD, encode(SchedLoad("bench-scheduler", [load], time.time())))
        try:
            await asyncio.wait_for(stop.wait(), 0.5)
        except TimeoutError:
            pass


async def run(n: int, inputs: int, rounds: int, workdir: Path) -> dict:
    with Supervisor(workdir, env=harness.service_env()) as sup:
        # the gateway alone: play_fleet below stands in for the scheduler and worker
        harness.start_stack(sup, scheduler=False, telemetry=False)
        noop = subprocess.Popen([sys.executable, "-m", "bench.burst", "--noop", sup.nats_url],
                                cwd=REPO, preexec_fn=die_with_parent)
        nc = await connect(sup.nats_url, "bench-client")
        stop = asyncio.Event()
        fleet = asyncio.create_task(play_fleet(nc, stop))
        data = bodies(n, inputs)
        out = []
        try:
            while True:  # until the gateway has heard the fleet and refuses
                outs, _ = await at_once(nc, subjects.EMBEDDINGS, data[:1], 30)
                if outs[0].status == 429:
                    break
            for _ in range(rounds):
                floor, floor_wall = await at_once(nc, NOOP, data, 30)
                before = cpu_all(sup)
                outs, wall = await at_once(nc, subjects.EMBEDDINGS, data, 30)
                cpu = per_request(before, cpu_all(sup), n)
                out.append({"codes": dict(Counter(str(o.status) for o in outs)),
                            "floor_ms": {"p50": pct([o.took for o in floor], 50),
                                         "p99": pct([o.took for o in floor], 99),
                                         "wall_s": round(floor_wall, 2)},
                            "refused_ms": {"p50": pct([o.took for o in outs], 50),
                                           "p99": pct([o.took for o in outs], 99),
                                           "wall_s": round(wall, 2)},
                            "cpu_ms_per_request": cpu})
        finally:
            stop.set()
            await fleet
            await nc.close()
            noop.terminate()
            noop.wait()
    return {**harness.run_info(f"python -m bench.refusals --requests {n} --inputs {inputs} "
                               f"--rounds {rounds}"), "rounds": out}


def main() -> None:
    ap = harness.parser(__doc__)
    ap.add_argument("--requests", type=int, default=3000)
    ap.add_argument("--inputs", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    with tempfile.TemporaryDirectory() as d:
        res = asyncio.run(run(args.requests, args.inputs, args.rounds, Path(d)))
    print(json.dumps(res, indent=2))
    harness.write_json("refusals.json", res)


if __name__ == "__main__":
    main()
