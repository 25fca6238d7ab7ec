"""The batch lane's cost to interactive users, and a batch's own speed.

    .venv/bin/python -m bench.batch_lane [--lines 2000] [--rate 10] [--seconds 20]

One stack of processes (nats-server, gateway, scheduler, one worker of the bundled
MiniLM encoder, the batch runner), three phases in one run:
  1. quiet: interactive embedding requests (one short sentence each, over NATS) sent
     at a fixed `--rate` per second for `--seconds`: their p50 / p99 latency;
  2. batch: a batch of `--lines` short embedding lines (the Batch API over HTTP),
     with the same interactive requests at the same rate while it runs: their
     p50 / p99, and the batch's lines/s (creation to `completed`, polled);
  3. interactive: the same lines sent as ordinary requests, as many at once as the
     runner sends (TENSORBUS_BATCH_CONCURRENCY): lines/s.
Writes bench/out/batch_lane.json and prints rows for docs/benchmarks.md.
"""

from __future__ import annotations

import asyncio
import json
import os
import tempfile
import time
from pathlib import Path

import msgspec

from bench import harness

MODEL = "all-MiniLM-L6-v2"
SUBJECT = "inference.v1.embeddings"


def sentence(i: int) -> str:
    return f"short line {i} about the weather in town number {i % 97}"


async def ask(nc, text: str) -> float:
    t0 = time.perf_counter()
    msg = await nc.request(SUBJECT, msgspec.json.encode({"model": MODEL, "input": text}),
                           timeout=60)
    assert not (msg.headers or {}).get("Nats-Service-Error-Code"), msg.data[:200]
    return time.perf_counter() - t0


async def paced(nc, rate: float, seconds: float | None, until: asyncio.Event | None = None):
    """Latencies of requests sent every 1/rate s (open loop) for `seconds`, or until
    `until` is set."""
    tasks, start, k = [], time.perf_counter(), 0
    while True:
        due = start + k / rate
        if (seconds is not None and due - start >= seconds) or (until and until.is_set()):
            break
        await asyncio.sleep(max(0.0, due - time.perf_counter()))  # the pace itself
        tasks.append(asyncio.create_task(ask(nc, f"interactive question {k}")))
        k += 1
    return list(await asyncio.gather(*tasks))


async def run_batch(http_url: str, lines: int) -> tuple[float, dict]:
    import openai

    client = openai.AsyncOpenAI(base_url=http_url + "/v1", api_key="none", max_retries=0)
    data = b"".join(json.dumps({"custom_id": f"l{i}", "method": "POST", "url": "/v1/embeddings",
                                "body": {"model": MODEL, "input": sentence(i)}}).encode() + b"\n"
                    for i in range(lines))
    f = await client.files.create(file=("lines.jsonl", data), purpose="batch")
    t0 = time.perf_counter()
    b = await client.batches.create(input_file_id=f.id, endpoint="/v1/embeddings",
                                    completion_window="24h")
    while b.status not in ("completed", "failed", "cancelled", "expired"):
        await asyncio.sleep(0.2)  # polling, as a client does
        b = await client.batches.retrieve(b.id)
    took = time.perf_counter() - t0
    return took, {"status": b.status, "completed": b.request_counts.completed,
                  "failed": b.request_counts.failed}


async def interactive_lines(nc, lines: int, concurrency: int) -> float:
    queue = iter(range(lines))

    async def client():
        for i in queue:
            await ask(nc, sentence(i))

    t0 = time.perf_counter()
    await asyncio.gather(*(client() for _ in range(concurrency)))
    return time.perf_counter() - t0


async def main_async(lines: int, rate: float, seconds: float, workdir: Path) -> dict:
    from shared.config import Config
    from shared.natsd import free_port

    port = free_port()
    env = harness.service_env(MODEL, http_port=port)
    concurrency = Config.from_env(env).batch_concurrency
    async with harness.running(workdir, MODEL, sup_env=env, ready_timeout=600,
                               telemetry=False, workers={"worker": {}}) as (sup, nc):
        sup.start("batch", "services.batch", **env)
        http = f"http://127.0.0.1:{port}"
        await paced(nc, rate, 3)  # warm: every shape the requests use, once
        quiet = await paced(nc, rate, seconds)
        done = asyncio.Event()
        batch_task = asyncio.create_task(run_batch(http, lines))
        batch_task.add_done_callback(lambda _: done.set())
        during = await paced(nc, rate, None, until=done)
        took, batch = await batch_task
        plain = await interactive_lines(nc, lines, concurrency)
    command = f"python -m bench.batch_lane --lines {lines} --rate {rate:g} --seconds {seconds:g}"
    return {**harness.run_info(command), "lines": lines, "rate_per_s": rate,
            "runner_concurrency": concurrency,
            "quiet": {"requests": len(quiet), **harness.percentiles(quiet, digits=1)},
            "during_batch": {"requests": len(during), **harness.percentiles(during, digits=1)},
            "batch": {**batch, "seconds": round(took, 2), "lines_per_s": round(lines / took, 1)},
            "interactive_lines": {"seconds": round(plain, 2),
                                  "lines_per_s": round(lines / plain, 1)}}


def main() -> None:
    ap = harness.parser(__doc__)
    ap.add_argument("--lines", type=int, default=2000)
    ap.add_argument("--rate", type=float, default=10.0, help="interactive requests per second")
    ap.add_argument("--seconds", type=float, default=20.0, help="length of the quiet phase")
    args = ap.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    with tempfile.TemporaryDirectory(prefix="bench-batch-lane-") as tmp:
        harness.seed_jax_cache(Path(tmp))
        res = asyncio.run(main_async(args.lines, args.rate, args.seconds, Path(tmp)))
    print(json.dumps(res, indent=1))
    harness.write_json("batch_lane.json", res)
    cmd = res["command"]
    q, d = res["quiet"], res["during_batch"]
    print(harness.figure_row("interactive p50 / p99, quiet",
                             f"{q['p50_ms']} / {q['p99_ms']} ms", cmd))
    print(harness.figure_row("interactive p50 / p99, batch running",
                             f"{d['p50_ms']} / {d['p99_ms']} ms", cmd))
    print(harness.figure_row("batch lines/s (Batch API)", str(res["batch"]["lines_per_s"]), cmd))
    print(harness.figure_row("same lines sent interactively, lines/s",
                             str(res["interactive_lines"]["lines_per_s"]), cmd))


if __name__ == "__main__":
    main()
