"""GuideLLM, unchanged, against the OpenAI-compatible HTTP API: a short concurrency sweep.

    .venv/bin/python -m bench.external [--guidellm PATH] [--seconds 15] [--streams 1,4,16]

1. Starts the stack as separate processes (nats-server, gateway with HTTP on a free
   port, scheduler, telemetry, one demo-LM worker with 16 KV slots) and waits until
   the model has a ready worker.
2. Writes a GuideLLM scenario (bench/out/guidellm-scenario.json): the `openai_http`
   backend on `/v1/completions`, streaming; synthetic prompts of 32 tokens and 64
   output tokens made with the demo LM's own tokenizer directory (offline: nothing is
   downloaded); a `concurrent` profile at each stream count for `--seconds`.
3. Runs `guidellm run` on it (`HF_HUB_OFFLINE=1`), keeps its JSON report
   (bench/out/guidellm.json) and prints TTFT, ITL and throughput per stream count as
   the markdown table in docs/benchmarks.md.

GuideLLM is not a project dependency (it pins click ~8.4 and installs httptools and
uvloop, which would switch uvicorn's parser under the gateway); install it into a
virtualenv of its own, e.g. one that reuses this one's packages:

    python3.11 -m venv /tmp/guidellm-venv
    echo "$PWD/.venv/lib/python3.11/site-packages" > /tmp/guidellm-venv/lib/python3.11/site-packages/tensorbus.pth
    /tmp/guidellm-venv/bin/pip install 'guidellm==0.8.1'    # the version pyproject's bench extra names
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

from bench import harness
from bench.harness import OUT, REPO
from shared import catalog

MODEL = catalog.DEMO_LM


def scenario(target: str, streams: list[int], seconds: float, prompt_tokens: int,
             output_tokens: int) -> dict:
    tokenizer_dir = str(catalog.bundled_dir(MODEL))
    return {
        "metadata": {"name": "tensorbus-demo-lm", "description": "short concurrency sweep"},
        "spec": {
            "backend": {"kind": "openai_http", "target": target, "model": MODEL,
                        "request_format": "/v1/completions", "stream": True,
                        # GuideLLM checks `/health`; ours is `/healthz`.
                        "api_routes": {"/health": "healthz"}},
            "profile": {"kind": "concurrent"},
            "tokenizer": {"kind": "huggingface_auto", "model": tokenizer_dir},
            "data": [{"kind": "synthetic_text", "prompt_tokens": prompt_tokens,
                      "output_tokens": output_tokens}],
            "constraints": [{"kind": "max_duration", "seconds": seconds}],
        },
        "benchmarks": [{"profile.streams": s} for s in streams],
    }


async def run(args) -> None:
    from shared.natsd import free_port

    port = free_port()
    env = harness.service_env(http_port=port, TENSORBUS_DATA_DIR=str(REPO / ".data"))
    worker = {"TENSORBUS_MODEL": MODEL, "TENSORBUS_MODEL_DIR": str(catalog.bundled_dir(MODEL)),
              "TENSORBUS_DECODE_SLOTS": "16"}
    with tempfile.TemporaryDirectory(prefix="tensorbus-external-") as tmp:
        async with harness.running(Path(tmp), MODEL, ready_timeout=300,
                                   workers={"worker": worker}, **env):
            await _guidellm(args, port)
    print(table(json.loads((OUT / "guidellm.json").read_text())))


async def _guidellm(args, port: int) -> None:
    """GuideLLM against the running stack: its scenario file, then its own process."""
    streams = harness.csv_ints(args.streams)
    spec = scenario(f"http://127.0.0.1:{port}", streams, args.seconds,
                    args.prompt_tokens, args.output_tokens)
    path = harness.write_json("guidellm-scenario.json", spec)
    report = OUT / "guidellm.json"
    cmd = [args.guidellm, "run", "--scenario", str(path), "--output",
           f"kind=json,path={report}", "--disable-console-interactive"]
    print("$", " ".join(cmd), flush=True)
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    await asyncio.to_thread(subprocess.run, cmd, check=True, env=env)


def table(report: dict) -> str:
    """TTFT, ITL (median / p99 ms) and output tokens/s per stream count."""
    rows = ["| streams | requests | output tokens/s | TTFT p50 / p99 ms | ITL p50 / p99 ms |",
            "|---|---|---|---|---|"]
    for b in report["benchmarks"]:
        m = b["metrics"]

        def pct(name: str, q: str) -> float:
            return m[name]["successful"]["percentiles"][q]

        streams = b["config"]["strategy"].get("streams", "?")
        rows.append(
            f"| {streams} | {m['request_totals']['successful']} | "
            f"{m['output_tokens_per_second']['successful']['mean']:.1f} | "
            f"{pct('time_to_first_token_ms', 'p50'):.1f} / {pct('time_to_first_token_ms', 'p99'):.1f} | "
            f"{pct('inter_token_latency_ms', 'p50'):.2f} / {pct('inter_token_latency_ms', 'p99'):.2f} |")
    return "\n".join(rows)


def main() -> None:
    p = harness.parser(__doc__)
    p.add_argument("--guidellm", default=shutil.which("guidellm") or "guidellm",
                   help="the guidellm executable (its own virtualenv)")
    p.add_argument("--seconds", type=float, default=15.0, help="per stream count")
    p.add_argument("--streams", default="1,4,16")
    p.add_argument("--prompt-tokens", type=int, default=32)
    p.add_argument("--output-tokens", type=int, default=64)
    p.add_argument("--table", metavar="REPORT", help="only print the table of a saved report")
    args = p.parse_args()
    if args.table:
        print(table(json.loads(Path(args.table).read_text())))
        return
    asyncio.run(run(args))


if __name__ == "__main__":
    main()
