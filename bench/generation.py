"""Generation benchmark: a served decoder against its own engine and transformers.

    .venv/bin/python -m bench.generation [--seconds 15] [--max-tokens 64]
    TENSORBUS_ENGINE=torch OMP_NUM_THREADS=1 .venv/bin/python -m bench.generation --stack-only
    .venv/bin/python -m bench.generation --model smollm2-135m-instruct --seconds 20 \
        --max-tokens 32 --max-context 128 --prefill-buckets 16

The served requests are greedy by default, the math of the engine's static run, so
the ratio between the two is the serving path's share alone; `--temperature 0.7`
adds the sampling's own cost (a softmax and a cumulative sum over the vocabulary
per slot and step) to the served side only. `--engine-threads 1` gives the engine
run and the worker one XLA thread (NPROC): on a two-core machine the demo LM's
batch-16 step is faster on one thread than on two, and the serving processes keep
the other core.

The default model is the demo LM; `--model` takes another bundled decoder (SmolLM2,
read from its GGUF file by the engine, the worker and transformers alike), with
`--max-context` (the worker's and the engine's KV length, which also caps the
worker's prompt buckets) to keep compile time and step time small.

One run measures, on this machine:
  1. bench.engine_decoder: the engine's static batch-16 decode tokens/s and sequential
     transformers `generate` tokens/s on the same weights;
  2. the full stack (nats-server, gateway, scheduler, a decoder worker with 16 slots,
     telemetry as separate processes) with closed-loop streaming clients at
     concurrency 1, 4 and 16: output tokens/s (each stream's tokens from its final
     `usage`, so a chunk covering several tokens counts them all), time to first
     token and inter-token latency (p50/p99), measured at the client from the arrival
     times of the chunks that carry text (a coalesced chunk is one arrival), and the
     tokens per chunk;
  3. CPU per token of every process (gateway, scheduler, worker, telemetry,
     nats-server, and this client): utime + stime from /proc before and after each
     phase (bench.capacity's helpers), over the tokens delivered, in microseconds;
  4. writes bench/out/generation.json, docs/img/generation.png and a markdown table
     (another model: generation-MODEL.json and generation-MODEL.png).
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
import numpy as np

from bench import harness
from bench.harness import REPO, cpu_all, per_request
from shared import catalog

MODEL = catalog.DEMO_LM
PROMPTS = ["The module", "This function returns", "A list of", "The default value is",
           "When the file", "An exception is raised", "The following example", "In Python"]


async def stream_once(nc, body: bytes, timeout: float = 60.0) -> tuple[float, list[float], int]:
    """Send one streaming request (`include_usage`); (send time, arrival times of the
    chunks with choices, completion tokens from the final usage)."""
    inbox = nc.new_inbox()
    sub = await nc.subscribe(inbox)
    t0 = time.perf_counter()
    await nc.publish("inference.v1.completions", body, reply=inbox)
    arrivals, tokens = [], 0
    while True:
        msg = await sub.next_msg(timeout=timeout)
        if msg.data == b"[DONE]":
            break
        chunk = msgspec.json.decode(msg.data)
        if chunk.get("choices"):
            arrivals.append(time.perf_counter())
        elif chunk.get("usage"):
            tokens = chunk["usage"]["completion_tokens"]
        if (msg.headers or {}).get("Nats-Service-Error-Code"):
            raise RuntimeError(msg.data.decode())
    await sub.unsubscribe()
    return t0, arrivals, tokens


async def load(nc, concurrency: int, seconds: float, max_tokens: int, model: str = MODEL,
               sup=None, temperature: float = 0.0) -> dict:
    ttft, itl, tokens, done, chunks = [], [], 0, 0, 0
    t_end = time.perf_counter() + seconds
    t_start = time.perf_counter()

    async def client(i: int) -> None:
        nonlocal tokens, done, chunks
        k = i
        while time.perf_counter() < t_end:
            body = msgspec.json.encode({"model": model, "prompt": PROMPTS[k % len(PROMPTS)],
                                        "max_tokens": max_tokens, "temperature": temperature,
                                        "seed": k,
                                        "ignore_eos": True, "stream": True,
                                        "stream_options": {"include_usage": True}})
            t0, arr, n = await stream_once(nc, body)
            k += concurrency
            if arr:
                ttft.append(arr[0] - t0)
                itl.extend(np.diff(arr).tolist())
            tokens += n
            chunks += len(arr)
            done += 1

    before = cpu_all(sup) if sup is not None else None
    await asyncio.gather(*(client(i) for i in range(concurrency)))
    wall = time.perf_counter() - t_start
    cpu = {}
    if before is not None:  # microseconds of CPU per delivered token, per process
        cpu = {k: round(v * 1000, 1) for k, v in per_request(before, cpu_all(sup), tokens).items()}
    def ms(lat_s: list[float], q: float) -> float:
        return harness.pct_ms(lat_s, q, digits=None)

    return {"concurrency": concurrency, "requests": done, "tokens": tokens,
            "tokens_per_s": tokens / wall,
            "ttft_p50_ms": ms(ttft, 50), "ttft_p99_ms": ms(ttft, 99),
            "itl_p50_ms": ms(itl, 50), "itl_p99_ms": ms(itl, 99),
            "tokens_per_chunk": round(tokens / max(chunks, 1), 2), "cpu_us_per_token": cpu}


async def stack_figures(seconds: float, max_tokens: int, workdir: Path, model: str = MODEL,
                        max_context: int = 0, temperature: float = 0.0,
                        concurrency: tuple[int, ...] = (1, 4, 16)) -> list[dict]:
    import nats

    from services.supervisor import Supervisor, wait_ready

    rows = []
    with Supervisor(workdir) as sup:
        worker = {"TENSORBUS_MODEL": model, "TENSORBUS_DECODE_SLOTS": "16"}
        if max_context:
            worker["TENSORBUS_MAX_CONTEXT"] = str(max_context)
        harness.start_stack(sup, workers={"worker": worker},
                            **harness.service_env(TENSORBUS_DATA_DIR=str(REPO / ".data")))
        nc = await nats.connect(sup.nats_url)
        try:
            await wait_ready(nc, model, 1, timeout=600)
            await load(nc, 4, 2.0, 8, model)  # warm the path
            for c in concurrency:
                r = await load(nc, c, seconds, max_tokens, model, sup, temperature)
                r["loadavg_1m"] = round(os.getloadavg()[0], 2)
                print(f"stack c={c}: {r['tokens_per_s']:.1f} tok/s ttft p50 {r['ttft_p50_ms']:.1f} "
                      f"p99 {r['ttft_p99_ms']:.1f} ms itl p50 {r['itl_p50_ms']:.2f} "
                      f"p99 {r['itl_p99_ms']:.2f} ms, {r['tokens_per_chunk']} tokens/chunk, "
                      f"CPU us/token {r['cpu_us_per_token']} (load {r['loadavg_1m']})", flush=True)
                rows.append(r)
        finally:
            await nc.close()
    return rows


def plot(res: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = res["stack"]
    cs = [r["concurrency"] for r in rows]
    fig, axes = plt.subplots(1, 3, figsize=(14, 4))
    axes[0].plot(cs, [r["tokens_per_s"] for r in rows], "o-", label="served, streaming")
    axes[0].axhline(res["engine"]["engine"]["decode_tokens_per_s"], ls="--", color="tab:green",
                    label="engine static batch 16")
    axes[0].axhline(res["engine"]["transformers_sequential"]["tokens_per_s"], ls=":", color="tab:red",
                    label="transformers generate, sequential")
    axes[0].set(xlabel="concurrent streams", ylabel="output tokens / s",
                title=f"Throughput: {res.get('model', MODEL)}")
    for ax, key, title in ((axes[1], "ttft", "Time to first token"), (axes[2], "itl", "Inter-token latency")):
        ax.plot(cs, [r[f"{key}_p50_ms"] for r in rows], "o-", label="p50")
        ax.plot(cs, [r[f"{key}_p99_ms"] for r in rows], "s:", label="p99")
        ax.set(xlabel="concurrent streams", ylabel="ms", title=title)
    for ax in axes:
        ax.set_xscale("log", base=2)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)


def table(res: dict) -> str:
    eng = res["engine"]["engine"]["decode_tokens_per_s"]
    hf = res["engine"]["transformers_sequential"]["tokens_per_s"]
    lines = ["| streams | tokens/s | vs transformers | vs engine batch 16 | TTFT p50 / p99 ms | "
             "ITL p50 / p99 ms | tokens/chunk | CPU us/token worker / gateway / nats-server / client |",
             "|---|---|---|---|---|---|---|---|"]
    for r in res["stack"]:
        cpu = r.get("cpu_us_per_token") or {}
        us = " / ".join(f"{cpu.get(k, float('nan')):.0f}" for k in ("worker", "gateway", "nats-server", "client"))
        lines.append(f"| {r['concurrency']} | {r['tokens_per_s']:.1f} | {r['tokens_per_s'] / hf:.1f}x | "
                     f"{r['tokens_per_s'] / eng:.0%} | {r['ttft_p50_ms']:.1f} / {r['ttft_p99_ms']:.1f} | "
                     f"{r['itl_p50_ms']:.2f} / {r['itl_p99_ms']:.2f} | {r.get('tokens_per_chunk', 1)} | {us} |")
    lines.append(f"\nengine static batch 16: {eng:.1f} tokens/s; transformers sequential: {hf:.1f} tokens/s")
    return "\n".join(lines)


def main() -> None:
    ap = harness.parser(__doc__)
    ap.add_argument("--seconds", type=float, default=15.0)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--model", default=MODEL, help="a bundled decoder (default: the demo LM)")
    ap.add_argument("--max-context", type=int, default=512,
                    help="KV length per slot of the worker and the engine run")
    ap.add_argument("--prefill-buckets", default="",
                    help="comma-separated prompt buckets of the engine run (default: the engine's)")
    ap.add_argument("--hf-requests", type=int, default=3, help="sequential transformers requests")
    ap.add_argument("--stack-only", action="store_true",
                    help="only the served figures, printed (no engine run, no files written); "
                         "the worker takes TENSORBUS_ENGINE and the rest from the environment")
    ap.add_argument("--temperature", type=float, default=0.0,
                    help="the served requests' (default 0, greedy: the static run's math; "
                         "0.7 adds the sampling's own cost to every step)")
    ap.add_argument("--engine-threads", type=int, default=0,
                    help="XLA's threads for the engine run and the worker (NPROC; default: "
                         "every core)")
    ap.add_argument("--concurrency", default="1,4,16", help="comma-separated stream counts")
    args = ap.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    if args.engine_threads:  # before JAX starts here; the worker inherits it
        os.environ["NPROC"] = str(args.engine_threads)
    streams = tuple(harness.csv_ints(args.concurrency))
    if args.stack_only:
        with tempfile.TemporaryDirectory() as d:
            rows = asyncio.run(stack_figures(args.seconds, args.max_tokens, Path(d), args.model,
                                             args.max_context, args.temperature, streams))
        print(json.dumps(rows, indent=2))
        return
    from bench.engine_decoder import run as engine_run
    from engine import jaxrt

    jaxrt.setup(str(REPO / ".data" / "jax-cache"))
    res: dict = {**harness.run_info("python -m bench.generation " + " ".join(sys.argv[1:])),
                 "model": args.model,
                 "max_tokens": args.max_tokens, "max_context": args.max_context,
                 "temperature": args.temperature, "engine_threads": args.engine_threads or "all",
                 "loadavg_start": [round(x, 2) for x in os.getloadavg()]}
    buckets = tuple(harness.csv_ints(args.prefill_buckets)) or None
    res["engine"] = engine_run(max_new=args.max_tokens, hf_requests=args.hf_requests,
                               max_context=args.max_context, model=args.model,
                               prefill_buckets=buckets)
    res["engine"]["loadavg_1m"] = round(os.getloadavg()[0], 2)
    print("engine:", json.dumps(res["engine"]), flush=True)
    with tempfile.TemporaryDirectory() as d:
        res["stack"] = asyncio.run(stack_figures(args.seconds, args.max_tokens, Path(d), args.model,
                                                 args.max_context, args.temperature, streams))
    res["loadavg_end"] = [round(x, 2) for x in os.getloadavg()]
    name = "generation" if args.model == MODEL else f"generation-{args.model}"
    harness.write_json(f"{name}.json", res)
    plot(res, REPO / "docs" / "img" / f"{name}.png")
    print(table(res))


if __name__ == "__main__":
    main()
