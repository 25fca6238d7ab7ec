"""The paged KV cache and prefix reuse, measured on the engine alone (no bus).

1. `--scenario concurrency`: N short chats (prompt P tokens, G generated, greedy) on
   the demo LM, at one fixed KV memory budget (`--budget-tokens`, default 8,192:
   the old default of 16 rows of 512). "rows" gives every sequence a whole
   `max_context` (16 slots, a full context each: the old layout's admission);
   "paged" has more slots over the same number of blocks and admits while the pool
   has room (`--paged-slots 64,128`: the default, and more slots than the pool
   can fill). Reported: most sequences decoding at once, steps, wall seconds,
   generated tokens/s.
2. `--scenario prefix`: SmolLM2 (or `--model`), requests sharing a long system
   prompt (~`--system` tokens) with short distinct questions, one after another;
   TTFT = the engine's time from `begin` to the first token (prefill only, nothing
   queued in front). Prefix cache on vs off, same engine shapes, p50 and p99.

    .venv/bin/python -m bench.paged_kv --scenario concurrency
    .venv/bin/python -m bench.paged_kv --scenario prefix --requests 12
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")


def _greedy():
    from shared.messages import Sampling

    return Sampling(temperature=0.0)


def serve(engine, prompts: list[list[int]], new: int) -> dict:
    """Continuous batching as the worker does it, without the bus."""
    waiting = list(range(len(prompts)))
    done = [0] * len(prompts)
    running: dict[int, int] = {}
    most, steps, t0 = 0, 0, time.perf_counter()
    while waiting or running:
        free = [s for s in range(engine.slots) if s not in running]
        while waiting and free and engine.can_admit(prompts[waiting[0]]):
            slot, job = free.pop(0), waiting.pop(0)
            engine.begin(slot, prompts[job], _greedy(), 0)
            while engine.prefill_step(slot) is None:
                pass
            running[slot], done[job] = job, 1
        for slot in engine.make_room():
            waiting.insert(0, running.pop(slot))  # not expected at these sizes
        most = max(most, len(running))
        engine.step()
        steps += 1
        for slot, job in list(running.items()):
            done[job] += 1
            if done[job] >= new:
                engine.free(slot)
                del running[slot]
    wall = time.perf_counter() - t0
    return {"most_concurrent": most, "steps": steps, "wall_s": round(wall, 2),
            "tokens_per_s": round(len(prompts) * new / wall, 1),
            "preemptions": engine.cache_stats().preemptions}


def concurrency(args) -> dict:
    from engine.decoder import DecoderEngine
    from shared.catalog import DEMO_LM, bundled_dir

    path = bundled_dir(DEMO_LM)
    prompt = list(range(300, 300 + args.prompt))
    prompts = [[7 + i] + prompt for i in range(args.requests)]
    blocks = args.budget_tokens // 16
    out = {}
    runs = [("rows", args.budget_tokens // args.context)]
    runs += [(f"paged-{n}", n) for n in args.paged_slots]
    for name, slots in runs:
        kv = blocks + 1 if name != "rows" else 0  # rows: a full context per slot
        eng = DecoderEngine(path, name, slots=slots, max_context=args.context,
                            prefill_buckets=(64,), decode_windows=(128, 256), kv_blocks=kv)
        eng.warmup(progress=False)
        out[name] = {"slots": slots, "pool_tokens": eng.pool.usable * eng.block,
                     **serve(eng, prompts, args.new)}
    return out


def prefix(args) -> dict:
    from engine.decoder import DecoderEngine
    from shared import catalog

    path = catalog.bundled_dir(args.model)
    base = DecoderEngine(path, "probe", slots=1, max_context=64, prefill_buckets=(16,))
    tok = base.tokenizer
    del base
    rules = ("Answer in one short sentence. Be friendly to children and families. "
             "Never invent facts about the exhibits; say you do not know instead. ")
    system = tok.encode(rules * (args.system // 20))[: args.system]
    questions = [tok.encode(f" Question {i}: where is gallery {i} and what is in it?")
                 for i in range(args.requests)]
    out = {"system_tokens": len(system)}
    ctx = 1024
    for cached in (False, True):
        eng = DecoderEngine(path, "bench", slots=2, max_context=ctx,
                            prefill_buckets=(32, 512), decode_windows=(ctx,),
                            prefix_cache=cached)
        eng.warmup(progress=False)
        ttft = []
        for q in questions:
            t0 = time.perf_counter()
            eng.begin(0, system + q, _greedy(), 0)
            while eng.prefill_step(0) is None:
                pass
            ttft.append(time.perf_counter() - t0)
            eng.free(0)
        s = eng.cache_stats()
        ttft.sort()
        out["on" if cached else "off"] = {
            "ttft_p50_s": round(statistics.median(ttft), 4),
            "ttft_p99_s": round(ttft[min(len(ttft) - 1, int(0.99 * len(ttft)))], 4),
            "hit_rate": round(s.hits / s.queries, 3) if s.queries else 0.0}
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--scenario", choices=("concurrency", "prefix"), required=True)
    ap.add_argument("--requests", type=int, default=96)
    ap.add_argument("--prompt", type=int, default=40)
    ap.add_argument("--new", type=int, default=64)
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--budget-tokens", type=int, default=8192)
    ap.add_argument("--paged-slots", type=lambda v: [int(x) for x in v.split(",")],
                    default=[64, 128])
    ap.add_argument("--system", type=int, default=480)
    ap.add_argument("--model", default="smollm2-135m-instruct")
    args = ap.parse_args()
    result = concurrency(args) if args.scenario == "concurrency" else prefix(args)
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
