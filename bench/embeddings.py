"""Embeddings benchmark: the raw engine in-process, then the full stack over NATS.

    .venv/bin/python -m bench.embeddings [--seconds 10] [--skip-torch]

One run measures, on this machine:
  1. engine: JAX sentences/s at batch 64 (short ~16 and long ~128 tokens), batch-1
     latency, and (bench.engine_encoder) torch eager side by side, GFLOP/s, matmul share;
  2. stack: nats-server, gateway, scheduler, one worker and telemetry as separate
     processes; closed-loop clients at concurrency 1, 16 and 64 for each input kind;
  3. writes bench/out/embeddings.json, docs/img/embeddings.png and prints a markdown
     table for docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import tempfile
import time
from pathlib import Path

import numpy as np

from bench.workload import closed_loop, embed_body, long_inputs, short_inputs
from shared import catalog

MODEL = catalog.ENCODER
BATCH_BUCKETS = "1,2,4,8,16,32,64"
SEQ_BUCKETS = "16,32,64,128"
REPO = Path(__file__).resolve().parent.parent


def engine_figures(seconds: float) -> dict:
    from engine import jaxrt
    from engine.encoder import JaxEncoder
    from engine.tokenizer import Tokenizer

    jaxrt.setup(str(REPO / ".data" / "jax-cache"))
    path = catalog.bundled_dir(MODEL)
    tok = Tokenizer.from_dir(path)
    enc = JaxEncoder(path, name=MODEL, batch_buckets=tuple(map(int, BATCH_BUCKETS.split(","))),
                     seq_buckets=tuple(map(int, SEQ_BUCKETS.split(","))), max_batch=64)
    enc.warmup(progress=True)
    out = {}
    for kind, texts in (("short", short_inputs()), ("long", long_inputs())):
        ids = tok.encode_batch(texts)
        batch = ids[:64]
        enc.embed(batch)
        n, t0 = 0, time.perf_counter()
        while time.perf_counter() - t0 < seconds:
            enc.embed(batch)
            n += 64
        out[f"{kind}_batch64_sps"] = n / (time.perf_counter() - t0)
        lat = []
        for i in range(200):
            t = time.perf_counter()
            enc.embed([ids[i % len(ids)]])
            lat.append(time.perf_counter() - t)
        out[f"{kind}_batch1_p50_ms"] = float(np.percentile(np.array(lat) * 1000, 50))
        out[f"{kind}_tokens"] = float(np.mean([len(x) for x in batch]))
    return out


async def stack_figures(seconds: float, workdir: Path) -> dict:
    import nats

    from services.supervisor import Supervisor, wait_ready

    results: dict[str, list[dict]] = {}
    with Supervisor(workdir) as sup:
        sup.start_nats()
        env = dict(TENSORBUS_BATCH_BUCKETS=BATCH_BUCKETS, TENSORBUS_SEQ_BUCKETS=SEQ_BUCKETS,
                   TENSORBUS_MAX_BATCH="64", TENSORBUS_DATA_DIR=str(REPO / ".data"),
                   TENSORBUS_METRICS_PORT="0", TENSORBUS_LOG_LEVEL="warning")
        for name in ("gateway", "scheduler", "worker", "telemetry"):
            sup.start(name, f"services.{name}", **env)
        nc = await nats.connect(sup.nats_url)
        try:
            await wait_ready(nc, MODEL, 1)
            # The first seconds after `ready` run slower (first touches of every
            # executable and buffer); settle before measuring.
            warm = [embed_body(MODEL, t) for t in short_inputs()]
            await closed_loop(nc, "inference.v1.embeddings", warm, 16, 10.0)
            for kind, texts in (("short", short_inputs()), ("long", long_inputs())):
                bodies = [embed_body(MODEL, t) for t in texts]
                results[kind] = []
                # A long batch of 64 takes seconds: measure long inputs for longer.
                window = seconds if kind == "short" else seconds * 3
                for c in (1, 16, 64):
                    r = await closed_loop(nc, "inference.v1.embeddings", bodies, c, window,
                                          warmup_s=window / 5)
                    print(f"stack {kind} c={c}: {r['rps']:.1f} req/s p50 {r['p50_ms']:.2f} ms "
                          f"p99 {r['p99_ms']:.2f} ms errors {r['errors']}", flush=True)
                    results[kind].append(r)
        finally:
            await nc.close()
    return results


def plot(res: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for kind, color in (("short", "tab:blue"), ("long", "tab:orange")):
        rows = res["stack"][kind]
        cs = [r["concurrency"] for r in rows]
        axes[0].plot(cs, [r["rps"] for r in rows], "o-", color=color, label=f"stack, {kind}")
        axes[0].axhline(res["engine"][f"{kind}_batch64_sps"], color=color, ls="--",
                        label=f"raw engine batch 64, {kind}")
        axes[1].plot(cs, [r["p50_ms"] for r in rows], "o-", color=color, label=f"p50 {kind}")
        axes[1].plot(cs, [r["p99_ms"] for r in rows], "s:", color=color, label=f"p99 {kind}")
    axes[0].set(xscale="log", xlabel="concurrent clients", ylabel="sentences / s",
                title="Throughput: full stack vs raw engine")
    axes[1].set(xscale="log", yscale="log", xlabel="concurrent clients", ylabel="ms",
                title="End-to-end latency over NATS")
    for ax in axes:
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)


def table(res: dict) -> str:
    e = res["engine"]
    lines = ["| input | concurrency | stack sentences/s | share of raw engine | p50 ms | p99 ms |",
             "|---|---|---|---|---|---|"]
    for kind in ("short", "long"):
        for r in res["stack"][kind]:
            share = r["rps"] / e[f"{kind}_batch64_sps"]
            lines.append(f"| {kind} | {r['concurrency']} | {r['rps']:.1f} | {share:.0%} | "
                         f"{r['p50_ms']:.2f} | {r['p99_ms']:.2f} |")
    lines.append("")
    lines.append(f"raw engine: short batch 64 {e['short_batch64_sps']:.1f}/s, long batch 64 "
                 f"{e['long_batch64_sps']:.1f}/s; batch-1 p50 short {e['short_batch1_p50_ms']:.2f} ms, "
                 f"long {e['long_batch1_p50_ms']:.2f} ms")
    if "torch" in res:
        lines.append(f"engine vs torch: {json.dumps(res['torch'])}")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seconds", type=float, default=10.0)
    ap.add_argument("--skip-torch", action="store_true")
    args = ap.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    res: dict = {"machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores",
                 "date": time.strftime("%Y-%m-%d"), "seconds": args.seconds}
    res["engine"] = engine_figures(args.seconds)
    print("engine:", json.dumps(res["engine"]), flush=True)
    if not args.skip_torch:
        try:
            from bench.engine_encoder import run as torch_run

            res["torch"] = torch_run(batch=64, kind="short")
        except ImportError:
            pass
    with tempfile.TemporaryDirectory() as d:
        res["stack"] = asyncio.run(stack_figures(args.seconds, Path(d)))
    out = REPO / "bench" / "out"
    out.mkdir(parents=True, exist_ok=True)
    (out / "embeddings.json").write_text(json.dumps(res, indent=2))
    plot(res, REPO / "docs" / "img" / "embeddings.png")
    print(table(res))


if __name__ == "__main__":
    main()
