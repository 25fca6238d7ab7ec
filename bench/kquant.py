"""A `Q4_K_M` GGUF file the size people download, held two ways side by side: its
blocks read by the CPU kernel (quantization `gguf`, what `auto` picks on a CPU) and
float32 weights (`none`, what `auto` picked for K-quant files before the blocks were
kept, engine/gguf_blocks.py).

The file is written here in SmolLM2-1.7B's shapes (24 layers, hidden 2048, MLP
8192, 32 heads, tied embeddings, SmolLM2's own tokenizer from the bundled file) with
random valid blocks typed as llama.cpp's `Q4_K_M` types them: Q4_K everywhere but
the tied embedding and, on the layers `use_more_bits` picks, attn_v and ffn_down,
which are Q6_K. No weights are downloaded and none are trained: the figures are of
the format and the shapes, not of the text. For each way: engine build (the file
read and the weights prepared, nothing cached), the bytes of the weights held, the
process's peak resident memory (each way in a process of its own), a distinct
prompt's prefill, and decode steps of 1 and 4 sequences after their programs
compiled (median of `--steps`).

    .venv/bin/python -m bench.kquant --steps 16 --out bench/out/kquant.json
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from bench.harness import parser

LAYERS, HIDDEN, FFN, HEADS, VOCAB = 24, 2048, 8192, 32, 49152
_SIZES = {"Q4_K": (144, (0, 2)), "Q6_K": (210, (208,))}  # block bytes, its float16 scales


def _blocks(rng, rows: int, cols: int, kind: str) -> np.ndarray:
    size, scales = _SIZES[kind]
    b = rng.integers(0, 256, (rows, cols // 256, size), dtype=np.uint8)
    for at in scales:  # small super-block scales: weights of about 1e-2
        b[..., at:at + 2] = np.frombuffer(np.float16(2e-5).tobytes(), np.uint8)
    return b.reshape(rows, -1)


def _more_bits(i: int, n: int) -> bool:
    """llama.cpp's `use_more_bits`: the layers whose attn_v and ffn_down Q4_K_M keeps
    in Q6_K."""
    return i < n // 8 or i >= 7 * n // 8 or (i - n // 8) % 3 == 2


def write_file(path: Path) -> None:
    import gguf

    from shared import catalog
    from shared import gguf as header

    src = header.read_header(header.find_file(Path(catalog.bundled_dir(catalog.SMOLLM2))))
    m = src.metadata
    rng = np.random.default_rng(0)
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_context_length(8192)
    w.add_embedding_length(HIDDEN)
    w.add_feed_forward_length(FFN)
    w.add_block_count(LAYERS)
    w.add_head_count(HEADS)
    w.add_head_count_kv(HEADS)
    w.add_rope_dimension_count(HIDDEN // HEADS)
    w.add_rope_freq_base(130000.0)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_vocab_size(VOCAB)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(m["tokenizer.ggml.pre"])
    w.add_token_list(m["tokenizer.ggml.tokens"])
    w.add_token_types(m["tokenizer.ggml.token_type"])
    w.add_token_merges(m["tokenizer.ggml.merges"])
    w.add_bos_token_id(m["tokenizer.ggml.bos_token_id"])
    w.add_eos_token_id(m["tokenizer.ggml.eos_token_id"])
    w.add_add_bos_token(False)
    w.add_chat_template(m["tokenizer.chat_template"])

    def kq(name: str, rows: int, cols: int, kind: str) -> None:
        w.add_tensor(name, _blocks(rng, rows, cols, kind),
                     raw_dtype=getattr(gguf.GGMLQuantizationType, kind))

    def norm(name: str) -> None:
        w.add_tensor(name, np.ones(HIDDEN, np.float32))

    kq("token_embd.weight", VOCAB, HIDDEN, "Q6_K")  # tied: the head, as Q4_K_M keeps it
    norm("output_norm.weight")
    for i in range(LAYERS):
        b, more = f"blk.{i}.", "Q6_K" if _more_bits(i, LAYERS) else "Q4_K"
        norm(b + "attn_norm.weight")
        norm(b + "ffn_norm.weight")
        for t in ("attn_q", "attn_k", "attn_output"):
            kq(b + t + ".weight", HIDDEN, HIDDEN, "Q4_K")
        kq(b + "attn_v.weight", HIDDEN, HIDDEN, more)
        kq(b + "ffn_gate.weight", FFN, HIDDEN, "Q4_K")
        kq(b + "ffn_up.weight", FFN, HIDDEN, "Q4_K")
        kq(b + "ffn_down.weight", HIDDEN, FFN, more)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def measure(model_dir: Path, how: str, steps: int) -> dict:
    """One way, in this process (see the module docstring)."""
    from engine import jaxrt, quant
    from engine.decoder import DecoderEngine
    from shared.messages import Sampling

    jaxrt.setup(tempfile.mkdtemp())  # nothing prepared or compiled before
    t0 = time.perf_counter()
    eng = DecoderEngine(model_dir, "q4_k_m-1.7b", slots=4, max_context=1024, quant=how,
                        prefill_buckets=(128,), decode_windows=(1024,), forms_cache=None,
                        compile_ahead="lazy")  # fmt: skip
    build = time.perf_counter() - t0
    greedy = Sampling(temperature=0.0)
    out = {"quant": how, "build_s": round(build, 1),
           "weights_mb": round(quant.tree_bytes(eng.params) / 1e6)}

    def prefill(slot: int, seed: int) -> float:
        prompt = [(seed * 131 + k * 7) % (VOCAB - 10) + 5 for k in range(100)]
        t = time.perf_counter()
        eng.begin(slot, prompt, greedy, 0)
        while eng.prefill_step(slot, 128) is None:
            pass
        return time.perf_counter() - t

    def alone(seed: int) -> float:
        took = prefill(0, seed)
        eng.free(0)
        return took

    alone(0)  # compiles
    out["prefill_100_ms"] = round(1000 * min(alone(s) for s in (1, 2)), 1)
    for n in (1, 4):
        for s in range(n):
            prefill(s, 10 + s)
        times = []
        for i in range(steps + 2):  # the first two compile and settle
            t = time.perf_counter()
            eng.make_room(lambda holders: holders[0])
            pending = eng.step_async()
            assert pending is not None  # n live sequences
            pending.result()
            if i >= 2:
                times.append(time.perf_counter() - t)
        for s in range(n):
            eng.free(s)
        step = statistics.median(times)
        out[f"step_{n}_ms"] = round(1000 * step, 1)
        out[f"tok_s_{n}"] = round(n / step, 2)
    out["peak_rss_mb"] = round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)
    status = Path("/proc/self/status").read_text()
    out["rss_mb"] = round(int(status.split("VmRSS:")[1].split()[0]) / 1024)  # held at the end
    return out


def main() -> None:
    p = parser(__doc__)
    p.add_argument("--steps", type=int, default=16)
    p.add_argument("--ways", default="gguf,none", help="quantizations, each in its own process")
    p.add_argument("--out", help="write the figures here as JSON")
    p.add_argument("--one", help=argparse.SUPPRESS)  # internal: measure one way here
    p.add_argument("--dir", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.one:
        print(json.dumps(measure(Path(args.dir), args.one, args.steps)), flush=True)
        return
    with tempfile.TemporaryDirectory() as tmp:
        d = Path(tmp)
        t0 = time.perf_counter()
        write_file(d / "smollm2-1.7b-shaped.Q4_K_M.gguf")
        size = (d / "smollm2-1.7b-shaped.Q4_K_M.gguf").stat().st_size
        print(json.dumps({"file_mb": round(size / 1e6),
                          "written_s": round(time.perf_counter() - t0, 1)}), flush=True)
        results = []
        for how in args.ways.split(","):
            env = dict(os.environ, HF_HUB_OFFLINE="1")
            run = subprocess.run([sys.executable, "-m", "bench.kquant", "--one", how, "--dir", tmp,
                                  "--steps", str(args.steps)], env=env,
                                 stdout=subprocess.PIPE, text=True, check=True)  # fmt: skip
            results.append(json.loads(run.stdout.strip().splitlines()[-1]))
            print(json.dumps(results[-1]), flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps({"file_mb": round(size / 1e6), "ways": results}, indent=1))


if __name__ == "__main__":
    main()
