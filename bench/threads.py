"""Engine threads per local worker, split against shared, on up.sh's stack, one run.

The whole stack as `scripts/up.sh` runs it (honcho over the Procfile: nats-server,
gateway, scheduler, the orchestrator with its default fleet, telemetry; the encoder
and SmolLM2, the demo LM not asked for) is started once per setting of
`TENSORBUS_WORKER_THREADS` (`split`: the two workers one core each on two cores;
`shared`: both workers every core), the settings alternating on one data directory,
so one compilation cache serves every start after the first. Each start waits until
both models are ready and SmolLM2's background compiles are done, sends one chat and
one embeddings request, then measures over HTTP, the same client for both settings:

  (a) chat busy, encoder idle: `--streams` closed-loop chat streams (greedy,
      `ignore_eos`, `--max-tokens`) for `--seconds` each: tokens/s, TTFT and ITL p50;
  (b) both busy: `--both-streams` chat streams and `--embed-clients` closed-loop
      embeddings clients (one short text a request) together for `--seconds`: both
      throughputs, chat TTFT/ITL, embeddings p50/p99;
  (c) a burst on each, the other idle: `--burst-embeddings` embeddings requests sent
      at once (time to serve them all, p50/p99, refusals), then `--burst-streams`
      chat streams at once (time to finish them all, tokens/s, TTFT and ITL).

The figure is the ratio shared/split measured side by side: the machine may be
loaded by other work (every phase records the 1-minute load average).

    .venv/bin/python -m bench.threads --seconds 20 --rounds 1
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
import time
from pathlib import Path

from bench.harness import OUT, REPO, csv_ints, csv_strs, figure_row, parser, run_info, write_json
from bench.vs_llamacpp import MODEL as CHAT
from bench.vs_llamacpp import one_stream, start_stack, stop
from shared.catalog import ENCODER
from bench.support.stats import pct_ms
from bench.support.workload import short_inputs

FLEET = "tensorbus-demo-lm=0:0"  # up.sh starts the demo LM on demand; nothing asks for it here


def _load() -> float:
    return round(os.getloadavg()[0], 2)


# ------------------------------------------------------------------ clients
async def chat_loop(client, url: str, streams: int, seconds: float, max_tokens: int) -> dict:
    """`streams` closed-loop chat streams until `seconds` have passed."""
    results: list[dict] = []
    deadline = time.perf_counter() + seconds

    async def loop() -> None:
        while time.perf_counter() < deadline:
            res = await chat_one(client, url, max_tokens)
            results.append(res)

    t0 = time.perf_counter()
    await asyncio.gather(*(loop() for _ in range(streams)))
    return chat_figures(results, time.perf_counter() - t0, streams)


async def chat_one(client, url: str, max_tokens: int) -> dict:
    """One chat stream's figures (vs_llamacpp.one_stream), or {"status": code} when it
    was refused (admission by work answers 429 when the machine cannot fit it)."""
    import httpx

    for attempt in (1, 2):
        try:
            return await one_stream(client, url, CHAT, max_tokens)
        except httpx.HTTPStatusError as exc:
            return {"status": exc.response.status_code}
        except httpx.TransportError:  # a kept-alive connection the server had just closed
            if attempt == 2:
                return {"status": -1}
    raise AssertionError("unreachable")


def chat_figures(done: list[dict], wall: float, streams: int) -> dict:
    results = [r for r in done if "status" not in r]
    codes = sorted({r["status"] for r in done if "status" in r})
    gaps = [g for r in results for g in r["gaps"]]
    ttfts = [r["ttft"] for r in results]
    tokens = sum(r["tokens"] for r in results)
    return {"streams": streams, "requests": len(results), "refused": len(done) - len(results),
            "refused_codes": codes, "tokens": tokens,
            "wall_s": round(wall, 2), "tokens_per_s": round(tokens / wall, 2),
            "ttft_p50_ms": pct_ms(ttfts, 50, 1), "ttft_p99_ms": pct_ms(ttfts, 99, 1),
            "itl_p50_ms": pct_ms(gaps, 50, 1), "itl_p99_ms": pct_ms(gaps, 99, 1)}


async def embed_one(client, url: str, text: str) -> tuple[float, int]:
    """Seconds and status of one embeddings request (-1: no answer, sent twice)."""
    import httpx

    t0 = time.perf_counter()
    for attempt in (1, 2):
        try:
            r = await client.post(url + "/v1/embeddings", json={"model": ENCODER, "input": [text]})
            return time.perf_counter() - t0, r.status_code
        except httpx.TransportError:  # a kept-alive connection the server had just closed
            if attempt == 2:
                return time.perf_counter() - t0, -1
    raise AssertionError("unreachable")


def embed_figures(done: list[tuple[float, int]], wall: float) -> dict:
    ok = [s for s, code in done if code == 200]
    codes = sorted({code for _, code in done if code != 200})
    return {"requests": len(ok), "refused": len(done) - len(ok), "refused_codes": codes,
            "wall_s": round(wall, 3),
            "rps": round(len(ok) / wall, 2), "p50_ms": pct_ms(ok, 50, 1),
            "p99_ms": pct_ms(ok, 99, 1)}


async def embed_loop(client, url: str, clients: int, seconds: float) -> dict:
    """`clients` closed-loop embeddings clients, one short text a request."""
    texts = short_inputs(512)
    done: list[tuple[float, int]] = []
    deadline = time.perf_counter() + seconds

    async def loop(i: int) -> None:
        n = i
        while time.perf_counter() < deadline:
            res = await embed_one(client, url, texts[n % len(texts)])
            done.append(res)
            n += clients

    t0 = time.perf_counter()
    await asyncio.gather(*(loop(i) for i in range(clients)))
    return embed_figures(done, time.perf_counter() - t0)


async def embed_burst(client, url: str, n: int) -> dict:
    texts = short_inputs(n)
    t0 = time.perf_counter()
    done = await asyncio.gather(*(embed_one(client, url, t) for t in texts))
    return embed_figures(list(done), time.perf_counter() - t0)


async def chat_burst(client, url: str, streams: int, max_tokens: int) -> dict:
    t0 = time.perf_counter()
    results = await asyncio.gather(*(chat_one(client, url, max_tokens) for _ in range(streams)))
    return chat_figures(list(results), time.perf_counter() - t0, streams)


# ------------------------------------------------------------------ one stack
async def settled(url: str, limit: float) -> float:
    """Wait until both models have a ready worker and SmolLM2's background compiles
    are done (they share the cores with what is measured); seconds waited."""
    import httpx

    t0 = time.perf_counter()
    async with httpx.AsyncClient(timeout=10) as client:
        while True:
            try:
                cards = {c["id"]: c for c in (await client.get(url + "/v1/models")).json()["data"]}
                enc, chat = cards.get(ENCODER, {}), cards.get(CHAT, {})
                if (enc.get("ready_workers", 0) >= 1 and chat.get("ready_workers", 0) >= 1
                        and chat.get("programs_total")
                        and chat["programs_compiled"] >= chat["programs_total"]):
                    return round(time.perf_counter() - t0, 1)
            except (httpx.TransportError, ValueError, KeyError):
                pass  # the gateway is starting
            if time.perf_counter() - t0 > limit:
                raise TimeoutError(f"models not settled after {limit:g} s")
            await asyncio.sleep(1.0)  # polling the cards: the compiles report no event here


def worker_starts(log: Path) -> list[dict]:
    """Every worker the orchestrator started (the scheduler scales the encoder up
    after a burst), its threads and UTC time, from its `worker_started` lines."""
    out = []
    for line in log.read_text(errors="replace").splitlines():
        if "worker_started" in line and "{" in line:
            try:
                ev = json.loads(line[line.index("{"):])
            except ValueError:
                continue
            out.append({"worker": ev.get("worker"), "threads": ev.get("threads"),
                        "utc": str(ev.get("timestamp", ""))[11:19]})
    return out


def _client(args):
    """A fresh HTTP client for each phase: no connection idles into the next one."""
    import httpx

    limits = httpx.Limits(max_connections=1024, max_keepalive_connections=1024)
    return httpx.AsyncClient(timeout=args.request_timeout, limits=limits)


async def phase(res: dict, name: str, args, run) -> None:
    """One phase with its own client; its UTC start and end (the orchestrator's log
    says which workers started meanwhile) and the load average at its end."""
    start = time.strftime("%H:%M:%S", time.gmtime())
    async with _client(args) as client:
        out = await run(client)
    res[name] = {**out, "utc": [start, time.strftime("%H:%M:%S", time.gmtime())],
                 "load": _load()}
    print(json.dumps({name: res[name]}), flush=True)


async def measure(url: str, args) -> dict:
    res: dict = {}
    async with _client(args) as client:
        await one_stream(client, url, CHAT, 8)  # warm: first paths
        await embed_one(client, url, "warm")
    for s in args.streams:
        await phase(res, f"chat_{s}", args,
                    lambda c, s=s: chat_loop(c, url, s, args.seconds, args.max_tokens))

    async def both(c) -> dict:
        chat, emb = await asyncio.gather(
            chat_loop(c, url, args.both_streams, args.seconds, args.max_tokens),
            embed_loop(c, url, args.embed_clients, args.seconds))
        return {"chat": chat, "embeddings": emb}

    await phase(res, "both", args, both)
    await phase(res, "burst_embeddings", args, lambda c: embed_burst(c, url, args.burst_embeddings))
    await phase(res, "burst_chat", args,
                lambda c: chat_burst(c, url, args.burst_streams, args.max_tokens))
    return res


async def one_setting(setting: str, data: Path, log: Path, args) -> dict:
    extra = {"TENSORBUS_WORKER_THREADS": setting}
    proc, url, t0 = start_stack(data, FLEET, log, extra)
    try:
        settle_s = await settled(url, args.ready_timeout)
        out = {"setting": setting, "ready_and_settled_s": round(time.perf_counter() - t0, 1),
               "settle_wait_s": settle_s, "load_before": _load()}
        out.update(await measure(url, args))
    finally:
        stop(proc)
    out["workers_started"] = worker_starts(log)
    return out


# ------------------------------------------------------------------ output
def rows_for(streams: list[int]) -> list[tuple]:
    """(label, phase path, key, higher is better) of every figure of the table."""
    out = []
    for s in streams:
        name = f"chat {s} stream{'s' if s > 1 else ''}"
        out += [(f"{name}: tokens/s", (f"chat_{s}",), "tokens_per_s", True),
                (f"{name}: TTFT p50 ms", (f"chat_{s}",), "ttft_p50_ms", False),
                (f"{name}: ITL p50 ms", (f"chat_{s}",), "itl_p50_ms", False)]
    return out + ROWS


ROWS = [
    ("both busy, chat: tokens/s", ("both", "chat"), "tokens_per_s", True),
    ("both busy, chat: ITL p50 ms", ("both", "chat"), "itl_p50_ms", False),
    ("both busy, chat: ITL p99 ms", ("both", "chat"), "itl_p99_ms", False),
    ("both busy, embeddings: requests/s", ("both", "embeddings"), "rps", True),
    ("both busy, embeddings: p50 ms", ("both", "embeddings"), "p50_ms", False),
    ("both busy, embeddings: p99 ms", ("both", "embeddings"), "p99_ms", False),
    ("embeddings burst: time to serve all, s", ("burst_embeddings",), "wall_s", False),
    ("embeddings burst: p99 ms", ("burst_embeddings",), "p99_ms", False),
    ("embeddings burst: refused", ("burst_embeddings",), "refused", False),
    ("chat burst: time to finish all, s", ("burst_chat",), "wall_s", False),
    ("chat burst: refused", ("burst_chat",), "refused", False),
    ("chat burst: tokens/s", ("burst_chat",), "tokens_per_s", True),
    ("chat burst: TTFT p50 ms", ("burst_chat",), "ttft_p50_ms", False),
    ("chat burst: ITL p50 ms", ("burst_chat",), "itl_p50_ms", False),
]


def _get(run: dict, path: tuple[str, ...], key: str):
    for p in path:
        run = run.get(p, {})
    return run.get(key)


def summary(runs: list[dict], streams: list[int]) -> list[dict]:
    """Per row: the median over rounds of each setting, and shared/split."""
    import statistics

    rows = []
    for label, path, key, higher in rows_for(streams):
        vals = {}
        for setting in ("split", "shared"):
            xs = [_get(r, path, key) for r in runs if r["setting"] == setting]
            xs = [x for x in xs if isinstance(x, (int, float)) and x == x]
            vals[setting] = statistics.median(xs) if xs else None
        a, b = vals["split"], vals["shared"]
        ratio = round(b / a, 3) if a and b is not None else None
        rows.append({"figure": label, "split": a, "shared": b, "shared_over_split": ratio,
                     "higher_is_better": higher})
    return rows


def table(rows: list[dict]) -> str:
    lines = ["| figure | split | shared | shared/split |", "|---|---|---|---|"]
    for r in rows:
        ratio = "" if r["shared_over_split"] is None else f"{r['shared_over_split']:.2f}"
        lines.append(f"| {r['figure']} | {r['split']} | {r['shared']} | {ratio} |")
    return "\n".join(lines)


def plot(rows: list[dict], path: Path) -> bool:
    try:
        import matplotlib
    except ImportError:
        return False
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in rows if r["shared_over_split"] and r["figure"].split(": ")[-1] != "refused"]
    # Shown as "shared is better by": >1 wherever shared wins, for rates and times alike.
    gain = [r["shared_over_split"] if r["higher_is_better"] else 1 / r["shared_over_split"]
            for r in rows]
    fig, ax = plt.subplots(figsize=(8, 0.32 * len(rows) + 1.2))
    ys = range(len(rows))
    ax.barh(ys, gain, color=["tab:green" if g >= 1 else "tab:red" for g in gain])
    ax.axvline(1.0, color="k", lw=0.8)
    ax.set_yticks(list(ys), [r["figure"] for r in rows], fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel("shared better by (x; rates shared/split, times split/shared)")
    ax.set_title("TENSORBUS_WORKER_THREADS: shared against split, up.sh's stack")
    ax.grid(axis="x", alpha=0.3)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    return True


def figure_rows(rows: list[dict], command: str, date: str) -> str:
    return "\n".join(figure_row(r["figure"] + " (split / shared; shared/split)",
                                f"{r['split']} / {r['shared']}; {r['shared_over_split']}",
                                command, date) for r in rows)


async def main_async(args) -> dict:
    args.data_dir.mkdir(parents=True, exist_ok=True)
    doc = {**run_info("python -m bench.threads " + " ".join(sys.argv[1:])),
           "fleet": FLEET, "max_tokens": args.max_tokens, "seconds": args.seconds,
           "runs": []}
    for r in range(args.rounds):
        order = args.order if r % 2 == 0 else list(reversed(args.order))
        for setting in order:
            log = OUT / f"threads_{setting}_{r}.log"
            log.parent.mkdir(parents=True, exist_ok=True)
            log.write_bytes(b"")
            run = await one_setting(setting, args.data_dir, log, args)
            run["round"] = r
            doc["runs"].append(run)
            keys = ("setting", "round", "workers_started", "ready_and_settled_s")
            print(json.dumps({k: v for k, v in run.items() if k in keys}), flush=True)
    doc["load_average_1m_end"] = _load()
    doc["summary"] = summary(doc["runs"], args.streams)
    return doc


def main(argv=None) -> dict:
    ap = parser(__doc__)
    ap.add_argument("--seconds", type=float, default=20.0, help="seconds of each timed phase")
    ap.add_argument("--streams", type=csv_ints, default=[1, 8], help="chat streams, phase (a)")
    ap.add_argument("--both-streams", type=int, default=8, help="chat streams in phase (b)")
    ap.add_argument("--embed-clients", type=int, default=4, help="embeddings clients, phase (b)")
    ap.add_argument("--burst-embeddings", type=int, default=200)
    ap.add_argument("--burst-streams", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=1, help="starts of each setting; the order "
                    "reverses every other round")
    ap.add_argument("--order", type=csv_strs, default=["split", "shared"])
    ap.add_argument("--data-dir", type=Path, default=REPO / ".data" / "bench-threads",
                    help="the stacks' data dir: its compilation cache is kept between runs")
    ap.add_argument("--ready-timeout", type=float, default=900.0,
                    help="seconds a start may take to ready and settle (a cold cache compiles)")
    ap.add_argument("--request-timeout", type=float, default=300.0)
    ap.add_argument("--out", default="threads.json")
    ap.add_argument("--plot", type=Path, default=OUT / "threads.png")
    args = ap.parse_args(argv)
    doc = asyncio.run(main_async(args))
    path = write_json(args.out, doc)
    print(table(doc["summary"]))
    if plot(doc["summary"], args.plot):
        print("plot:", args.plot)
    print(figure_rows(doc["summary"], doc["command"], doc["date"]))
    print("result:", path)
    return doc


if __name__ == "__main__":
    main()
