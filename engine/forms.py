"""Compute forms of a quantized model, and the choice of the fastest one per bucket.

A quantized model's weights can be multiplied in more than one way, and which is
fastest depends on the backend and on how many rows the matmul has (a batch bucket):
- "dequant": the stored integers (or fp8) converted and scaled inside the jitted
  step, then the float matmul (engine/quant.py);
- "w8a8": int8 weights with one scale per output channel, activations quantized per
  row inside the step, int8 x int8 -> int32 matmuls (int8 models only);
- "float": the dequantized weights held as floats in the model dtype (the same
  numbers at float size; allowed only where the weight budget holds them);
- "kernel": the stored int8/int4 groups read by engine/kernels' FFI matrix-vector
  kernel (CPU, float32 models, one device; the same arrays as "dequant", so no
  memory of its own). Considered where it could be built (docs/decisions/0062).
- "kernel8": the kernel with the activations rounded to int8 per group and integer
  dot products for 4-bit weights (the same arrays again): the rounding of w8a8, about
  half the kernel's vector work per weight, so it wins where a step has many rows
  (docs/decisions/0064). Run only when named: auto leaves it out, as its greedy
  tokens depend on the batch (docs/decisions/0071).

The engine (engine/decoder/formchoice.py) measures every allowed form at every
bucket once (`timed`: that bucket's compiled program), keeps the `fastest` per bucket,
and writes the choice with its figures (`store`) to a JSON file beside the JAX
compilation cache, keyed by the model, its shapes, the device kind and the JAX
version (`key_of`), so a later cold start reads the choice (`lookup`) instead of
measuring again. A serving engine measures after it is ready, and until then serves
with the newest choice stored for its model under any key (`last_choice`).
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from pathlib import Path
from typing import Callable

import numpy as np

from shared.logging import get_logger

log = get_logger(__name__)

FORMS = ("float", "dequant", "w8a8", "kernel", "kernel8")
KERNEL_FORMS = ("kernel", "kernel8")  # forms run by engine/kernels
KERNEL_QUANTS = ("gguf", "int8", "int4")  # quants whose weights the kernel reads
SETTINGS = ("auto",) + FORMS  # TENSORBUS_QUANT_FORM
CACHE_NAME = "compute-forms.json"


def check_form(form: str, quant: str) -> str:
    """A requested form that `quant` can run; ValueError otherwise."""
    if form not in SETTINGS:
        raise ValueError(f"unknown compute form {form!r}; use one of {', '.join(SETTINGS)}")
    if quant == "none" and form in ("dequant", "w8a8"):
        raise ValueError(f"compute form {form!r} needs quantized weights (quant is 'none')")
    if form == "w8a8" and quant != "int8":
        raise ValueError(f"compute form 'w8a8' runs int8 weights only (quant is {quant!r})")
    if form in KERNEL_FORMS and quant not in KERNEL_QUANTS:
        raise ValueError(f"compute form {form!r} reads int8 and int4 groups (quant is {quant!r})")
    return form


def candidates(quant: str, setting: str, sizes: dict[str, int], budget: int,
               kernel: bool = False) -> tuple[str, ...]:
    """Forms to consider: the forced one, or (auto) those whose weights fit in
    `budget` bytes next to the stored ones. sizes: form -> bytes of its weights;
    kernel: whether the kernel forms can run (auto considers "kernel" for gguf only).

    Auto never considers "kernel8": rounding the activations to int8 turns XLA's
    last-bit differences between batch sizes into different greedy tokens (SmolLM2,
    16 prompts alone and then together, 24 tokens each: 10 of 16 parted with
    kernel8, none with the float kernel; docs/decisions/0071). Name it to have it.

    A GGUF file whose blocks the kernel reads runs on the kernel alone, unmeasured:
    measured on every bucket of a served SmolLM2 it was 5-18x faster than the XLA
    path's dequantizing step and faster or level on prefill, while measuring cost the
    first minutes a second program per bucket and seconds-long runs on the engine
    thread between steps (docs/decisions/0073)."""
    if quant == "none":
        return ("float",)
    if setting in KERNEL_FORMS and not kernel:
        return ("dequant",)  # engine/kernels logged why
    if setting != "auto":
        return (setting,)
    if kernel and quant == "gguf":
        return ("kernel",)
    possible = ("float", "dequant", "w8a8") if quant == "int8" else ("float", "dequant")
    stored = sizes["dequant"]
    return tuple(f for f in possible
                 if f in ("dequant",) + KERNEL_FORMS or stored + sizes[f] <= budget)


def kernel_usable(quant: str, setting: str, dtype, mesh) -> bool:
    """Whether the kernel form may run: a quant it reads, float32, one device, and
    the kernel built and loaded (engine/kernels; compiled here on first use)."""
    import jax.numpy as jnp

    if quant not in KERNEL_QUANTS or setting not in ("auto",) + KERNEL_FORMS:
        return False
    if setting == "auto" and quant != "gguf":
        return False
    if jnp.dtype(dtype) != jnp.float32 or mesh is not None:
        return False
    from engine import kernels

    return kernels.load() is not None


def held_bytes(trees: dict) -> int:
    """Bytes of the distinct arrays the forms' trees hold (the kernel form shares
    the stored one's)."""
    import jax

    seen = {id(a): a for t in trees.values() for a in jax.tree.leaves(t)}
    return int(sum(np.prod(a.shape) * a.dtype.itemsize for a in seen.values()))


def cache_path(explicit: str | os.PathLike | None = "") -> Path | None:
    """Where choices are kept: `explicit`, or (given "") beside the JAX compilation
    cache when one is set; None: nowhere (every start measures)."""
    if explicit is None:
        return None
    if explicit:
        return Path(explicit)
    import jax

    cache_dir = jax.config.jax_compilation_cache_dir  # type: ignore[attr-defined]  # unstubbed flag
    return Path(cache_dir) / CACHE_NAME if cache_dir else None


def cache_key(fields: dict) -> str:
    import jax

    dev = jax.devices()[0]
    full = dict(fields, device=f"{dev.platform}:{dev.device_kind}", jax=jax.__version__)
    text = json.dumps(full, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:20]


def _read(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}  # none yet, or unreadable: measure again and write a fresh one


def _write(path: Path, key: str, entry: dict) -> None:
    """Merge one entry in, atomically (another worker may be writing its own)."""
    doc = _read(path)
    doc[key] = entry
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}")
    tmp.write_text(json.dumps(doc, indent=1, sort_keys=True))
    os.replace(tmp, path)


def timed(run: Callable[[], object], repeats: int) -> float:
    """Milliseconds of one run (median of `repeats`), after one untimed run that
    compiles."""
    import jax

    jax.block_until_ready(run())
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(run())
        times.append(time.perf_counter() - t0)
    return 1e3 * float(np.median(times))


def lookup(key: str, buckets: list[str], path: Path | None) -> dict | None:
    """The stored entry of `key` (its choices cover `buckets`), or None."""
    if path is None:
        return None
    entry = _read(path).get(key)
    if entry and set(entry.get("choices", {})) == set(buckets):
        return entry
    return None


def last_choice(model: str, path: Path | None) -> dict[str, str]:
    """bucket -> form of the newest stored entry for `model` under any key (other
    shapes, another device): what a cold start serves with while it measures its own."""
    if path is None:
        return {}
    entries = [e for e in _read(path).values()
               if isinstance(e, dict) and e.get("fields", {}).get("model") == model]
    if not entries:
        return {}
    return dict(max(entries, key=lambda e: str(e.get("date", ""))).get("choices", {}))


def store(path: Path | None, key: str, fields: dict, choices: dict[str, str],
          ms: dict[str, dict[str, float]]) -> None:
    if path is not None:
        entry = {"fields": fields, "choices": choices, "ms": ms,
                 "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}  # fmt: skip
        _write(path, key, entry)


def key_of(fields: dict, buckets: list[str], forms: tuple[str, ...]) -> str:
    return cache_key(dict(fields, buckets=list(buckets), forms=list(forms)))


def fastest(ms: dict[str, float]) -> str:
    return min(ms, key=ms.__getitem__)
