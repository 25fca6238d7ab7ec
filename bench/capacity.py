"""Capacity of the serving path alone: an engine that does no math, real processes.

    .venv/bin/python -m bench.capacity [--seconds 10] [--clients 64] [--http] [--gateways 1]
        [--loop auto|asyncio|uvloop]

  1. Start nats-server, gateway, scheduler, telemetry and one worker as processes
     (services/supervisor.py); the worker runs `bench.nomath` (384-dim one-hot
     vectors, no engine time), so every CPU second measured is the serving layer's.
  2. NATS: `--clients` closed-loop clients in this process send one short input per
     request for `--seconds` after a warm-up -> requests/s and latency.
  3. HTTP (`--http`): `wrk` (Debian: `apt-get install -y wrk`) posts the same body to
     `/v1/embeddings` with `--clients` connections on one thread, so the client's own
     cost stays small.
  4. `--gateways 2` runs two gateway processes on the same HTTP port (SO_REUSEPORT)
     and in the same NATS queue group; their CPU is reported per process.
  5. For each phase: CPU seconds (utime + stime from /proc/<pid>/stat) of gateway,
     scheduler, worker, nats-server, telemetry and the client, before and after,
     divided by the requests answered -> milliseconds of CPU per request per process.

`--loop` sets TENSORBUS_EVENT_LOOP for every service process (the client stays on
asyncio), so two runs compare event loops with everything else equal.
All processes share this machine's cores with the client: compare within one run.
Prints one JSON object; bench/out/capacity.json keeps it.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

from bench import harness
from bench.harness import cpu_all, per_request
from services.lifecycle import EVENT_LOOPS
from services.supervisor import Supervisor
from shared import catalog, subjects
from shared.natsd import free_port
from bench.support.load import ClosedLoop, summary
from bench.support.workload import embed_body, short_inputs

MODEL = catalog.ENCODER


async def nats_phase(sup: Supervisor, nc, clients: int, seconds: float) -> dict:
    bodies = [embed_body(MODEL, t) for t in short_inputs(512)]
    warm = ClosedLoop(nc, subjects.EMBEDDINGS, bodies, clients, timeout=30).start()
    await asyncio.sleep(2)  # warm-up window, not synchronisation
    await warm.stop()
    lg = ClosedLoop(nc, subjects.EMBEDDINGS, bodies, clients, timeout=30)
    before, t0 = cpu_all(sup), time.monotonic()
    lg.start()
    await asyncio.sleep(seconds)  # the measurement window
    outcomes = await lg.stop()
    wall = time.monotonic() - t0
    after = cpu_all(sup)
    ok = sum(1 for o in outcomes if o.status == 200)
    return {**summary(outcomes), "rps": round(ok / wall, 1),
            "cpu_ms_per_request": per_request(before, after, ok),
            "cpu_cores": {k: round((after[k] - before[k]) / wall, 2) for k in before}}


WRK_SCRIPT = """wrk.method = "POST"
wrk.headers["Content-Type"] = "application/json"
wrk.body = '%s'
"""


def wrk_phase(sup: Supervisor, port: int, clients: int, seconds: float, workdir: Path) -> dict:
    wrk = shutil.which("wrk")
    if wrk is None:
        return {"skipped": "wrk not installed (Debian: apt-get install -y wrk)"}
    script = workdir / "post.lua"
    script.write_text(WRK_SCRIPT % embed_body(MODEL, short_inputs(1)[0]).decode())
    url = f"http://127.0.0.1:{port}/v1/embeddings"
    base = [wrk, "-t1", f"-c{clients}", "-s", str(script), "--latency"]
    subprocess.run([*base, "-d2s", url], capture_output=True, check=True)  # warm-up
    proc = subprocess.Popen([*base, f"-d{seconds:g}s", url], stdout=subprocess.PIPE, text=True)
    before, t0 = cpu_all(sup, proc.pid), time.monotonic()
    last = before
    while proc.poll() is None:  # wrk's own CPU, read while it still exists
        last = cpu_all(sup, proc.pid)
        time.sleep(0.2)
    wall = time.monotonic() - t0
    after = cpu_all(sup, proc.pid)
    after["client"] = last["client"]
    text = proc.stdout.read()
    done = int(re.search(r"(\d+) requests in", text).group(1))
    bad = re.search(r"Non-2xx or 3xx responses: (\d+)", text)
    errors = re.search(r"Socket errors: (.*)", text)
    lat = dict(re.findall(r"\s+(50|99)%\s+(\S+)", text))
    ok = done - (int(bad.group(1)) if bad else 0)
    return {"requests": done, "non_2xx": done - ok, "socket_errors": errors.group(1) if errors else "",
            "rps": round(ok / wall, 1), "p50": lat.get("50"), "p99": lat.get("99"),
            "cpu_ms_per_request": per_request(before, after, ok),
            "cpu_cores": {k: round((after[k] - before[k]) / wall, 2) for k in before}}


async def run(seconds: float, clients: int, http: bool, workdir: Path, gateways: int = 1,
              loop: str = "auto") -> dict:
    port = free_port()
    env = harness.service_env(MODEL, http_port=port, TENSORBUS_EVENT_LOOP=loop)
    # the worker serves tests/support's mock encoder (bench.nomath), no engine time
    worker = {"worker": {"TENSORBUS_WORKER_ID": "nomath-1"}}
    async with harness.running(workdir, MODEL, sup_env=env, ready_timeout=120,
                               gateways=gateways, worker_module="bench.nomath",
                               workers=worker) as (sup, nc):
        res = {"nats": await nats_phase(sup, nc, clients, seconds)}
        if http:
            res["http"] = await asyncio.to_thread(wrk_phase, sup, port, clients, seconds, workdir)
    command = (f"python -m bench.capacity --seconds {seconds:g} --clients {clients}"
               + (" --http" if http else "") + f" --gateways {gateways} --loop {loop}")
    return {**harness.run_info(command), "event_loop": loop, **res}


def main() -> None:
    ap = harness.parser(__doc__)
    ap.add_argument("--seconds", type=float, default=10.0)
    ap.add_argument("--clients", type=int, default=64)
    ap.add_argument("--http", action="store_true", help="also load HTTP with wrk")
    ap.add_argument("--gateways", type=int, default=1, help="gateway processes")
    ap.add_argument("--loop", default="auto", choices=EVENT_LOOPS,
                    help="TENSORBUS_EVENT_LOOP of every service process")
    args = ap.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    with tempfile.TemporaryDirectory() as d:
        res = asyncio.run(run(args.seconds, args.clients, args.http, Path(d), args.gateways,
                              args.loop))
    print(json.dumps(res, indent=2))
    harness.write_json("capacity.json", res)


if __name__ == "__main__":
    main()
