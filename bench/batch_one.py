"""One token through SmolLM2 at batch 1: weight layouts, XLA CPU options and torch,
against the memory bandwidth of the machine, side by side in one process.

Each variant is a bare jitted pass of one token through every weight (norms, every
matmul, the tied head; attention of a lone token is its value, no cache), the floor
a batch-1 decode step cannot beat. The variants run in alternating rounds and each
figure is the median over rounds, so a machine loaded by other work shifts them
together. Beside them: the read bandwidth of a large array sum (numpy on one
thread, torch on the configured threads) and the bytes of weights one token reads
in each form, which give each form's bandwidth floor.

Each figure comes with the process's CPU time per pass, which a loaded machine
changes far less than the wall time (docs/decisions/0061).

    .venv/bin/python -m bench.batch_one --rounds 7 --repeats 5 --torch
"""

from __future__ import annotations

import json
import os
import statistics
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import numpy as np

# XLA CPU option sets tried (per executable; engine/jaxrt.py holds the served one).
OPTION_SETS = {
    "ynn-off": {"xla_cpu_experimental_ynn_fusion_type": ""},
    "xla-default": {},
    "ynn-dot": {"xla_cpu_experimental_ynn_fusion_type": "LIBRARY_FUSION_TYPE_DOT"},
    "xnn-dot": {"xla_cpu_experimental_ynn_fusion_type": "",
                "xla_cpu_experimental_xnn_fusion_type": "LIBRARY_FUSION_TYPE_DOT"},
    "onednn": {"xla_cpu_experimental_ynn_fusion_type": "", "xla_cpu_use_onednn": "True"},
    "eigen-1-thread": {"xla_cpu_experimental_ynn_fusion_type": "",
                       "xla_cpu_multi_thread_eigen": "False"},
    "onednn-1-thread": {"xla_cpu_experimental_ynn_fusion_type": "", "xla_cpu_use_onednn": "True",
                        "xla_cpu_multi_thread_eigen": "False"},
    "fast-math": {"xla_cpu_experimental_ynn_fusion_type": "", "xla_cpu_enable_fast_math": "True"},
}

def _tree(host: dict, cfg, layout: str, store) -> dict:
    """The engine's host tree ([in, out], fused) -> this variant's: layout "io"
    (as served), "oi" (every matmul weight [out, in], contracted on its last
    axis), "oi-split" (oi with q/k/v and gate/up as separate weights)."""
    import jax.numpy as jnp

    d = cfg.head_dim
    layers = []
    for lp in host["layers"]:
        out = {"ln1_w": lp["ln1_w"], "ln2_w": lp["ln2_w"]}
        mats = {k: lp[k] for k in ("qkv_w", "o_w", "gate_up_w", "down_w")}
        if layout != "io":
            mats = {k: np.ascontiguousarray(w.T) for k, w in mats.items()}
        if layout == "oi-split":
            q, kk = cfg.heads * d, cfg.kv_heads * d
            qkv, gu = mats.pop("qkv_w"), mats.pop("gate_up_w")
            mats.update(q_w=qkv[:q], k_w=qkv[q:q + kk], v_w=qkv[q + kk:],
                        gate_w=gu[:cfg.intermediate], up_w=gu[cfg.intermediate:])
        out.update({k: jnp.asarray(w, store) for k, w in mats.items()})
        layers.append(out)
    return {"embed": jnp.asarray(host["embed"], store), "norm_w": jnp.asarray(host["norm_w"]),
            "layers": layers}


def _pass(cfg, layout: str, half_dot: bool = False, dots: bool = False):
    """A pure function (params, token) -> logits [1, V] float32 for `layout`."""
    import jax
    import jax.numpy as jnp

    from engine.decoder.layers import inv_frequencies, rms_norm, rope

    inv = jnp.asarray(inv_frequencies(cfg))
    hi = None

    def mm(x, w):
        if half_dot:  # bf16 x bf16 -> float32, no convert of the weight
            x = x.astype(w.dtype)
        else:
            w = w.astype(jnp.float32)  # bf16 storage: the convert is XLA's to fuse (or not)
        spec = "ni,io->no" if layout == "io" else "ni,oi->no"
        return jnp.einsum(spec, x, w, precision=hi, preferred_element_type=jnp.float32)

    def dots_only(params, token):  # the same weights read, none of the small ops
        x = params["embed"][token].astype(jnp.float32)
        for lp in params["layers"]:
            qkv = mm(x, lp["qkv_w"])
            x = x + mm(qkv[:, :cfg.hidden], lp["o_w"])
            gu = mm(x, lp["gate_up_w"])
            x = x + mm(gu[:, :cfg.intermediate], lp["down_w"])
        w = params["embed"].astype(jnp.float32)
        return jnp.einsum("ne,ve->nv", x, w, preferred_element_type=jnp.float32)

    def one(params, token):
        pos = jnp.zeros((1,), jnp.int32)
        x = params["embed"][token].astype(jnp.float32)
        n, d = 1, cfg.head_dim
        for lp in params["layers"]:
            h = rms_norm(x, lp["ln1_w"], cfg.norm_eps)
            if layout == "oi-split":
                q, k, v = (mm(h, lp[f"{c}_w"]) for c in "qkv")
            else:
                qkv = mm(h, lp["qkv_w"])
                a, b = cfg.heads * d, cfg.heads * d + cfg.kv_heads * d
                q, k, v = qkv[:, :a], qkv[:, a:b], qkv[:, b:]
            q = rope(q.reshape(n, cfg.heads, d), pos, inv)
            k = rope(k.reshape(n, cfg.kv_heads, d), pos, inv)
            att = (q.reshape(n, cfg.kv_heads, cfg.groups, d)
                   + 0 * k[:, :, None, :] + v.reshape(n, cfg.kv_heads, 1, d)).reshape(n, -1)
            x = x + mm(att, lp["o_w"])
            h = rms_norm(x, lp["ln2_w"], cfg.norm_eps)
            if layout == "oi-split":
                gate, up = mm(h, lp["gate_w"]), mm(h, lp["up_w"])
            else:
                gu = mm(h, lp["gate_up_w"])
                gate, up = gu[:, :cfg.intermediate], gu[:, cfg.intermediate:]
            x = x + mm(jax.nn.silu(gate) * up, lp["down_w"])
        h = rms_norm(x, params["norm_w"], cfg.norm_eps)
        w = params["embed"].astype(jnp.float32)
        return jnp.einsum("ne,ve->nv", h, w, preferred_element_type=jnp.float32)

    return dots_only if dots else one


CPU_MS: dict = {}


def _timer(fn, repeats: int, name: str = ""):
    def run() -> float:
        times = []
        c0 = time.process_time()
        for _ in range(repeats):
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
        CPU_MS.setdefault(name, []).append(1000 * (time.process_time() - c0) / repeats)
        return 1000 * statistics.median(times)

    return run


def bandwidth_gbs(mb: int = 512) -> dict:
    import torch

    torch.set_num_threads(os.cpu_count() or 1)
    a = np.ones(mb << 18, np.float32)  # mb MiB
    t = torch.ones(mb << 18)
    out = {}
    sums = (("numpy sum, 1 thread", a.sum), (f"torch sum, {os.cpu_count()} threads", t.sum))
    for name, fn in sums:
        fn()
        ms = _timer(fn, 5, "bw " + name)()
        out[name] = round(a.nbytes / ms / 1e6, 2)
        out[name + ", per CPU-second"] = round(a.nbytes / CPU_MS["bw " + name][-1] / 1e6, 2)
    return out


def main(argv=None) -> dict:
    import argparse

    import jax
    import jax.numpy as jnp

    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--repeats", type=int, default=10, help="passes timed per round")
    ap.add_argument("--variants", default="", help="comma-separated names (default: all)")
    ap.add_argument("--torch", action="store_true", help="also torch float32 (its own copy)")
    args = ap.parse_args(argv)

    from engine.decoder.config import load_config
    from engine.decoder.model import load_host_forms
    from shared import catalog

    model_dir = catalog.bundled_dir(catalog.SMOLLM2)
    cfg = load_config(model_dir)
    host = load_host_forms(model_dir, cfg, "none", ("float",))[0]["float"]
    f32, bf16 = jnp.float32, jnp.bfloat16
    variants = {
        # name: (layout, weight storage dtype, option set, bf16 x bf16 dots or
        # "dots": the matmuls alone)
        "io f32 ynn-off (served)": ("io", f32, "ynn-off", False),
        "io f32 ynn-off, the matmuls alone": ("io", f32, "ynn-off", "dots"),
        "io f32 xla-default": ("io", f32, "xla-default", False),
        "io f32 ynn-dot": ("io", f32, "ynn-dot", False),
        "io f32 xnn-dot": ("io", f32, "xnn-dot", False),
        "io f32 onednn": ("io", f32, "onednn", False),
        "io f32 eigen-1-thread": ("io", f32, "eigen-1-thread", False),
        "io f32 fast-math": ("io", f32, "fast-math", False),
        "io f32 onednn-1-thread": ("io", f32, "onednn-1-thread", False),
        "oi f32 eigen-1-thread": ("oi", f32, "eigen-1-thread", False),
        "oi f32 ynn-off": ("oi", f32, "ynn-off", False),
        "oi f32 ynn-dot": ("oi", f32, "ynn-dot", False),
        "oi f32 xnn-dot": ("oi", f32, "xnn-dot", False),
        "oi-split f32 ynn-off": ("oi-split", f32, "ynn-off", False),
        "oi bf16->f32 ynn-off": ("oi", bf16, "ynn-off", False),
        "oi bf16->f32 ynn-dot": ("oi", bf16, "ynn-dot", False),
        "oi bf16xbf16 ynn-off": ("oi", bf16, "ynn-off", True),
        "oi bf16xbf16 ynn-dot": ("oi", bf16, "ynn-dot", True),
        "oi bf16xbf16 xnn-dot": ("oi", bf16, "xnn-dot", True),
        "io bf16xbf16 ynn-dot": ("io", bf16, "ynn-dot", True),
    }
    if args.variants:
        keep = args.variants.split(",")
        variants = {k: v for k, v in variants.items() if any(s in k for s in keep)}
    token = jnp.asarray([5], jnp.int32)
    trees, runs, ref = {}, {}, None
    results: dict = {"cases": {}}
    for name, (layout, store, opts, half_dot) in variants.items():
        key = (layout, store)
        if key not in trees:
            trees[key] = _tree(host, cfg, layout, store)
        params = trees[key]
        fn = _pass(cfg, layout, half_dot is True, half_dot == "dots")
        lowered = jax.jit(fn).lower(params, token)
        try:
            exe = lowered.compile(compiler_options=OPTION_SETS[opts])
        except Exception as exc:  # noqa: BLE001 - an option this jaxlib rejects
            results["cases"][name] = {"error": f"{type(exc).__name__}: {exc}"[:200]}
            print(json.dumps({name: results["cases"][name]}), flush=True)
            continue
        logits = np.asarray(exe(params, token))
        err = None  # the matmuls alone: another function, nothing to compare
        if half_dot != "dots":
            ref = logits if ref is None else ref
            err = round(float(np.abs(logits - ref).max()), 5)
        runs[name] = _timer(
            lambda exe=exe, params=params: jax.block_until_ready(exe(params, token)),
            args.repeats, name)
        runs[name]()
        results["cases"][name] = {"max_abs_diff_vs_first": err}
    if args.torch:
        import torch

        from engine.torch_decoder import model as tm

        tp = tm.load_params(model_dir, cfg, torch.float32, "cpu", 16)
        tok = torch.tensor([5])
        pos = torch.zeros(1, dtype=torch.long)

        def torch_pass():
            with torch.inference_mode():
                x = tm.embed(tp, cfg, tok, pos)
                for lp in tp.layers:
                    q, k, v = tm.attn_in(tp, lp, cfg, x, pos)
                    x = tm.attn_out(lp, cfg, x, q.reshape(1, -1))
                return tm.head(tp, cfg, x)

        def threads(n):
            def run():
                torch.set_num_threads(n)
                return torch_pass()
            return run

        for n in sorted({1, os.cpu_count() or 1}):
            name = f"torch f32 [in, out], {n} thread(s)"
            threads(n)()
            runs[name] = _timer(threads(n), args.repeats, name)
            results["cases"][name] = {}
    samples: dict[str, list[float]] = {k: [] for k in runs}
    bw = []
    for r in range(args.rounds):
        for name, run in runs.items():
            samples[name].append(run())
        if r % 3 == 0:
            bw.append(bandwidth_gbs())
    for name, ms in samples.items():
        results["cases"][name]["ms_p50"] = round(statistics.median(ms), 3)
        results["cases"][name]["tokens_per_s"] = round(1000 / statistics.median(ms), 1)
        results["cases"][name]["cpu_ms_per_pass"] = round(statistics.median(CPU_MS[name][1:]), 1)
    results["bandwidth_gbs"] = {k: round(statistics.median(b[k] for b in bw), 2) for k in bw[0]}
    n_matmul = sum(int(np.prod(host["layers"][0][k].shape))
                   for k in ("qkv_w", "o_w", "gate_up_w", "down_w")) * cfg.layers
    n_head = int(np.prod(host["embed"].shape))
    results["weights_read_per_token"] = {
        "parameters": n_matmul + n_head,
        "float32_mb": round(4 * (n_matmul + n_head) / 1e6, 1),
        "bfloat16_mb": round(2 * (n_matmul + n_head) / 1e6, 1),
    }
    results["date"] = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    results["load_average"] = os.getloadavg()
    print(json.dumps(results, indent=1))
    return results


if __name__ == "__main__":
    main()
