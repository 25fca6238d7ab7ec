"""Quantized and split decoder engines side by side, on this machine's CPU.

Per weight form of one model (float32, bfloat16, int8 dequantized in the matmul,
int8 x int8 (w8a8), int4, fp8, a GGUF model's own blocks (`gguf`), and int8 with
the compute form chosen per bucket, engine/forms.py: `int8-auto` within the
default weight budget, `int8-auto+float` with room for a float copy):
  - weight bytes held (integers plus scales; every form an auto engine kept);
  - perplexity on the fixed text set (bench/support/texts.py, each text cut to 64 tokens);
  - decode tokens/s at 1 and at 16 streams (a static batch of one 12-token prompt,
    decode steps only, median of `--repeats` runs of `--steps` steps).
With `--torch` (default on), the torch decoder engine (engine/torch_decoder) in
float32 and with torch's dynamic int8 Linear (`torch.ao.quantization.quantize_dynamic`,
int8 weights per output channel, activations quantized per call; its CPU kernels are
fbgemm/oneDNN's, not XLA's) standing in for its matmul weights.
With `--tp 1,N` (and N forced CPU devices: XLA_FLAGS must be set before Python
starts), the float32 decode step time unsplit and split over N devices.

    .venv/bin/python -m bench.engine_quant --model smollm2-135m-instruct
    XLA_FLAGS=--xla_force_host_platform_device_count=2 .venv/bin/python -m \
        bench.engine_quant --model tensorbus-demo-lm --forms float32 --tp 1,2
"""

from __future__ import annotations

import json
import os
import time

import numpy as np

from bench import harness
from bench.engine_check import decode_steps, start_streams

os.environ.setdefault("HF_HUB_OFFLINE", "1")

# name -> (dtype, quant, compute form, weight budget in bytes; 0: the float32 size)
FORMS = {"float32": ("float32", "none", "auto", 0), "bfloat16": ("bfloat16", "none", "auto", 0),
         "int8": ("float32", "int8", "dequant", 0), "int8-w8a8": ("float32", "int8", "w8a8", 0),
         "int4": ("float32", "int4", "dequant", 0), "fp8": ("float32", "fp8", "dequant", 0),
         "gguf": ("float32", "gguf", "dequant", 0),  # a GGUF file's own Q4_1/Q8_0 blocks
         "int8-auto": ("float32", "int8", "auto", 0),
         "int8-auto+float": ("float32", "int8", "auto", 1 << 40)}  # fmt: skip


def decode_rate(model_dir, name, dtype, quant, streams, steps, repeats, tp=1, form="auto",
                budget=0):  # fmt: skip
    """(seconds per step, tokens/s) of `streams` slots decoding in lock-step. An auto
    form is measured afresh (no choice file) before the timed steps."""
    from engine.decoder import DecoderEngine

    eng = DecoderEngine(model_dir, name, dtype=dtype, slots=streams, max_context=128,
                        prefill_buckets=(16,), decode_windows=(128,), quant=quant,
                        tensor_parallel=tp, quant_form=form, weight_budget=budget,
                        forms_cache=None)  # fmt: skip
    if quant != "none" and form == "auto":
        eng.select_forms()
    prompt = list(range(30, 42))
    start_streams(eng, streams, prompt)

    def run():
        decode_steps(eng, steps)

    run()  # compiles
    times = []
    for _ in range(repeats):
        for s in range(streams):  # restart the sequences: same positions every run
            eng.free(s)
        start_streams(eng, streams, prompt)
        t0 = time.perf_counter()
        run()
        times.append(time.perf_counter() - t0)
    sec = float(np.median(times)) / steps
    return sec, streams / sec, eng


class _TorchInt8:
    """A torch decoder weight [in, out] as torch's dynamic int8 Linear: `x @ self`."""

    def __init__(self, w) -> None:
        import torch

        lin = torch.nn.Linear(w.shape[0], w.shape[1], bias=False)
        lin.weight.data = w.T.contiguous().float()
        self.m = torch.ao.quantization.quantize_dynamic(
            torch.nn.Sequential(lin), {torch.nn.Linear}, dtype=torch.qint8)
        self.nbytes = w.numel() + 8 * w.shape[1]  # int8 values, a scale and zero point per row

    def __rmatmul__(self, x):
        return self.m(x)


def torch_rate(model_dir, name, streams, steps, repeats, int8: bool):
    """(seconds per step, tokens/s, weight bytes) of the torch decoder engine."""
    import torch

    from engine.decoder.static import GREEDY, prefill_insert
    from engine.torch_decoder import TorchDecoder

    eng = TorchDecoder(model_dir, name, slots=streams, max_context=128)
    nbytes = eng.params.nbytes
    if int8:
        p = eng.params
        for lp in p.layers:
            if lp.qkv_b is not None or lp.o_b is not None or lp.up_b is not None:
                raise ValueError("the int8 stand-in covers bias-free (Llama) layers only")
            for n in ("qkv_w", "o_w", "up_w", "down_w"):
                setattr(lp, n, _TorchInt8(getattr(lp, n)))
        head = p.head
        p.head = _TorchInt8(head)
        weights = [getattr(lp, n) for lp in p.layers for n in ("qkv_w", "o_w", "up_w", "down_w")]
        nbytes = (p.embed.numel() * p.embed.element_size() + p.head.nbytes
                  + sum(w.nbytes for w in weights))  # norms left out: under 0.1 %  # fmt: skip
        del head
    prompt = list(range(30, 42))
    times = []
    with torch.inference_mode():
        for r in range(repeats + 1):
            for s in range(streams):
                eng.free(s)
                prefill_insert(eng, s, prompt, GREEDY, 0)
            t0 = time.perf_counter()
            for _ in range(steps):
                eng.step()
            if r:  # the first run warms up
                times.append(time.perf_counter() - t0)
    sec = float(np.median(times)) / steps
    return sec, streams / sec, nbytes


def main(argv=None) -> dict:
    ap = harness.parser(__doc__)
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--forms", default=",".join(FORMS))
    ap.add_argument("--streams", default="1,16")
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--tp", default="", help="e.g. 1,2: float32 step time per degree")
    ap.add_argument("--torch", default="float32,int8", help="torch decoder rows ('' for none)")
    ap.add_argument("--torch-threads", type=int, default=1,
                    help="torch's threads (1: its steadier setting on a shared machine)")
    ap.add_argument("--out", default="")
    a = ap.parse_args(argv)
    import jax

    from bench.support.texts import PERPLEXITY_TEXTS, perplexity
    from engine import jaxrt
    from shared.catalog import bundled_dir

    jaxrt.setup(None)
    started = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    model_dir = bundled_dir(a.model)
    streams = harness.csv_ints(a.streams)
    rows, split = [], []
    for form in harness.csv_strs(a.forms):
        dtype, quant, compute, budget = FORMS[form]
        row = {"form": form}
        for n in streams:
            sec, rate, eng = decode_rate(model_dir, a.model, dtype, quant, n, a.steps, a.repeats,
                                         form=compute, budget=budget)  # fmt: skip
            row[f"tokens_per_s_{n}"] = round(rate, 1)
            row[f"step_ms_{n}"] = round(1e3 * sec, 2)
            row[f"weight_bytes_{n}"] = eng.forms.weight_bytes
            if compute == "auto" and quant != "none":
                row[f"chosen_{n}"] = eng.forms.compute_forms[f"step {n}"]
                row[f"measured_ms_{n}"] = eng.forms.form_ms.get(f"step {n}", {})
        row["weight_bytes"] = eng.forms.weight_bytes
        row["perplexity"] = round(perplexity(eng, PERPLEXITY_TEXTS), 3)
        rows.append(row)
        print(json.dumps(row), flush=True)
        del eng
    torch_rows = []
    if a.torch:
        import torch

        torch.set_num_threads(a.torch_threads)
    for kind in harness.csv_strs(a.torch):
        row = {"engine": "torch", "form": kind}
        for n in streams:
            sec, rate, nbytes = torch_rate(model_dir, a.model, n, a.steps, a.repeats,
                                           kind == "int8")  # fmt: skip
            row[f"tokens_per_s_{n}"] = round(rate, 1)
            row[f"step_ms_{n}"] = round(1e3 * sec, 2)
        row["weight_bytes"] = nbytes
        torch_rows.append(row)
        print(json.dumps(row), flush=True)
    for tp in harness.csv_ints(a.tp):
        for n in streams:
            sec, rate, _ = decode_rate(model_dir, a.model, "float32", "none", n, a.steps,
                                       a.repeats, tp)  # fmt: skip
            split.append({"tensor_parallel": tp, "streams": n, "step_ms": round(1e3 * sec, 2)})
            print(json.dumps(split[-1]), flush=True)
    result = {"model": a.model, "started": started, "jax": jax.__version__,
              "devices": jax.device_count(),
              "cpus": os.cpu_count(), "load_1min": round(os.getloadavg()[0], 1),
              "date": time.strftime("%Y-%m-%d"), "forms": rows, "torch": torch_rows,
              "torch_threads": a.torch_threads, "split": split}  # fmt: skip
    if a.out:
        with open(a.out, "w") as f:
            json.dump(result, f, indent=2)
    return result


if __name__ == "__main__":
    main()
