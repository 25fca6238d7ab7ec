"""The batch lane's cost to interactive users, and a batch's own speed.

    .venv/bin/python -m bench.batch_lane [--lines 2000] [--rate 10] [--seconds 20]
        [--chat-lines 500 --chat-rate 0.5 --concurrency 4,32 --chat-concurrency 16,64]

One stack of processes (nats-server, gateway, scheduler, one worker of the bundled
MiniLM encoder, the batch runner; with `--chat-lines`, a SmolLM2 worker too), three
phases in one run:
  1. quiet: interactive embedding requests (one short sentence each, over NATS) sent
     at a fixed `--rate` per second for `--seconds` (and short chat requests at
     `--chat-rate`, 16 tokens each): their p50 / p99 latency;
  2. batch: a batch of `--lines` short embedding lines (the Batch API over HTTP),
     and one of `--chat-lines` chat lines beside it, with the same interactive
     requests at the same rates while they run: their p50 / p99, and each batch's
     lines/s (creation to `completed`, polled);
  3. interactive: the same lines sent as ordinary requests, as many at once as the
     runner sends (TENSORBUS_BATCH_CONCURRENCY), or at each of `--concurrency`
     (`--chat-concurrency` for the chat lines): lines/s at the best of them.
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
CHAT_MODEL = "smollm2-135m-instruct"
CHAT_SUBJECT = "inference.v1.chat.completions"
CHAT_TOKENS = 16


def sentence(i: int) -> str:
    return f"short line {i} about the weather in town number {i % 97}"


def chat_body(i: int) -> dict:
    return {"model": CHAT_MODEL, "max_tokens": CHAT_TOKENS,
            "messages": [{"role": "user", "content": f"Give line {i} a short title: "
                          f"{sentence(i)}."}]}  # fmt: skip


REFUSED = {"count": 0}  # 429 / 503 answers met (each retried, as a client does)


async def _request(nc, subject: str, body: dict, timeout: float) -> float:
    """Seconds to an answer; a refusal (429, 503) is retried after its Retry-After,
    and its wait counts in the latency, as a client's would."""
    t0 = time.perf_counter()
    while True:
        msg = await nc.request(subject, msgspec.json.encode(body), timeout=timeout)
        code = (msg.headers or {}).get("Nats-Service-Error-Code", "")
        if code in ("429", "503"):
            REFUSED["count"] += 1
            after = float((msg.headers or {}).get("Retry-After", "1") or 1)
            await asyncio.sleep(min(max(after, 0.2), 10.0))  # as the refusal asks
            continue
        assert not code, msg.data[:200]
        return time.perf_counter() - t0


async def ask(nc, text: str) -> float:
    return await _request(nc, SUBJECT, {"model": MODEL, "input": text}, 60)


async def chat(nc, i: int) -> float:
    return await _request(nc, CHAT_SUBJECT, chat_body(i), 120)


async def paced(nc, rate: float, seconds: float | None, until: asyncio.Event | None = None,
                kind: str = "embed"):
    """Latencies of requests sent every 1/rate s (open loop) for `seconds`, or until
    `until` is set; `kind`: embed (one sentence) or chat (CHAT_TOKENS tokens)."""
    tasks, start, k = [], time.perf_counter(), 0
    while rate > 0:
        due = start + k / rate
        if (seconds is not None and due - start >= seconds) or (until and until.is_set()):
            break
        await asyncio.sleep(max(0.0, due - time.perf_counter()))  # the pace itself
        one = ask(nc, f"interactive question {k}") if kind == "embed" else chat(nc, 10**6 + k)
        tasks.append(asyncio.create_task(one))
        k += 1
    return list(await asyncio.gather(*tasks))


async def both(nc, rate: float, chat_rate: float, seconds: float | None,
               until: asyncio.Event | None = None) -> tuple[list, list]:
    """Embedding and chat probes side by side."""
    e, c = await asyncio.gather(paced(nc, rate, seconds, until),
                                paced(nc, chat_rate, seconds, until, kind="chat"))
    return e, c


async def run_batch(http_url: str, lines: int, chat_lines: int = 0) -> tuple[float, dict]:
    """An embedding batch of `lines` and, beside it, a chat batch of `chat_lines`
    -> (seconds until both completed, each one's outcome and seconds)."""
    import openai

    client = openai.AsyncOpenAI(base_url=http_url + "/v1", api_key="none", max_retries=0)

    async def one(url: str, bodies: list[dict]) -> dict:
        data = b"".join(json.dumps({"custom_id": f"l{i}", "method": "POST", "url": url,
                                    "body": body}).encode() + b"\n"
                        for i, body in enumerate(bodies))
        f = await client.files.create(file=("lines.jsonl", data), purpose="batch")
        t0 = time.perf_counter()
        b = await client.batches.create(input_file_id=f.id, endpoint=url,  # type: ignore[arg-type]
                                        completion_window="24h")
        while b.status not in ("completed", "failed", "cancelled", "expired"):
            await asyncio.sleep(0.2)  # polling, as a client does
            b = await client.batches.retrieve(b.id)
        took = time.perf_counter() - t0
        return {"status": b.status, "completed": b.request_counts.completed,
                "failed": b.request_counts.failed, "seconds": round(took, 2),
                "lines_per_s": round(len(bodies) / took, 1)}

    t0 = time.perf_counter()
    jobs = [one("/v1/embeddings", [{"model": MODEL, "input": sentence(i)}
                                   for i in range(lines)])]
    if chat_lines:
        jobs.append(one("/v1/chat/completions", [chat_body(i) for i in range(chat_lines)]))
    got = await asyncio.gather(*jobs)
    took = time.perf_counter() - t0
    return took, {"embeddings": got[0], **({"chat": got[1]} if chat_lines else {})}


async def interactive_lines(nc, lines: int, concurrency: int, kind: str = "embed") -> float:
    queue = iter(range(lines))

    async def client():
        for i in queue:
            await (ask(nc, sentence(i)) if kind == "embed" else chat(nc, i))

    t0 = time.perf_counter()
    await asyncio.gather(*(client() for _ in range(concurrency)))
    return time.perf_counter() - t0


async def all_compiled(nc, model: str, timeout: float = 900.0) -> None:
    """Until `model`'s card says every program it serves is compiled: the figures are
    of a settled worker, not of one compiling in the background beside them."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        msg = await nc.request("inference.v1.models", b"", timeout=5)
        card = next((c for c in msgspec.json.decode(msg.data)["data"] if c["id"] == model), {})
        if card.get("programs_total") and card["programs_compiled"] >= card["programs_total"]:
            return
        await asyncio.sleep(1.0)  # polling the card, as an operator would
    raise TimeoutError(f"{model} still compiling after {timeout:.0f} s")


async def best_of(nc, lines: int, ladder: list[int], kind: str) -> dict:
    """The lines sent interactively at each concurrency of `ladder` -> the best."""
    runs, refused = {}, {}
    for c in ladder:
        before = REFUSED["count"]
        took = await interactive_lines(nc, lines, c, kind)
        runs[c] = round(lines / took, 1)
        refused[c] = REFUSED["count"] - before
        print(json.dumps({"kind": kind, "concurrency": c, "lines_per_s": runs[c],
                          "refused": refused[c]}), flush=True)
    best = max(runs, key=lambda c: runs[c])
    return {"concurrency": best, "lines_per_s": runs[best], "tried": runs, "refused": refused}


async def main_async(lines: int, rate: float, seconds: float, workdir: Path,
                     chat_lines: int = 0, chat_rate: float = 0.0, ladder: list[int] | None = None,
                     chat_ladder: list[int] | None = None) -> dict:
    from services.supervisor import wait_ready
    from shared import catalog
    from shared.config import Config
    from shared.natsd import free_port

    port = free_port()
    env = harness.service_env(MODEL, http_port=port)
    concurrency = Config.from_env(env).batch_concurrency
    ladder = ladder or [concurrency]
    async with harness.running(workdir, MODEL, sup_env=env, ready_timeout=600,
                               telemetry=False, workers={"worker": {}}) as (sup, nc):
        if chat_lines:
            sup.start("chat", "services.worker", **{
                **env, "TENSORBUS_WORKER_ID": "chat", "TENSORBUS_MODEL": CHAT_MODEL,
                "TENSORBUS_MODEL_DIR": str(catalog.bundled_dir(CHAT_MODEL))})
            await wait_ready(nc, CHAT_MODEL, 1, timeout=600)
            await all_compiled(nc, CHAT_MODEL)
        sup.start("batch", "services.batch", **env)
        http = f"http://127.0.0.1:{port}"
        await both(nc, rate, chat_rate, 3)  # warm: every shape the requests use, once
        quiet, quiet_chat = await both(nc, rate, chat_rate, seconds)
        done = asyncio.Event()
        batch_task = asyncio.create_task(run_batch(http, lines, chat_lines))
        batch_task.add_done_callback(lambda _: done.set())
        during, during_chat = await both(nc, rate, chat_rate, None, until=done)
        took, batch = await batch_task
        print(json.dumps({"batch": batch, "seconds": round(took, 1),
                          "quiet": harness.percentiles(quiet, digits=1),
                          "during": harness.percentiles(during, digits=1),
                          "quiet_chat": harness.percentiles(quiet_chat, digits=1),
                          "during_chat": harness.percentiles(during_chat, digits=1),
                          "refused": REFUSED["count"]}), flush=True)  # before the rest
        plain = await best_of(nc, lines, ladder, "embed")
        plain_chat = await best_of(nc, chat_lines, chat_ladder or [16], "chat") \
            if chat_lines else None
    command = (f"python -m bench.batch_lane --lines {lines} --rate {rate:g} --seconds {seconds:g}"
               + (f" --chat-lines {chat_lines} --chat-rate {chat_rate:g} --concurrency "
                  f"{','.join(map(str, ladder))} --chat-concurrency "
                  f"{','.join(map(str, chat_ladder or [16]))}" if chat_lines else ""))
    out = {**harness.run_info(command), "lines": lines, "rate_per_s": rate,
           "runner_concurrency": concurrency,
           "quiet": {"requests": len(quiet), **harness.percentiles(quiet, digits=1)},
           "during_batch": {"requests": len(during), **harness.percentiles(during, digits=1)},
           "batch": {**batch, "seconds": round(took, 2),
                     "lines_per_s": round((lines + chat_lines) / took, 1)},
           "interactive_lines": plain, "refused_and_retried": REFUSED["count"]}
    if chat_lines:
        out.update({"chat_lines": chat_lines, "chat_rate_per_s": chat_rate,
                    "quiet_chat": {"requests": len(quiet_chat),
                                   **harness.percentiles(quiet_chat, digits=1)},
                    "during_batch_chat": {"requests": len(during_chat),
                                          **harness.percentiles(during_chat, (50, 90, 99),
                                                                digits=1),
                                          "ms_in_order": [round(x * 1e3) for x in during_chat]},
                    "interactive_chat_lines": plain_chat})
    return out


def main() -> None:
    ap = harness.parser(__doc__)
    ap.add_argument("--lines", type=int, default=2000)
    ap.add_argument("--rate", type=float, default=10.0, help="interactive requests per second")
    ap.add_argument("--seconds", type=float, default=20.0, help="length of the quiet phase")
    ap.add_argument("--chat-lines", type=int, default=0, help="chat lines in a second batch")
    ap.add_argument("--chat-rate", type=float, default=0.5, help="interactive chats per second")
    ap.add_argument("--concurrency", default="", help="ladder for the lines sent interactively")
    ap.add_argument("--chat-concurrency", default="16,64")
    args = ap.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    ladder = [int(c) for c in args.concurrency.split(",") if c] or None
    chat_ladder = [int(c) for c in args.chat_concurrency.split(",") if c]
    with tempfile.TemporaryDirectory(prefix="bench-batch-lane-") as tmp:
        harness.seed_jax_cache(Path(tmp))
        res = asyncio.run(main_async(args.lines, args.rate, args.seconds, Path(tmp),
                                     args.chat_lines, args.chat_rate if args.chat_lines else 0.0,
                                     ladder, chat_ladder))  # fmt: skip
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
    if "chat_lines" in res:
        q, d = res["quiet_chat"], res["during_batch_chat"]
        print(harness.figure_row("interactive chat p50 / p99, quiet",
                                 f"{q['p50_ms']} / {q['p99_ms']} ms", cmd))
        print(harness.figure_row("interactive chat p50 / p99, batch running",
                                 f"{d['p50_ms']} / {d['p99_ms']} ms", cmd))
        print(harness.figure_row("chat batch lines/s",
                                 str(res["batch"]["chat"]["lines_per_s"]), cmd))
        print(harness.figure_row("same chat lines sent interactively, lines/s",
                                 str(res["interactive_chat_lines"]["lines_per_s"]), cmd))


if __name__ == "__main__":
    main()
