"""SmolLM2 as a user meets it: the load starts the moment the stack first answers,
and every request is a different prompt with its own answer length.

Each start (a `cold` one on an empty data directory, then a `warm` one on the same
directory, its compilation cache filled by the first, then a `shelf` one whose local
compilation cache, prepared weights and kernels were deleted: an empty local disk,
with the registry's JetStream store holding what the first two published) runs the whole stack as
`scripts/up.sh` does (bench/vs_llamacpp.py's `start_stack`), waits for the first
token of one chat request sent at launch, and at once loads it with a closed-loop
streaming client (OpenAI chat completions over HTTP, SSE, greedy, `ignore_eos`) at
each concurrency in turn, `--seconds` each. A prompt is a question over a passage
of 40 to 400 words drawn from a fixed vocabulary by the request's own seed, so no
two prompts share more than the chat template's start; its answer length is drawn
from 32 to 160 tokens. With `--llama-server PATH` the same client loads llama.cpp's
server on the same GGUF file right after each start of the stack (it starts in
under a second: its start and the load are measured the same way).

Reported per (server, start, concurrency): output tokens/s, requests, errors (any
status but 200, and streams cut short), time to first token p50/p99 and
inter-token latency p50/p99; and per start the seconds from launch to the first
token.

    .venv/bin/python -m bench.realistic --concurrency 1,16 --seconds 30 \
        [--llama-server PATH] --out bench/out/realistic.json
"""

from __future__ import annotations

import asyncio
import json
import random
import shutil
import tempfile
import time
from pathlib import Path

from bench.harness import parser
from bench.support.stats import pct_ms
from bench.vs_llamacpp import (MODEL, first_token_after, one_stream, start_llama,
                                start_stack, stop, wait_ready)

WORDS = ("the a of to and in is it that for on with as was at by an be this from or "
         "river mountain harbour engine signal market winter garden letter station "
         "lantern forest island council bridge archive orchard factory valley storm "
         "teacher farmer pilot doctor painter sailor merchant student soldier baker "
         "carried opened measured repaired followed counted divided painted gathered "
         "quietly slowly early late together alone across beneath beyond during").split()
QUESTIONS = ("Summarise the passage in two sentences.", "Who is the passage about, and why?",
             "List three things that happen in the passage.",
             "What might happen next? Explain briefly.", "Rewrite the first sentence simply.")


def prompt(seed: int) -> tuple[str, int]:
    """(the user message, the answer's max_tokens) of request `seed`."""
    rng = random.Random(seed)
    words = [rng.choice(WORDS) for _ in range(rng.randint(40, 400))]
    passage = " ".join(words).capitalize() + "."
    return f"Passage {seed}: {passage}\n\n{rng.choice(QUESTIONS)}", rng.randint(32, 160)


async def one(client, url: str, seed: int) -> dict:
    """One streamed request (bench/vs_llamacpp.py's client); `error` names what went
    wrong (a status, a broken connection, or a stream cut short)."""
    import httpx

    text, max_tokens = prompt(seed)
    try:
        res = await one_stream(client, url, MODEL, max_tokens, text)
    except httpx.HTTPStatusError as exc:
        return {"tokens": 0, "ttft": None, "gaps": [], "error": str(exc.response.status_code)}
    except httpx.TransportError as exc:
        return {"tokens": 0, "ttft": None, "gaps": [], "error": type(exc).__name__}
    short = "short" if res["tokens"] < max_tokens else ""
    return {**res, "ttft": res["ttft"] or None, "error": short}  # 0.0: no token came


async def load(url: str, concurrency: int, seconds: float, first_seed: int) -> dict:
    import httpx

    results: list[dict] = []
    seeds = iter(range(first_seed, first_seed + 10**6))
    deadline = time.perf_counter() + seconds
    async with httpx.AsyncClient(timeout=600, limits=httpx.Limits(max_connections=256)) as client:

        async def loop() -> None:
            while time.perf_counter() < deadline:
                res = await one(client, url, next(seeds))  # into a local first
                results.append(res)

        t0 = time.perf_counter()
        await asyncio.gather(*(loop() for _ in range(concurrency)))
        wall = time.perf_counter() - t0
    ttfts = [r["ttft"] for r in results if r["ttft"] is not None]
    gaps = [g for r in results for g in r["gaps"]]
    errors: dict[str, int] = {}
    for r in results:
        if r["error"]:
            errors[r["error"]] = errors.get(r["error"], 0) + 1
    return {"concurrency": concurrency, "requests": len(results),
            "tokens_per_s": round(sum(r["tokens"] for r in results) / wall, 1),
            "errors": errors, "ttft_p50_ms": pct_ms(ttfts, 50, 1),
            "ttft_p99_ms": pct_ms(ttfts, 99, 1), "itl_p50_ms": pct_ms(gaps, 50, 1),
            "itl_p99_ms": pct_ms(gaps, 99, 1), "wall_s": round(wall, 1)}  # fmt: skip


async def main_async(args) -> dict:
    conc = [int(c) for c in args.concurrency.split(",") if c]
    doc: dict = {"date": time.strftime("%Y-%m-%d %H:%M"), "model": MODEL,
                 "seconds": args.seconds, "runs": []}
    out_dir = Path(args.out).parent if args.out else Path(tempfile.mkdtemp())
    out_dir.mkdir(parents=True, exist_ok=True)
    seed = 0
    with tempfile.TemporaryDirectory() as tmp:
        data, log = Path(tmp) / "data", out_dir / "realistic_stack.log"
        extra = dict(kv.split("=", 1) for kv in args.env)
        for start in args.starts.split(","):
            if start == "shelf":  # an empty local disk; the registry keeps the fleet's programs
                shutil.rmtree(data / "jax-cache", ignore_errors=True)
            proc, url, t0 = start_stack(data, args.fleet, log, extra)
            try:
                first = await first_token_after(url, t0, MODEL)
                doc[f"first_token_{start}_s"] = first
                print(json.dumps({"start": start, "first_token_s": first}), flush=True)
                for c in conc:
                    res = {"server": "tensorbus", "start": start,
                           **await load(url, c, args.seconds, seed)}
                    seed += 10**6
                    doc["runs"].append(res)
                    print(json.dumps(res), flush=True)
            finally:
                stop(proc)
            if args.llama_server:
                lproc, lurl = start_llama(args.llama_server, out_dir / "realistic_llama.log")
                try:
                    await wait_ready(lurl)
                    for c in conc:  # the same prompts the stack was given at this start
                        res = {"server": "llama.cpp", "start": start,
                               **await load(lurl, c, args.seconds, seed - 10**6 * len(conc)
                                            + 10**6 * conc.index(c))}  # fmt: skip
                        doc["runs"].append(res)
                        print(json.dumps(res), flush=True)
                finally:
                    stop(lproc)
    if args.out:
        Path(args.out).write_text(json.dumps(doc, indent=2))
    return doc


def main(argv=None) -> dict:
    ap = parser(__doc__)
    ap.add_argument("--llama-server", default="", help="path of a llama-server binary")
    ap.add_argument("--concurrency", default="1,16")
    ap.add_argument("--starts", default="cold,warm,shelf", help="in this order")
    ap.add_argument("--seconds", type=float, default=30.0)
    ap.add_argument("--fleet", default="all-MiniLM-L6-v2=0:0,tensorbus-demo-lm=0:0",
                    help="TENSORBUS_FLEET (default: the chat model alone)")
    ap.add_argument("--env", action="append", default=[], metavar="KEY=VALUE",
                    help="more TENSORBUS_* settings for the stack")
    ap.add_argument("--out", default="bench/out/realistic.json")
    return asyncio.run(main_async(ap.parse_args(argv)))


if __name__ == "__main__":
    main()
