"""Fault scenarios against real processes under steady load, with their figures.

    .venv/bin/python -m bench.faults [--requests 400] [--clients 16]

Each scenario runs nats-server, gateway, scheduler and two encoder workers as
separate processes, keeps closed-loop clients busy over NATS, injects one fault and
reports the outcome of every request (the scenarios: bench/support/faults.py, which
tests/reliability runs shorter and asserts on):

  1. kill:    SIGKILL one worker while it holds work; the scheduler expires it and
              re-dispatches what it held to the other worker.
  2. restart: stop nats-server and start it again on the same port and store; every
              service reconnects by itself.
  3. drain:   SIGTERM one worker (a rolling update): it drains and exits 0.

Prints one JSON object per scenario (requests sent, succeeded, failed by code, lost,
recovery time) and writes them all to bench/out/faults.json.
"""

from __future__ import annotations

import asyncio
import json
import os
import tempfile
from pathlib import Path

from bench import harness
from bench.support.faults import drain_worker, kill_worker, restart_nats, running


async def run_all(requests: int, clients: int, workdir: Path) -> list[dict]:
    out = []
    for name, scenario in (("kill", kill_worker), ("restart", restart_nats), ("drain", drain_worker)):
        async with running(workdir / name) as (sup, nc):
            res = await scenario(sup, nc, clients=clients, before=requests // 4,
                                 after=requests - requests // 4)
            print(json.dumps(res), flush=True)
            out.append(res)
    return out


def main() -> None:
    ap = harness.parser(__doc__)
    ap.add_argument("--requests", type=int, default=400, help="per scenario (roughly)")
    ap.add_argument("--clients", type=int, default=16)
    args = ap.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    with tempfile.TemporaryDirectory() as d:
        results = asyncio.run(run_all(args.requests, args.clients, Path(d)))
    command = f"python -m bench.faults --requests {args.requests} --clients {args.clients}"
    harness.write_json("faults.json", {**harness.run_info(command), "scenarios": results})


if __name__ == "__main__":
    main()
