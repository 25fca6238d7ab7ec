"""Prefix-aware vs least-loaded routing over two decoder workers, as real processes.

    PYTHONPATH=. .venv/bin/python -m bench.prefix_routing [--systems 6] [--conversations 6]
        [--turns 4] [--clients 4] [--kv-blocks 96]

A shared-prefix chat workload: `--systems` distinct system prompts of ~`--system`
tokens; for each, `--conversations` conversations of `--turns` turns (a short
question, a `--new`-token greedy answer streamed back; each follow-up's prompt is
the whole conversation so far, the answer's text included). `--clients` closed-loop
clients each take the next conversation and play its turns one after another.

Each routing mode gets a fresh stack (nats-server, gateway, scheduler, two workers
of the demo LM, each its own process, same settings but the routing one):
"prefix" (default routing) and "least-loaded" (`TENSORBUS_PREFIX_ROUTE_IMBALANCE=-1`).
Reported per mode: the prefix-cache hit rate (tokens found / tokens looked up, both
workers, from their heartbeats' counters), TTFT p50/p99 at the client, generated
tokens/s and requests/s over the run.

The demo LM (512-token context), not SmolLM2: on this 2-core machine two SmolLM2
workers prefilling 1,000-token prompts would take far longer than a benchmark can
run. Its context caps the system prompts near 320 tokens (four turns must fit).
Each worker's KV pool (`--kv-blocks`, blocks of 16) holds about half of them: the
regime routing is for, where the fleet's cache is larger than one worker's. With a
pool that holds every system prompt, least-loaded routing also ends up with every
prompt cached on both workers and only the first request of each prompt per worker
misses.
Prints the result and writes it to bench/out/prefix_routing.json.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import sys
import tempfile
import time
from pathlib import Path

import msgspec

from bench import harness
from shared import catalog, subjects

MODEL = catalog.DEMO_LM
WORDS = ("you are a careful assistant for a museum that answers visitors about the "
         "galleries opening hours tickets exhibits paintings sculptures maps cafe shop "
         "accessibility lifts toilets guided tours school groups families children rules "
         "photography bags coats lockers prices members discounts events lectures").split()


def texts(args) -> tuple[list[str], list[list[str]]]:
    """System prompts and, per conversation, its questions (deterministic)."""
    from engine.tokenizer import Tokenizer

    tok = Tokenizer.from_dir(catalog.bundled_dir(MODEL))
    rng = random.Random(11)
    systems = []
    for s in range(args.systems):
        words = [f"Rule set {s}."]
        while len(tok.encode(" ".join(words))) < args.system:
            words.append(rng.choice(WORDS))
        systems.append(" ".join(words[:-1]) + "\n")
    questions = [[f"Q{t}: " + " ".join(rng.choice(WORDS) for _ in range(8)) + "?\nA:"
                  for t in range(args.turns)] for _ in range(args.systems * args.conversations)]
    return systems, questions


async def stream(nc, prompt: str, new: int, timeout: float = 120.0) -> tuple[float, str, int]:
    """One streaming completion -> (TTFT s, generated text, tokens)."""
    body = msgspec.json.encode({"model": MODEL, "prompt": prompt, "max_tokens": new,
                                "temperature": 0, "ignore_eos": True, "stream": True})
    inbox = nc.new_inbox()
    sub = await nc.subscribe(inbox)
    t0 = time.perf_counter()
    await nc.publish(subjects.COMPLETIONS, body, reply=inbox)
    first, text, tokens = None, [], 0
    try:
        while True:
            msg = await sub.next_msg(timeout=timeout)
            if msg.data == b"[DONE]":
                break
            if (msg.headers or {}).get("Nats-Service-Error-Code"):
                raise RuntimeError(msg.data.decode())
            chunk = msgspec.json.decode(msg.data)
            if chunk.get("choices"):
                first = first or time.perf_counter()
                text.append(chunk["choices"][0].get("text", ""))
                tokens += 1
    finally:
        await sub.unsubscribe()
    return (first or time.perf_counter()) - t0, "".join(text), tokens


class Counters:
    """The latest heartbeat of each worker (prefix-cache counters)."""

    def __init__(self) -> None:
        self.last: dict[str, object] = {}

    async def start(self, nc) -> None:
        from shared.telemetry import heartbeat_decoder

        async def on_hb(msg) -> None:
            hb = heartbeat_decoder.decode(msg.data)
            if hb.model == MODEL:
                self.last[hb.worker_id] = hb

        await nc.subscribe(subjects.TELEMETRY_WORKERS, cb=on_hb)

    async def settled(self, workers: int, timeout: float = 300.0) -> None:
        """Until every worker serves the registry's version of the model: a worker
        starts on its local copy, pushes it to the registry and switches to that
        version (a fresh engine, an empty cache), which must not happen mid-run."""
        end = time.monotonic() + timeout
        while not (len(self.last) >= workers and all(
                hb.state == "ready" and len(hb.versions) == 1 and hb.versions[0] != "local"
                for hb in self.last.values())):
            if time.monotonic() > end:
                raise TimeoutError("workers did not settle on the registry's version")
            await asyncio.sleep(0.05)

    async def after(self, t: float, workers: int, timeout: float = 30.0) -> dict:
        """Counters from heartbeats sent after wall-clock `t` (the run's end)."""
        end = time.monotonic() + timeout
        while not (len(self.last) >= workers
                   and all(hb.sent_at > t for hb in self.last.values())):
            if time.monotonic() > end:
                raise TimeoutError("no heartbeat after the run")
            await asyncio.sleep(0.05)
        return {w: (hb.prefix_cache_queries, hb.prefix_cache_hits, hb.preemptions)
                for w, hb in self.last.items()}


async def workload(nc, systems: list[str], questions: list[list[str]], args) -> dict:
    order = list(range(len(questions)))  # conversation i uses system i % systems
    ttft: list[float] = []
    tokens = 0
    t0 = time.perf_counter()

    async def client() -> None:
        nonlocal tokens
        while order:
            i = order.pop(0)
            conversation = systems[i % len(systems)]
            for q in questions[i]:
                conversation += q
                first, text, _ = await stream(nc, conversation, args.new)
                ttft.append(first)
                tokens += args.new  # ignore_eos: every answer is `new` tokens (chunks
                # may carry several when the reader falls behind, so they are not counted)
                conversation += text + "\n"

    await asyncio.gather(*(client() for _ in range(args.clients)))
    wall = time.perf_counter() - t0

    def ms(q: float) -> float:
        return harness.pct_ms(ttft, q, digits=1)

    return {"requests": len(ttft), "ttft_p50_ms": ms(50), "ttft_p99_ms": ms(99),
            "tokens_per_s": round(tokens / wall, 1),
            "requests_per_s": round(len(ttft) / wall, 2), "wall_s": round(wall, 1)}


async def one_mode(name: str, imbalance: int, workdir: Path, args, systems, questions) -> dict:
    import nats

    from services.supervisor import Supervisor, wait_ready

    env = harness.service_env(log_level=os.environ.get("TENSORBUS_LOG_LEVEL", "warning"),
                              TENSORBUS_DATA_DIR=str(workdir / "data"),
                              TENSORBUS_PREFIX_ROUTE_IMBALANCE=str(imbalance),
                              TENSORBUS_REQUEST_TIMEOUT_S="120")
    worker = dict(TENSORBUS_MODEL=MODEL, TENSORBUS_MAX_CONTEXT="512",
                  TENSORBUS_DECODE_SLOTS="8", TENSORBUS_KV_BLOCKS=str(args.kv_blocks + 1))
    with Supervisor(workdir / name) as sup:
        harness.start_stack(sup, telemetry=False, **env, workers={
            f"worker-{w}": {"TENSORBUS_WORKER_ID": f"{name}-{w}", **worker} for w in ("a", "b")})
        nc = await nats.connect(sup.nats_url)
        try:
            counters = Counters()
            await counters.start(nc)
            await wait_ready(nc, MODEL, 2, timeout=600)
            await counters.settled(2)
            before = await counters.after(time.time(), 2)
            load = os.getloadavg()[0]
            out = await workload(nc, systems, questions, args)
            after = await counters.after(time.time(), 2)
        finally:
            await nc.close()
    q = sum(after[w][0] - before[w][0] for w in after)
    h = sum(after[w][1] - before[w][1] for w in after)
    per = {w: round((after[w][1] - before[w][1]) / max(1, after[w][0] - before[w][0]), 3)
           for w in sorted(after)}
    return {"hit_rate": round(h / q, 3) if q else 0.0, "hit_rate_per_worker": per,
            "preemptions": sum(after[w][2] - before[w][2] for w in after),
            **out, "loadavg_1m_at_start": round(load, 2)}


async def run(args) -> dict:
    systems, questions = texts(args)
    from engine.tokenizer import Tokenizer

    tok = Tokenizer.from_dir(catalog.bundled_dir(MODEL))
    res = {"model": MODEL, "system_tokens": [len(tok.encode(s)) for s in systems],
           "requests_per_mode": len(questions) * args.turns, "kv_blocks_per_worker":
           args.kv_blocks, "clients": args.clients}
    with tempfile.TemporaryDirectory(prefix="tensorbus-prefix-routing-") as tmp:
        work = Path(args.keep) if args.keep else Path(tmp)
        for name, imbalance in (("prefix", args.imbalance), ("least-loaded", -1)):
            if name in args.modes:
                res[name] = await one_mode(name, imbalance, work, args, systems, questions)
                print(name, json.dumps(res[name]), flush=True)
    if not all(m in res for m in ("prefix", "least-loaded")):
        return res
    p, ll = res["prefix"], res["least-loaded"]
    res["ttft_p50_ratio"] = round(ll["ttft_p50_ms"] / p["ttft_p50_ms"], 2)
    return res


def main() -> None:
    ap = harness.parser(__doc__)
    ap.add_argument("--systems", type=int, default=6)
    ap.add_argument("--system", type=int, default=320, help="tokens per system prompt")
    ap.add_argument("--conversations", type=int, default=6, help="per system prompt")
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--new", type=int, default=16, help="tokens per answer")
    ap.add_argument("--clients", type=int, default=4)
    ap.add_argument("--kv-blocks", type=int, default=96, help="usable KV blocks per worker")
    ap.add_argument("--imbalance", type=int, default=4)
    ap.add_argument("--modes", default="prefix,least-loaded")
    ap.add_argument("--keep", default="", help="keep the services' logs in this folder")
    args = ap.parse_args()
    res = asyncio.run(run(args))
    print(json.dumps(res, indent=2))
    harness.write_json("prefix_routing.json", {**harness.run_info(
        "python -m bench.prefix_routing " + " ".join(sys.argv[1:])), **res})


if __name__ == "__main__":
    main()
