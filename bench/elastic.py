"""An elastic fleet against a static one sized for the peak, under burst-and-idle load.

    .venv/bin/python -m bench.elastic [--clients 16] [--burst-s 20] [--idle-s 40] [--rounds 2]
                                      [--idle-to-zero-s 10] [--fleets static,elastic]

Each fleet runs in its own stack (nats-server, gateway, scheduler and the local
orchestrator as processes, services/supervisor.py; bench/support/orchestration.py's settings:
the test buckets, fast heartbeats, the encoder's files from the wheel), one after the
other in one run:

  - static: the encoder at `2:2`, both workers ready before the load starts;
  - elastic: the encoder at `0:2` with `TENSORBUS_IDLE_TO_ZERO_S`, starting at zero.

Both get the same load: `rounds` times a burst of `clients` closed-loop clients for
`burst_s` (one short input a request, 30 s deadline), then `idle_s` with no request.
Both use the same scaling settings (target 8 queued or running requests a worker,
scale-down window = the idle-to-zero period), so 16 clients ask for two workers.

Worker-seconds = the integral over the load window of the worker processes running
(alive, draining included), from the orchestrator's FleetStatus on
`tensorbus.v1.orchestrator.status` (every 2 s and at once on a change). Latency is
every burst request's, at the client. The static fleet's start-up is outside the
window (it was running before the load); the elastic fleet's cold starts are inside it.

Writes bench/out/elastic.json and docs/img/elastic.png. The compilation cache is the
suite's (`TENSORBUS_TEST_CACHE`, or .data/test-jax-cache): the static fleet, which
runs first, fills it if it is empty, so the elastic fleet's cold starts see a warm
cache, as a long-running deployment's would.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from bench import harness
from bench.harness import REPO
from services.supervisor import wait_ready
from shared import subjects
from bench.support.load import ClosedLoop, summary
from bench.support.orchestration import MODEL, Watch, default_cache, stack_env, zero_stack
from bench.support.workload import embed_body, short_inputs

DEADLINE_S = 30.0
FLEETS = "static,elastic"


def running_timeline(watch: Watch, t0: float, t1: float) -> list[tuple[float, int]]:
    """(seconds since t0, workers running) steps over [t0, t1], from FleetStatus."""
    steps, last = [], None
    for t, st in watch.statuses:
        for m in st.models:
            if m.model != MODEL:
                continue
            if t <= t0:
                last = m.running
            elif t <= t1 and m.running != (steps[-1][1] if steps else last):
                steps.append((t - t0, m.running))
    start = [(0.0, last if last is not None else (steps[0][1] if steps else 0))]
    return start + steps


def worker_seconds(timeline: list[tuple[float, int]], span: float) -> float:
    total = 0.0
    for (t, n), nxt in zip(timeline, timeline[1:] + [(span, 0)]):
        total += n * (nxt[0] - t)
    return total


async def burst_idle(nc, watch: Watch, clients: int, burst_s: float, idle_s: float,
                     rounds: int) -> dict:
    bodies = [embed_body(MODEL, t) for t in short_inputs(256)]
    headers = {"Tensorbus-Timeout": f"{DEADLINE_S:g}"}
    t0 = time.monotonic()
    phases, bursts, loads = [], [], []
    for _ in range(rounds):
        tb = time.monotonic()
        lg = ClosedLoop(nc, subjects.EMBEDDINGS, bodies, clients, DEADLINE_S + 5, headers).start()
        await asyncio.sleep(burst_s)
        outcomes = await lg.stop()
        te = time.monotonic()
        loads.append(round(os.getloadavg()[0], 2))
        bursts.append(outcomes)
        phases.append(("burst", tb - t0, te - t0))
        await asyncio.sleep(idle_s)
        phases.append(("idle", te - t0, time.monotonic() - t0))
    t1 = time.monotonic()
    await asyncio.sleep(0.1)
    span = t1 - t0
    timeline = running_timeline(watch, t0, t1)
    ws = worker_seconds(timeline, span)
    every = [o for b in bursts for o in b]
    ok = [o.took for o in every if o.status == 200]

    def pct(lat_s, q):
        return harness.pct_ms(lat_s, q, digits=1) if len(lat_s) else None

    per_burst = []
    for b, (_, s, e) in zip(bursts, phases[::2]):
        lat = [o.took for o in b if o.status == 200]
        per_burst.append({"from_s": round(s, 1), "to_s": round(e, 1), **summary(b),
                          "p95_ms": pct(lat, 95), "first_reply_s":
                          round(min((o.sent + o.took for o in b if o.status == 200),
                                    default=t0) - (t0 + s), 2)})
    return {"window_s": round(span, 1), "worker_seconds": round(ws, 1),
            "mean_workers": round(ws / span, 2), **summary(every),
            "p50_ms": pct(ok, 50), "p95_ms": pct(ok, 95), "p99_ms": pct(ok, 99),
            "requests_per_s_in_bursts": round(len(every) / sum(e - s for k, s, e in phases
                                                                  if k == "burst"), 1),
            "bursts": per_burst, "loadavg_1m_after_bursts": loads,
            "phases": [(k, round(s, 2), round(e, 2)) for k, s, e in phases],
            "running": [(round(t, 2), n) for t, n in timeline],
            "latency": [(round(o.sent - t0, 3), round(o.took * 1000, 1)) for o in every
                        if o.status == 200]}


async def one_fleet(name: str, workdir: Path, args) -> dict:
    lo = 2 if name == "static" else 0
    extra = {"TENSORBUS_FLEET": f"{MODEL}={lo}:2", "TENSORBUS_TARGET_QUEUE_PER_REPLICA": "8",
             "TENSORBUS_SCALE_DOWN_S": f"{args.idle_to_zero_s:g}"}
    if name == "elastic":
        extra["TENSORBUS_IDLE_TO_ZERO_S"] = f"{args.idle_to_zero_s:g}"
    env = stack_env(workdir, default_cache(), **extra)
    async with zero_stack(workdir, env) as (_, nc, watch):
        if lo:
            await wait_ready(nc, MODEL, lo, timeout=240)
        else:
            await watch.until(lambda: (m := watch.model(MODEL)) is not None and m.running == 0, 60)
        res = await burst_idle(nc, watch, args.clients, args.burst_s, args.idle_s, args.rounds)
    res = {"fleet": name, "bounds": f"{lo}:2", **{k: v for k, v in extra.items()}, **res}
    print(json.dumps({k: v for k, v in res.items() if k not in ("latency", "running")}),
          flush=True)
    return res


def plot(results: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 1, figsize=(11, 6), sharex=True)
    colors = {"static": "tab:blue", "elastic": "tab:orange"}
    for r in results:
        tl = r["running"] + [(r["window_s"], r["running"][-1][1])]
        xs, ys = zip(*tl)
        label = f"{r['fleet']} {r['bounds']}: {r['worker_seconds']:.0f} worker-s, p95 {r['p95_ms']} ms"
        axes[0].step(xs, ys, where="post", color=colors.get(r["fleet"]), label=label, lw=2)
        lat = np.array(r["latency"])
        if len(lat):
            axes[1].scatter(lat[:, 0], lat[:, 1], s=4, alpha=0.4, color=colors.get(r["fleet"]),
                            label=r["fleet"])
    for k, s, e in results[0]["phases"]:
        if k == "burst":
            for ax in axes:
                ax.axvspan(s, e, color="grey", alpha=0.12)
    axes[0].set(ylabel="workers running", title="Burst and idle: elastic 0:2 against static 2:2 "
                "(grey: bursts)")
    axes[0].set_yticks([0, 1, 2])
    axes[0].legend(fontsize=8, loc="upper right")
    axes[1].set(xlabel="seconds since the load started", ylabel="request latency, ms (log)",
                yscale="log")
    axes[1].legend(fontsize=8, markerscale=4)
    for ax in axes:
        ax.grid(alpha=0.3)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)


async def run_all(args, workdir: Path) -> list[dict]:
    return [await one_fleet(name, workdir / name, args) for name in harness.csv_strs(args.fleets)]


def main() -> None:
    ap = harness.parser(__doc__)
    ap.add_argument("--clients", type=int, default=16)
    ap.add_argument("--burst-s", type=float, default=20.0)
    ap.add_argument("--idle-s", type=float, default=40.0)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--idle-to-zero-s", type=float, default=10.0)
    ap.add_argument("--fleets", default=FLEETS, help=f"comma-separated, of {FLEETS}")
    args = ap.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    started = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    with tempfile.TemporaryDirectory() as d:
        results = asyncio.run(run_all(args, Path(d)))
    report = {**harness.run_info("python -m bench.elastic " + " ".join(sys.argv[1:])),
              "date": started, "loadavg_end": [round(x, 2) for x in os.getloadavg()],
              "fleets": results}
    harness.write_json("elastic.json", report)
    plot(results, REPO / "docs" / "img" / "elastic.png")


if __name__ == "__main__":
    main()
