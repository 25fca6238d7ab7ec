"""The CPU kernel's matmul alone: float activations ("kernel") against int8
activations ("kernel8", docs/decisions/0064), side by side in one process.

Random weights quantized to 4-bit groups of 32 (GGUF's Q4_1 layout as the engine
packs it) at each ROWSxINxOUT case; each form's jitted call is timed in alternating
rounds (a loaded machine's swings fall on both), and the median wall and CPU time
per call are reported with the multiply-adds per CPU second.

    .venv/bin/python -m bench.kernel_matvec --cases 16x1536x8192,4x1536x8192,16x576x1536
"""

from __future__ import annotations

import statistics
import time

import numpy as np


def _case(text: str) -> tuple[int, int, int]:
    rows, k, n = (int(v) for v in text.split("x"))
    return rows, k, n


def main(argv=None) -> dict:
    import jax
    import jax.numpy as jnp

    from bench.harness import csv_strs, parser, run_info, write_json
    from engine import kernels, quant

    ap = parser(__doc__)
    ap.add_argument("--cases", default="16x1536x8192,4x1536x8192,16x576x1536",
                    help="ROWSxINxOUT, comma-separated")  # fmt: skip
    ap.add_argument("--forms", default="kernel,kernel8")
    ap.add_argument("--calls", type=int, default=30, help="timed calls per round")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", default="")
    args = ap.parse_args(argv)
    if kernels.load() is None:
        raise SystemExit(f"the kernel cannot run here: {kernels.unavailable_reason()}")
    rng, forms = np.random.default_rng(0), csv_strs(args.forms)
    result = {"info": run_info(), "cases": []}
    for rows, k, n in (_case(c) for c in csv_strs(args.cases)):
        w = rng.standard_normal((k, n)).astype(np.float32) * 0.05
        stored = jax.tree.map(jnp.asarray, quant.quantize(w, "int4", 0, 32))
        x = jnp.asarray(rng.standard_normal((rows, k)).astype(np.float32))
        call = jax.jit(lambda x, w: quant.matmul(x, w))
        weights = {f: quant.with_compute({"w": stored}, f)["w"] for f in forms}
        for f in forms:
            call(x, weights[f]).block_until_ready()  # compile and warm
        wall: dict[str, list[float]] = {f: [] for f in forms}
        cpu: dict[str, list[float]] = {f: [] for f in forms}
        for _ in range(args.rounds):
            for f in forms:
                c0, t0 = time.process_time(), time.perf_counter()
                for _ in range(args.calls):
                    call(x, weights[f]).block_until_ready()
                wall[f].append((time.perf_counter() - t0) / args.calls)
                cpu[f].append((time.process_time() - c0) / args.calls)  # all threads
        row = {"rows": rows, "in": k, "out": n}
        for f in forms:
            c = statistics.median(cpu[f])
            row[f] = {"wall_ms": round(statistics.median(wall[f]) * 1e3, 3),
                      "cpu_ms": round(c * 1e3, 3), "gmac_per_cpu_s": round(rows * k * n / c / 1e9, 1)}  # fmt: skip
        print(row, flush=True)
        result["cases"].append(row)
    write_json(args.out or "kernel_matvec.json", result)
    return result


if __name__ == "__main__":
    main()
