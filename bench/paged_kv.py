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

3. `--scenario chunked`: SmolLM2 (or `--model`), `--streams` short sequences
   decoding while `--arrivals` prompts of `--long` tokens arrive (at evenly spaced
   steps); each iteration spends at most the prefill chunk on prompts, then one
   decode step, as the worker's runner does. Chunk `--chunk` (512) vs a chunk
   longer than the prompt (the whole prompt between two steps), and a baseline
   with no long prompt: the running streams' inter-token latency p50/p99 (from
   their second token) and the longest gap, the time of one chunk alone, and the
   prompt pieces' own times during the run (median, longest), side by side.

4. `--scenario repeat`: SmolLM2 from its GGUF blocks in `--form` (the served
   default measures its forms; naming one skips that), one chat prompt (the
   llama.cpp comparison's question) answered (`--new` tokens, 64) `--requests`
   times one after another, as a closed-loop client sends it: the time from
   `begin` to the first token of the repeats (everything cached but the last
   token, which a prefill computes), with the default prefill buckets (one token
   the smallest) and with 16 the smallest, side by side.

    .venv/bin/python -m bench.paged_kv --scenario concurrency
    .venv/bin/python -m bench.paged_kv --scenario prefix --requests 12
    .venv/bin/python -m bench.paged_kv --scenario chunked
    .venv/bin/python -m bench.paged_kv --scenario repeat --requests 12

Prints the result and writes it to bench/out/paged_kv-<scenario>.json.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time

from bench import harness
from engine.decoder.static import newest

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
        for slot in engine.make_room(newest):
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
        out[name] = {"slots": slots, "pool_tokens": eng.table.pool.usable * eng.block,
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
        if cached:  # the same questions without the system prompt, on the same engine
            alone = []
            for q in questions:
                t0 = time.perf_counter()
                eng.begin(0, q, _greedy(), 0)
                while eng.prefill_step(0) is None:
                    pass
                alone.append(time.perf_counter() - t0)
                eng.free(0)
            out["question_alone"] = {"ttft_p50_s": round(statistics.median(alone), 4)}
    on, off = out["on"]["ttft_p50_s"], out["off"]["ttft_p50_s"]
    out["cached_over_alone"] = round(on / out["question_alone"]["ttft_p50_s"], 2)
    out["fresh_over_cached"] = round(off / on, 2)
    return out


def _itl_run(eng, streams: list[list[int]], longs: list[list[int]], arrive: list[int],
             new: int, long_new: int) -> dict:
    """Serve `streams` for `new` tokens while `longs[i]` arrives at step `arrive[i]`;
    each iteration: admit, at most one chunk of prompt tokens, one decode step."""
    import jax
    short = {}  # slot -> token arrival times of a short stream
    waiting = [(p, True) for p in streams]
    running: dict[int, tuple[bool, int]] = {}  # slot -> (short?, tokens so far)
    prefilling: dict[int, bool] = {}
    chunk_s: list[float] = []
    step = 0
    while waiting or running or prefilling or step <= max(arrive, default=0):
        waiting += [(p, False) for p, a in zip(longs, arrive) if a == step]
        while waiting:
            slot = next((s for s in range(eng.slots) if s not in running
                         and s not in prefilling), None)
            if slot is None or not eng.can_admit(waiting[0][0]):
                break
            p, is_short = waiting.pop(0)
            eng.begin(slot, p, _greedy(), 0)
            prefilling[slot] = is_short
        left = eng.runner.chunk
        for slot, is_short in list(prefilling.items()):
            if left <= 0:
                break
            n = min(left, eng.prefilling(slot))
            left -= n
            t0 = time.perf_counter()
            first = eng.prefill_step(slot, n)  # returns at once unless it is the last piece
            if not is_short:
                # Wait for the piece here rather than in the next step (the device runs
                # them in order): the stall is the same, and its time is the piece's.
                jax.block_until_ready(eng.runner.state)
                chunk_s.append(time.perf_counter() - t0)
            if first is not None:
                running[slot] = (is_short, 1)
                del prefilling[slot]
                if is_short:
                    short[slot] = [time.perf_counter()]
        for slot in eng.make_room(newest):
            raise RuntimeError(f"preempted slot {slot}: size the pool for the scenario")
        if running:
            eng.step()
            now = time.perf_counter()
            for slot, (is_short, n) in list(running.items()):
                if is_short:
                    short[slot].append(now)
                running[slot] = (is_short, n + 1)
                if n + 1 >= (new if is_short else long_new):
                    eng.free(slot)
                    del running[slot]
        step += 1
    # From each stream's second token: the first gap also holds the other streams'
    # prompts, admitted in the same iterations (TTFT's business, not this figure's).
    gaps = sorted(b - a for times in short.values() for a, b in zip(times[1:], times[2:]))
    q = lambda x: round(1000 * gaps[min(len(gaps) - 1, int(x * len(gaps)))], 1)
    return {"itl_p50_ms": q(0.5), "itl_p99_ms": q(0.99), "itl_max_ms": round(1000 * gaps[-1], 1),
            "gaps": len(gaps), "prefill_pieces": len(chunk_s),
            "piece_ms_median": round(1000 * statistics.median(chunk_s), 1) if chunk_s else 0.0,
            "piece_ms_max": round(1000 * max(chunk_s, default=0.0), 1)}


def _piece_ms(eng, tokens: int, runs: int = 3) -> float:
    """Median time to prefill one piece of `tokens` tokens (alone, to the first token)."""
    from engine.decoder.static import prefill_insert

    times = []
    for i in range(runs):
        t0 = time.perf_counter()
        prefill_insert(eng, 0, [5 + i] + list(range(4000, 4000 + tokens - 1)), _greedy(), 0)
        times.append(time.perf_counter() - t0)
        eng.free(0)
    return round(1000 * statistics.median(times), 1)


def chunked(args) -> dict:
    from engine.decoder import DecoderEngine
    from shared import catalog

    path = catalog.bundled_dir(args.model)
    ctx = 2048
    if args.long + 16 > ctx:
        raise SystemExit(f"--long {args.long}: at most {ctx - 16} tokens here")
    streams = [[100 + i] + list(range(2000 + 7 * i, 2020 + 7 * i)) for i in range(args.streams)]
    longs = [[9 + i] + list(range(3000, 3000 + args.long - 1)) for i in range(args.arrivals)]
    gap = max(1, args.new // (args.arrivals + 1))
    arrive = [gap * (i + 1) for i in range(args.arrivals)]
    out = {"model": args.model, "streams": args.streams, "long_tokens": args.long,
           "arrive_at_steps": arrive}
    runs = [("baseline", args.chunk, []), ("chunked", args.chunk, longs),
            ("whole prompt", ctx, longs)]
    engines = {}
    for name, chunk, these in runs:
        eng = engines.get(chunk)
        if eng is None:
            eng = engines[chunk] = DecoderEngine(
                path, "bench", slots=args.streams + args.arrivals, max_context=ctx,
                prefill_buckets=(32, chunk), decode_windows=(256, ctx), prefill_chunk=chunk,
                prefix_cache=False)
            eng.warmup(progress=False)
        if eng.runner.chunk < args.long:
            out[f"one chunk of {eng.runner.chunk} ms"] = _piece_ms(eng, eng.runner.chunk)
        out[name] = {"chunk": eng.runner.chunk,
                     **_itl_run(eng, streams, these, arrive[: len(these)], args.new, 4)}
        out[name]["loadavg_1m"] = round(os.getloadavg()[0], 2)
        print(name, json.dumps(out[name]), flush=True)
    return out


def repeat(args) -> dict:
    from bench.vs_llamacpp import QUESTION
    from engine.chat import render_chat
    from engine.decoder import DecoderEngine
    from engine.decoder.engine import DEFAULT_BUCKETS
    from shared import catalog

    path = catalog.bundled_dir(args.model)
    out: dict = {"form": args.form}
    engines = {name: DecoderEngine(path, "bench", slots=2, max_context=512,
                                   prefill_buckets=buckets, quant="gguf", quant_form=args.form,
                                   forms_cache=None, compile_ahead="all")  # fmt: skip
               for name, buckets in (("smallest 1", DEFAULT_BUCKETS),
                                     ("smallest 16", tuple(b for b in DEFAULT_BUCKETS if b >= 16)))}
    tok = next(iter(engines.values())).tokenizer
    prompt = tok.encode(render_chat([{"role": "user", "content": QUESTION}], path))

    def answer(eng) -> float:
        """The prompt to its first token (the time returned), then `--new` tokens."""
        t0 = time.perf_counter()
        eng.begin(0, prompt, _greedy(), 0)
        while eng.prefill_step(0) is None:
            pass
        seconds = time.perf_counter() - t0
        for _ in range(args.new - 1):
            eng.make_room(newest)
            eng.step()
        eng.free(0)
        return seconds

    for eng in engines.values():
        eng.warmup(progress=False)  # every shape (compile_ahead "all")
        answer(eng)  # the fresh prompt; it runs what the repeats run once (not timed)
        answer(eng)
    out["prompt_tokens"] = len(prompt)
    times: dict[str, list[float]] = {name: [] for name in engines}
    for _ in range(args.requests):  # alternating: a loaded machine's swings fall on both
        for name, eng in engines.items():
            times[name].append(answer(eng))
    for name, eng in engines.items():
        s = eng.cache_stats()
        out[name] = {"repeat_ttft_p50_ms": round(1000 * statistics.median(times[name]), 2),
                     "tokens_computed_per_repeat": len(prompt) - s.hits // (args.requests + 1)}
    return out


def main() -> None:
    ap = harness.parser(__doc__)
    ap.add_argument("--scenario", choices=("concurrency", "prefix", "chunked", "repeat"),
                    required=True)
    ap.add_argument("--form", default="kernel8", help="repeat: the GGUF compute form")
    ap.add_argument("--requests", type=int, default=96)
    ap.add_argument("--prompt", type=int, default=40)
    ap.add_argument("--new", type=int, default=None)
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--budget-tokens", type=int, default=8192)
    ap.add_argument("--paged-slots", type=harness.csv_ints, default=[64, 128])
    ap.add_argument("--system", type=int, default=480)
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--streams", type=int, default=8)
    ap.add_argument("--long", type=int, default=1500, help="tokens of an arriving prompt")
    ap.add_argument("--arrivals", type=int, default=2)
    ap.add_argument("--chunk", type=int, default=512)
    args = ap.parse_args()
    if args.new is None:  # tokens per sequence: short chats / the running streams
        args.new = 48 if args.scenario == "chunked" else 64
    result = {"concurrency": concurrency, "prefix": prefix, "chunked": chunked,
              "repeat": repeat}[args.scenario](args)
    print(json.dumps(result, indent=2))
    harness.write_json(f"paged_kv-{args.scenario}.json", {
        **harness.run_info("python -m bench.paged_kv " + " ".join(sys.argv[1:])), **result})


if __name__ == "__main__":
    main()
