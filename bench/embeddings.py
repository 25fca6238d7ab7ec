"""Embeddings benchmark: the raw engine in-process, then the full stack over NATS and HTTP.

    .venv/bin/python -m bench.embeddings [--seconds 10] [--skip-torch] [--http]
        [--kinds short,long] [--concurrency 1,16,64] [--data-dir DIR]
        [--loop auto|asyncio|uvloop]

One run measures, on this machine:
  1. engine: JAX sentences/s at batch 64 (short ~16 and long ~128 tokens), batch-1
     latency, and (bench.engine_encoder) torch eager side by side, GFLOP/s, matmul share;
     measured again after the stack (a shared machine's speed moves within minutes);
  2. stack: nats-server, gateway, scheduler, one worker and telemetry as separate
     processes; closed-loop clients over NATS at each concurrency for each input kind.
     At concurrency 1 the gateway's request records (`telemetry.v1.requests`) split
     the latency: the worker's batch wait, queue and compute, the gateway's total, and
     the client's; at the highest concurrency, CPU milliseconds per request of every
     process (bench.capacity's /proc reading), the client's included;
  3. `--http`: `wrk` (Debian package) posts short inputs to `/v1/embeddings` with as
     many connections as the highest concurrency, same CPU accounting (the client is wrk);
  4. `--loop` sets TENSORBUS_EVENT_LOOP for every service process (the client and the
     raw engine stay on asyncio);
  5. writes bench/out/embeddings.json, docs/img/embeddings.png (all kinds) and prints
     a markdown table for docs/benchmarks.md.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np

from bench import harness
from bench.harness import REPO
from services.lifecycle import EVENT_LOOPS
from shared import catalog
from bench.support.workload import embed_body, long_inputs, short_inputs

MODEL = catalog.ENCODER
BATCH_BUCKETS = "1,2,4,8,16,32,64"
SEQ_BUCKETS = "16,32,64,128"


async def closed_loop(nc, subject: str, bodies: list[bytes], concurrency: int,
                      seconds: float, warmup_s: float = 1.0, timeout: float = 30.0) -> dict:
    """`concurrency` clients, each sending its next request when the last returns."""
    lat: list[float] = []
    errors = 0
    t_start = time.perf_counter()
    t_measure = t_start + warmup_s
    t_end = t_measure + seconds
    counted = answered = 0

    async def client(i: int) -> None:
        nonlocal errors, counted, answered
        k = i
        while True:
            t0 = time.perf_counter()
            if t0 >= t_end:
                return
            msg = await nc.request(subject, bodies[k % len(bodies)], timeout=timeout)
            t1 = time.perf_counter()
            answered += 1
            k += concurrency
            if t0 >= t_measure and t1 <= t_end:
                counted += 1
                lat.append(t1 - t0)
                if (msg.headers or {}).get("Nats-Service-Error-Code"):
                    errors += 1

    await asyncio.gather(*(client(i) for i in range(concurrency)))
    # answered / wall_s: every request of the call, warm-up included (CPU per request)
    return {"concurrency": concurrency, "requests": counted, "errors": errors,
            "rps": counted / seconds, "answered": answered,
            "wall_s": time.perf_counter() - t_start, **harness.percentiles(lat)}


def sentences_per_s(enc, rows: list, seconds: float) -> float:
    """Back-to-back `enc.embed(rows)` for `seconds`, after one untimed call."""
    enc.embed(rows)
    n, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        enc.embed(rows)
        n += len(rows)
    return n / (time.perf_counter() - t0)


def engine_figures(seconds: float, data_dir: Path, kinds: tuple[str, ...] = ("short", "long"),
                   path: Path | None = None, dtype: str = "float32",
                   batch_buckets: str = BATCH_BUCKETS) -> dict:
    """The raw engine in-process with the stack's buckets and batch limit: the bundled
    model, or the one at `path`, in `dtype` (fewer `batch_buckets`: a smoke run)."""
    from engine import jaxrt
    from engine.encoder import EncoderEngine
    from engine.tokenizer import Tokenizer

    jaxrt.setup(str(data_dir / "jax-cache"))
    path = path or catalog.bundled_dir(MODEL)
    tok = Tokenizer.from_dir(path)
    enc = EncoderEngine(path, name=MODEL, dtype=dtype,
                        batch_buckets=tuple(harness.csv_ints(batch_buckets)),
                        seq_buckets=tuple(harness.csv_ints(SEQ_BUCKETS)), max_batch=64)
    enc.warmup(progress=True)
    out = {}
    for kind in kinds:
        ids = tok.encode_batch(short_inputs() if kind == "short" else long_inputs())
        batch = ids[:64]
        out[f"{kind}_batch64_sps"] = sentences_per_s(enc, batch, seconds)
        lat = []
        for i in range(200):
            t = time.perf_counter()
            enc.embed([ids[i % len(ids)]])
            lat.append(time.perf_counter() - t)
        out[f"{kind}_batch1_p50_ms"] = harness.pct_ms(lat, 50, digits=None)
        out[f"{kind}_tokens"] = float(np.mean([len(x) for x in batch]))
    return out


async def stack_figures(seconds: float, workdir: Path, data_dir: Path, kinds: list[str],
                        concurrency: list[int], http: bool, loop: str = "auto",
                        extra_env: dict[str, str] | None = None, gateways: int = 1,
                        batch_buckets: str = BATCH_BUCKETS, settle_s: float = 10.0) -> dict:
    """The stack as processes under closed-loop clients (engine_figures' buckets; the
    first `settle_s` seconds after ready are load, not measured)."""
    from bench.capacity import wrk_phase
    from bench.harness import cpu_all, per_request
    from services.supervisor import Supervisor, wait_ready
    from shared import subjects
    from shared.bus import connect
    from shared.natsd import free_port
    from shared.telemetry import RequestRecord, record_decoder

    results: dict = {}
    port = free_port()
    records: list[RequestRecord] = []
    with Supervisor(workdir) as sup:
        env = harness.service_env(
            http_port=port, TENSORBUS_BATCH_BUCKETS=batch_buckets,
            TENSORBUS_SEQ_BUCKETS=SEQ_BUCKETS, TENSORBUS_MAX_BATCH="64",
            TENSORBUS_DATA_DIR=str(data_dir), TENSORBUS_EVENT_LOOP=loop, **(extra_env or {}))
        # more gateways: same queue group, same HTTP port
        harness.start_stack(sup, gateways=gateways, workers={"worker": {}}, **env)
        nc = await connect(sup.nats_url, "bench-client")

        async def on_record(msg) -> None:
            rec = record_decoder.decode(msg.data)
            if isinstance(rec, RequestRecord):
                records.append(rec)

        try:
            await wait_ready(nc, MODEL, 1, timeout=600)
            # The first seconds after `ready` run slower (first touches of every
            # executable and buffer); settle before measuring.
            warm = [embed_body(MODEL, t) for t in short_inputs()]
            await closed_loop(nc, subjects.EMBEDDINGS, warm, 16, settle_s)
            for kind in kinds:
                texts = short_inputs() if kind == "short" else long_inputs()
                bodies = [embed_body(MODEL, t) for t in texts]
                results[kind] = []
                # A long batch of 64 takes seconds: measure long inputs for longer.
                window = seconds if kind == "short" else seconds * 3
                for c in concurrency:
                    records.clear()
                    sub = None  # records are kept at concurrency 1 only (the client's CPU)
                    if c == 1:
                        sub = await nc.subscribe(subjects.TELEMETRY_REQUESTS, cb=on_record)
                    await nc.flush()
                    before = cpu_all(sup)
                    r = await closed_loop(nc, subjects.EMBEDDINGS, bodies, c, window,
                                          warmup_s=window / 5)
                    after = cpu_all(sup)
                    r["cpu_ms_per_request"] = per_request(before, after, r["answered"])
                    if sub is not None:
                        await nc.flush()
                        await sub.unsubscribe()
                        r["split_ms"] = split(records)
                        r["hops_ms"] = await hops(sup.nats_url, nc, bodies)
                    print(f"stack {kind} c={c}: {r['rps']:.1f} req/s p50 {r['p50_ms']:.2f} ms "
                          f"p99 {r['p99_ms']:.2f} ms errors {r['errors']} "
                          f"cpu ms/request {r['cpu_ms_per_request']} {r.get('split_ms', '')} "
                          f"{r.get('hops_ms', '')}",
                          flush=True)
                    results[kind].append(r)
            if http:
                results["http"] = await asyncio.to_thread(wrk_phase, sup, port, max(concurrency),
                                                          seconds, workdir)
                results["http"]["clients"] = max(concurrency)
                print("http:", json.dumps(results["http"]), flush=True)
        finally:
            await nc.close()
    return results


async def hops(url: str, nc, bodies: list[bytes], n: int = 200) -> dict:
    """Medians (ms) of each leg of a lone request, timed by a second connection that
    also receives every internal message (submit, work, the worker's result): client
    -> gateway -> submit seen; submit -> work (scheduler); work -> result (the worker,
    less its compute and queue, which its record gives); result -> reply at the client.
    Each timestamp includes this process's own wake-up, the same for every leg."""
    from shared import subjects
    from shared.bus import connect
    from shared.telemetry import RequestRecord, record_decoder

    spy = await connect(url, "bench-spy")
    seen: dict[str, float] = {}
    rec: list[RequestRecord] = []
    got = asyncio.Event()
    client_prefix = bytes(nc._resp_sub_prefix or b"").decode()

    def mark(kind: str):
        async def cb(msg) -> None:
            if kind == "result" and client_prefix and msg.subject.startswith(client_prefix):
                return
            seen.setdefault(kind, time.perf_counter())
        return cb

    async def on_record(msg) -> None:
        r = record_decoder.decode(msg.data)
        if isinstance(r, RequestRecord):
            rec.append(r)
            got.set()

    await spy.subscribe(subjects.SCHED_SUBMIT, cb=mark("submit"))
    await spy.subscribe(subjects.worker_work("*"), cb=mark("work"))
    await spy.subscribe("_INBOX.>", cb=mark("result"))  # the gateway's reply inbox
    await spy.subscribe(subjects.TELEMETRY_REQUESTS, cb=on_record)
    await spy.flush()
    rows = []
    try:
        for i in range(n):
            seen.clear()
            rec.clear()
            got.clear()
            t0 = time.perf_counter()
            await nc.request(subjects.EMBEDDINGS, bodies[i % len(bodies)], timeout=30)
            t1 = time.perf_counter()
            await asyncio.wait_for(got.wait(), 5)  # this request's record
            if len(seen) == 3 and rec[0].status == 200:
                r = rec[0]
                rows.append({"client_to_submit": seen["submit"] - t0,
                             "scheduler": seen["work"] - seen["submit"],
                             "worker_less_compute": seen["result"] - seen["work"] - r.compute_s
                             - r.queue_s - r.batch_wait_s,
                             "worker_queue_and_wait": r.queue_s + r.batch_wait_s,
                             "compute": r.compute_s, "result_to_client": t1 - seen["result"],
                             "total": t1 - t0})
    finally:
        await spy.close()
    if not rows:
        return {}
    return {"requests": len(rows), **{k: round(statistics.median(x[k] for x in rows) * 1000, 3)
                                      for k in rows[0]}}


def split(records: list) -> dict:
    """Medians (ms) of the gateway's request records: where a lone request's time goes."""
    ok = [r for r in records if r.status == 200]
    if not ok:
        return {}

    def med(f) -> float:
        return round(statistics.median(f(r) for r in ok) * 1000, 3)

    return {"records": len(ok), "gateway_total": med(lambda r: r.total_s),
            "compute": med(lambda r: r.compute_s), "queue": med(lambda r: r.queue_s),
            "batch_wait": med(lambda r: r.batch_wait_s),
            "outside_worker": med(lambda r: r.total_s - r.compute_s - r.queue_s - r.batch_wait_s)}


def plot(res: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for kind, color in (("short", "tab:blue"), ("long", "tab:orange")):
        rows = res["stack"].get(kind)
        if not rows:
            continue
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
    lines = ["| path | input | concurrency | stack sentences/s | share of raw engine (batch 64: "
             "before / after the stack) "
             "| p50 ms | p99 ms |", "|---|---|---|---|---|---|---|"]
    ea = res.get("engine_after", {})

    def share(rps: float, kind: str) -> str:
        key = f"{kind}_batch64_sps"
        after = f" / {rps / ea[key]:.0%}" if key in ea else ""
        return f"{rps / e[key]:.0%}{after}"

    for kind in ("short", "long"):
        for r in res["stack"].get(kind, []):
            lines.append(f"| NATS | {kind} | {r['concurrency']} | {r['rps']:.1f} | "
                         f"{share(r['rps'], kind)} | {r['p50_ms']:.2f} | {r['p99_ms']:.2f} |")
    h = res["stack"].get("http")
    if h and "rps" in h:
        lines.append(f"| HTTP (wrk) | short | {h['clients']} | {h['rps']:.1f} | "
                     f"{share(h['rps'], 'short')} | {h['p50']} | {h['p99']} |")
    lines.append("")
    lines.append(f"raw engine: short batch 64 {e['short_batch64_sps']:.1f}/s, long batch 64 "
                 f"{e['long_batch64_sps']:.1f}/s; batch-1 p50 short {e['short_batch1_p50_ms']:.2f} ms, "
                 f"long {e['long_batch1_p50_ms']:.2f} ms")
    if ea:
        lines.append(f"raw engine after the stack: {json.dumps(ea)}")
    for kind in ("short", "long"):
        for r in res["stack"].get(kind, []):
            if r["concurrency"] == 1:
                b1 = [x[f"{kind}_batch1_p50_ms"] for x in (e, ea) if f"{kind}_batch1_p50_ms" in x]
                lines.append(f"c=1 {kind}: p50 {r['p50_ms']:.2f} ms; engine batch-1 p50 "
                             + " / ".join(f"{b:.2f} ms ({r['p50_ms'] - b:+.2f})" for b in b1)
                             + " (before / after the stack); records "
                             f"{json.dumps(r.get('split_ms', {}))}; legs {json.dumps(r.get('hops_ms', {}))}")
            lines.append(f"CPU ms/request NATS {kind} c={r['concurrency']}: "
                         f"{json.dumps(r['cpu_ms_per_request'])}")
    if h and "rps" in h:
        lines.append(f"CPU ms/request HTTP: {json.dumps(h['cpu_ms_per_request'])} "
                     f"(client = wrk), non-2xx {h['non_2xx']}, socket errors '{h['socket_errors']}'")
    if "torch" in res:
        lines.append(f"engine vs torch: {json.dumps(res['torch'])}")
    return "\n".join(lines)


def figure_rows(res: dict) -> str:
    """The rows of docs/benchmarks.md's embeddings table that this run fills."""
    e, ea, cmd, date = res["engine"], res.get("engine_after", {}), res["command"], res["date"]
    rows = [harness.FIGURE_HEADER]
    for kind in ("short", "long"):
        key = f"{kind}_batch64_sps"
        if key not in e:
            continue
        after = f" / {ea[key]:.1f}" if key in ea else ""
        rows.append(harness.figure_row(f"raw engine, {kind}, batch 64 (before / after the stack)",
                                       f"{e[key]:.1f}{after} sentences/s", cmd, date))
        for r in res["stack"].get(kind, []):
            share = f"{r['rps'] / e[key]:.0%}"
            if key in ea:
                share += f" / {r['rps'] / ea[key]:.0%}"
            rows.append(harness.figure_row(
                f"served, {kind}, concurrency {r['concurrency']}, NATS: share of the raw engine",
                f"{r['rps']:.1f} sentences/s, {share}; p50 / p99 {r['p50_ms']:.2f} / "
                f"{r['p99_ms']:.2f} ms", cmd, date))
    return "\n".join(rows)


def main() -> None:
    ap = harness.parser(__doc__)
    ap.add_argument("--seconds", type=float, default=10.0)
    ap.add_argument("--skip-torch", action="store_true")
    ap.add_argument("--http", action="store_true", help="also load /v1/embeddings with wrk")
    ap.add_argument("--kinds", default="short,long")
    ap.add_argument("--concurrency", default="1,16,64")
    ap.add_argument("--data-dir", type=Path, default=REPO / ".data",
                    help="the worker's data dir (its jax-cache is shared with the engine run)")
    ap.add_argument("--loop", default="auto", choices=EVENT_LOOPS,
                    help="TENSORBUS_EVENT_LOOP of every service process")
    args = ap.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    kinds = harness.csv_strs(args.kinds)
    concurrency = harness.csv_ints(args.concurrency)
    harness.seed_jax_cache(args.data_dir)
    args.data_dir.mkdir(parents=True, exist_ok=True)
    res: dict = {**harness.run_info("python -m bench.embeddings " + " ".join(sys.argv[1:])),
                 "seconds": args.seconds, "event_loop": args.loop}
    res["engine"] = engine_figures(args.seconds, args.data_dir)
    print("engine:", json.dumps(res["engine"]), flush=True)
    if not args.skip_torch:
        try:
            from bench.engine_encoder import run as torch_run

            res["torch"] = torch_run(batch=64, kind="short")
        except ImportError:
            pass
    with tempfile.TemporaryDirectory() as d:
        res["stack"] = asyncio.run(stack_figures(args.seconds, Path(d), args.data_dir, kinds,
                                                 concurrency, args.http, args.loop))
    # The machine's speed moves within minutes: the raw engine again, right after.
    res["engine_after"] = engine_figures(args.seconds, args.data_dir, tuple(kinds))
    print("engine after:", json.dumps(res["engine_after"]), flush=True)
    res["load_average_1m"] = round(os.getloadavg()[0], 2)
    harness.write_json("embeddings.json", res)
    if "short" in kinds and "long" in kinds:
        plot(res, REPO / "docs" / "img" / "embeddings.png")
    print(table(res))
    print(figure_rows(res))


if __name__ == "__main__":
    main()
