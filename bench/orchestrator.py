"""The local orchestrator against real processes: a killed worker, and the way up from zero.

    .venv/bin/python -m bench.orchestrator [--requests 400] [--clients 8] [--scenarios replace,zero-warm,zero-cold,up]

  1. replace: `honcho start` on the repository's Procfile (nats, gateway, scheduler,
     orchestrator, telemetry) with two encoder workers; closed-loop clients over NATS;
     SIGKILL one worker process while it holds work. Reports every request's outcome
     and the time from the kill to the replacement's first `ready` heartbeat.
  2. zero: gateway, scheduler and orchestrator (services/supervisor.py) with the
     encoder at minimum 0, so it starts at zero; the time from the first request to
     its reply, with the compilation cache warm (the suite's) and cold (empty).
  3. up: what `scripts/up.sh` serves by default, cold (empty compilation cache):
     the encoder and the chat model ready, then a chat request to each, and one to
     the demo LM, which starts on that request.

Prints one JSON object per scenario and writes them to bench/out/orchestrator.json.
The stacks and the first two scenarios are bench/support/orchestration.py's, which
tests/integration/test_orchestrator.py runs shorter.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import msgspec

from bench import harness
from shared import catalog, subjects
from shared.bus import connect
from bench.support.load import one
from bench.support.orchestration import (DEMO_LM, MODEL, Honcho, Watch, default_cache,
                                         first_request_at_zero, honcho_stack, kill_worker,
                                         stack_env, zero_stack)


async def up_defaults(workdir: Path, jax_cache: Path) -> dict:
    """What `scripts/up.sh` serves by default (every bundled model at 1 worker, the demo
    LM at 0:1), from the registry: the time until the encoder and the chat model are
    ready, then one chat request to each of them; the demo LM's starts at zero."""
    env = stack_env(workdir, jax_cache, TENSORBUS_FLEET=f"{DEMO_LM}=0:1", TENSORBUS_MIN_WORKERS="1")
    env.pop("TENSORBUS_MODEL_DIR")
    h = Honcho(workdir, env)
    t0 = time.monotonic()
    nc = await connect(h.url, "bench-client")
    watch = await Watch().start(nc)
    out: dict = {"scenario": "up.sh defaults"}
    try:
        def ready(m: str) -> bool:
            s = watch.model(m)
            return s is not None and s.state == "ready"

        await watch.until(lambda: ready(MODEL) and ready(catalog.SMOLLM2), timeout=600)
        out["encoder_and_chat_ready_s"] = round(time.monotonic() - t0, 1)
        for model in (catalog.SMOLLM2, DEMO_LM):
            body = msgspec.json.encode({"model": model, "max_tokens": 8,
                                        "messages": [{"role": "user", "content": "Say hi"}]})
            o = await one(nc, subjects.CHAT_COMPLETIONS, body, 600, {"Tensorbus-Timeout": "590"})
            out[f"{model}_first_chat"] = {"status": o.status, "s": round(o.took, 2)}
        out["honcho_alive"] = h.alive()
    finally:
        await watch.stop()
        await nc.close()
        h.stop()
    return out


async def run_all(requests: int, clients: int, workdir: Path, scenarios: list[str]) -> list[dict]:
    out = []
    if "replace" in scenarios:
        env = stack_env(workdir / "replace", default_cache(), TENSORBUS_FLEET=f"{MODEL}=2:2")
        async with honcho_stack(workdir / "replace", env) as (h, nc):
            res = await kill_worker(h, nc, clients, before=requests // 4,
                                    after=requests - requests // 4)
        print(json.dumps(res), flush=True)
        out.append(res)
    for name in ("warm", "cold"):
        if f"zero-{name}" not in scenarios:
            continue
        cache = default_cache() if name == "warm" else workdir / "cold-cache"
        env = stack_env(workdir / f"zero-{name}", cache, TENSORBUS_FLEET=f"{MODEL}=0:1",
                        TENSORBUS_IDLE_TO_ZERO_S="30")
        async with zero_stack(workdir / f"zero-{name}", env) as (_, nc, watch):
            res = {"scenario": f"zero ({name} compilation cache)",
                   **await first_request_at_zero(nc, watch, timeout=300)}
        print(json.dumps(res), flush=True)
        out.append(res)
    if "up" in scenarios:
        res = await up_defaults(workdir / "up", workdir / "up-cache")
        print(json.dumps(res), flush=True)
        out.append(res)
    return out


SCENARIOS = "replace,zero-warm,zero-cold,up"


def main() -> None:
    ap = harness.parser(__doc__)
    ap.add_argument("--requests", type=int, default=400)
    ap.add_argument("--clients", type=int, default=8)
    ap.add_argument("--scenarios", default=SCENARIOS, help=f"comma-separated, of {SCENARIOS}")
    args = ap.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    with tempfile.TemporaryDirectory() as d:
        results = asyncio.run(run_all(args.requests, args.clients, Path(d),
                                      harness.csv_strs(args.scenarios)))
    command = "python -m bench.orchestrator " + " ".join(sys.argv[1:])
    harness.write_json("orchestrator.json", {**harness.run_info(command), "scenarios": results})


if __name__ == "__main__":
    main()
