"""Checkpoints their publisher stored quantized, read from config.json's
`quantization_config`: served exactly, or refused by name; never served approximately.

A pre-quantized checkpoint loaded as if it were float is wrong without an error: its
float8 weights lose their scales (every matmul off by a factor per tensor, channel or
block), and packed integer weights (AWQ, GPTQ) are not even the weights' shape. So:

- Served: AWQ (`version: "gemm"`, 4 bits) and GPTQ (2, 4 or 8 bits, v1 and v2
  zero points, act-order's `g_idx`) packed integers, read into float32 at load,
  w = (q - zero) * scale, exactly (engine/packed_ints.py).
- Served: FP8 weights, dequantized at load to float32 (w = q * scale), so every
  engine, dtype, compute form and `TENSORBUS_QUANT` downstream sees the float
  weights a float checkpoint would have given. Two layouts:
  - `quant_method: "fp8"`: transformers' FineGrainedFP8 (DeepSeek's layout, `X.weight`
    float8 + `X.weight_scale_inv` per `weight_block_size` block, multiplied despite
    its name) and vLLM's serialized fp8 (`X.weight_scale`, one per tensor).
  - `quant_method: "compressed-tensors"`, format float-quantized or naive-quantized,
    8-bit float weights (`X.weight_scale` per tensor, channel, group or block).
  Quantized activations (input_activations, static input or activation scales) and
  a quantized KV cache (kv_cache_scheme, k_scale / v_scale) describe compute this
  engine does in float: those scales are dropped, and the load's log line says so.
- Refused (`UnsupportedQuantization`, a ValueError the decoder and encoder configs
  turn into their own refusal: a worker exits 78): AWQ's other versions (gemv,
  marlin, ...), GPTQ's 3-bit words, bitsandbytes, compressed-tensors' integer or
  packed formats, and any other method, each with what to use instead.

Modules a config leaves float (`ignore`, `modules_to_not_convert`, `ignored_layers`)
need no list here: what is dequantized is decided by each tensor's stored dtype, and
a float8 tensor without exactly one scale of a declared layout is an error, as is a
float8 tensor in a checkpoint whose config names no quantization.

Pure Python until `dequantize` (numpy): the worker's checks and the registry's push
read `scheme` without jax.
"""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import numpy as np

SERVED = "awq (gemm), gptq (2, 4, 8 bits), fp8, compressed-tensors (float8 weights)"
# compressed-tensors formats that store 8-bit float weights as they are (no packing).
FLOAT_FORMATS = ("float-quantized", "naive-quantized")
# Beside `X.weight`: the weight's scale (one of these), and tensors a float engine
# does not use (activation and KV cache scales, a symmetric weight's zero point).
SCALES = ("weight_scale", "weight_scale_inv")
UNUSED = ("input_scale", "activation_scale", "output_scale", "k_scale", "v_scale", "q_scale",
          "weight_zero_point", "input_zero_point", "output_zero_point")  # fmt: skip

# A layout is the block one scale covers, (rows, columns) of the [out, in] weight;
# None: the whole axis. (None, None) per tensor, (1, None) per output channel.
Layout = tuple[int | None, int | None]
TENSOR: Layout = (None, None)
CHANNEL: Layout = (1, None)


class UnsupportedQuantization(ValueError):
    """A `quantization_config` the engines do not serve exactly."""


@dataclasses.dataclass(frozen=True)
class Scheme:
    """What a served `quantization_config` says about the stored weights."""

    method: str  # "fp8" | "compressed-tensors" | "awq" | "gptq"
    layouts: tuple[Layout, ...]  # the scale layouts the config declares (float8)
    ignored: tuple[str, ...] = ()  # what the config quantizes that is computed in float
    bits: int = 0  # awq, gptq: bits a value
    group: int = 0  # awq, gptq: inputs a scale and zero point cover (-1: all)
    v2: bool = False  # gptq: zero points stored as they are (else minus one)


def _advice(bits: Any = None) -> str:
    quant = {8: "int8", 4: "int4"}.get(bits if isinstance(bits, int) else -1)
    how = f"TENSORBUS_QUANT={quant}" if quant else "TENSORBUS_QUANT=int8, int4 or fp8"
    return f"use the float checkpoint with {how}, or (a decoder) a GGUF file"


def _refuse(method: str, bits: Any = None, detail: str = "") -> UnsupportedQuantization:
    what = f"{method!r} ({detail})" if detail else repr(method)
    return UnsupportedQuantization(f"quantization method {what} is not served: {_advice(bits)}")


def _bnb_bits(q: dict) -> int | None:
    if q.get("load_in_4bit") or str(q.get("_load_in_4bit", "")).lower() == "true":
        return 4
    if q.get("load_in_8bit") or str(q.get("_load_in_8bit", "")).lower() == "true":
        return 8
    return None


def _block(value: Any, where: str) -> Layout:
    """[rows, cols] (or compressed-tensors' older "RxC" text) -> a layout."""
    parts = value.lower().split("x") if isinstance(value, str) else value
    try:
        rows, cols = (int(p) for p in parts)
    except (TypeError, ValueError):
        raise UnsupportedQuantization(f"{where} {value!r} is not a [rows, columns] block") from None
    if rows < 1 or cols < 1:
        raise UnsupportedQuantization(f"{where} {value!r} is not a [rows, columns] block")
    return rows, cols


def _fp8(q: dict) -> Scheme:
    fmt = q.get("fmt", "e4m3")
    if fmt not in ("e4m3", "e5m2"):
        raise _refuse("fp8", detail=f"fmt {fmt!r}")
    layouts = [TENSOR]
    if q.get("weight_block_size"):
        layouts.append(_block(q["weight_block_size"], "weight_block_size"))
    ignored: tuple[str, ...] = ()
    if q.get("activation_scheme"):
        ignored = (f"{q['activation_scheme']} fp8 activations",)
    return Scheme("fp8", tuple(layouts), ignored)


def _awq(q: dict) -> Scheme:
    bits, version = q.get("bits", q.get("w_bit")), str(q.get("version", "gemm")).lower()
    if version != "gemm":  # gemv and the kernels' own repackings lay words out otherwise
        raise _refuse("awq", bits, f"version {version!r}; served: gemm")
    if bits != 4 or q.get("zero_point") is False:
        raise _refuse("awq", bits, f"{bits}-bit, zero_point {q.get('zero_point', True)}")
    group = int(q.get("group_size", q.get("q_group_size", 128)))
    return Scheme("awq", (), (), bits=4, group=group)


def _gptq(q: dict) -> Scheme:
    bits, fmt = q.get("bits"), str(q.get("checkpoint_format", "gptq")).lower()
    if bits not in (2, 4, 8):  # 3-bit values straddle the int32 words
        raise _refuse("gptq", bits, f"{bits}-bit; served: 2, 4, 8")
    if fmt not in ("gptq", "gptq_v2"):
        raise _refuse("gptq", bits, f"checkpoint_format {fmt!r}")
    return Scheme("gptq", (), (), bits=bits, group=int(q.get("group_size", 128)),
                  v2=fmt == "gptq_v2")  # fmt: skip


def _weights_layout(w: dict, fmt: str) -> Layout:
    """One config group's weight arguments -> its scale layout; refused unless the
    weights are 8-bit floats stored as they are, symmetric."""
    kind, bits = w.get("type", "int"), w.get("num_bits")
    if kind != "float" or bits != 8 or fmt not in FLOAT_FORMATS:
        raise _refuse("compressed-tensors", bits, f"{kind}{bits} weights, {fmt}")
    if w.get("symmetric") is False:
        raise _refuse("compressed-tensors", 8, "asymmetric float8 weights")
    strategy = w.get("strategy") or "tensor"
    if strategy == "tensor":
        return TENSOR
    if strategy == "channel":
        return CHANNEL
    if strategy == "group" and w.get("group_size"):
        return 1, int(w["group_size"])
    if strategy == "block" and w.get("block_structure"):
        return _block(w["block_structure"], "block_structure")
    raise _refuse("compressed-tensors", 8, f"float8 weights with strategy {strategy!r}")


def _compressed_tensors(q: dict) -> Scheme:
    fmt = q.get("format") or "dense"
    sparsity = q.get("sparsity_config") or {}
    if sparsity.get("format", "dense") != "dense":
        raise _refuse("compressed-tensors", detail=f"sparsity format {sparsity['format']!r}")
    layouts, ignored = [], []
    for name, group in (q.get("config_groups") or {}).items():
        if group.get("input_activations") or group.get("output_activations"):
            ignored.append(f"{name}'s activations")
        if group.get("weights"):
            layouts.append(_weights_layout(group["weights"], group.get("format") or fmt))
    if not layouts:
        raise _refuse("compressed-tensors", detail=f"{fmt}, no quantized weights")
    if q.get("kv_cache_scheme"):
        ignored.append("the KV cache")
    return Scheme("compressed-tensors", tuple(dict.fromkeys(layouts)), tuple(ignored))


def scheme(cfg: dict) -> Scheme | None:
    """config.json (a dict) -> how its weights are stored: None for float weights (no
    `quantization_config`), a `Scheme` for a served method; `UnsupportedQuantization`
    naming the method, and what to use instead, for every other one."""
    q = cfg.get("quantization_config")
    if not q:
        return None
    if not isinstance(q, dict):
        raise UnsupportedQuantization(f"quantization_config {q!r} is not an object")
    method = str(q.get("quant_method", "")).lower()
    if method == "fp8":
        return _fp8(q)
    if method == "compressed-tensors":
        return _compressed_tensors(q)
    if method == "bitsandbytes":
        raise _refuse(method, _bnb_bits(q))
    if method == "awq":
        return _awq(q)
    if method == "gptq":
        return _gptq(q)
    raise UnsupportedQuantization(f"quantization method {method or 'unnamed'!r} is not "
                                  f"served (served: {SERVED}): {_advice()}")  # fmt: skip


def read_scheme(model_dir: str | Path) -> Scheme | None:
    """`scheme` of a directory's config.json; None without one (a GGUF file)."""
    path = Path(model_dir) / "config.json"
    if not path.is_file():
        return None
    return scheme(json.loads(path.read_text()))


def _is_float8(a) -> bool:
    import ml_dtypes
    import numpy as np

    return a.dtype in (np.dtype(ml_dtypes.float8_e4m3fn), np.dtype(ml_dtypes.float8_e5m2))


def _fit(name: str, shape: tuple[int, int], scale_shape: tuple, layouts) -> tuple[int, int]:
    """The block (rows, cols) one scale covers: the declared layout whose scale grid
    is `scale_shape`. Two declared layouts with the same grid but other blocks (two
    block sizes that round alike) cannot be told apart: refused, not guessed."""
    out, inn = shape
    fits = set()
    for rows, cols in layouts:
        rows = out if rows is None else min(rows, out)
        cols = inn if cols is None else min(cols, inn)
        if scale_shape == (math.ceil(out / rows), math.ceil(inn / cols)):
            fits.add((rows, cols))
    if len(fits) != 1:
        how = "matches none" if not fits else "matches several"
        raise UnsupportedQuantization(f"{name}: a scale of shape {list(scale_shape)} for a "
                                      f"{list(shape)} weight {how} of the layouts the "
                                      f"config declares {list(layouts)}")  # fmt: skip
    return fits.pop()


def dequantize_weight(name: str, q, scale, layouts) -> np.ndarray:
    """A float8 [out, in] weight and its scale -> float32 q * scale, each scale
    spread over the block it covers (the last blocks cut at the weight's edge)."""
    import numpy as np

    if q.ndim != 2:
        raise UnsupportedQuantization(f"{name}: a float8 tensor of shape {list(q.shape)}, "
                                      f"not an [out, in] weight")  # fmt: skip
    s = np.asarray(scale, np.float32)
    s = s.reshape(1, 1) if s.size == 1 else s.reshape(-1, 1) if s.ndim == 1 else s
    if s.ndim != 2:
        raise UnsupportedQuantization(f"{name}: a scale of shape {list(s.shape)}")
    rows, cols = _fit(name, q.shape, s.shape, layouts)
    full = np.repeat(np.repeat(s, rows, axis=0), cols, axis=1)[: q.shape[0], : q.shape[1]]
    return q.astype(np.float32) * full


def dequantize(weights: dict, found: Scheme | None) -> tuple[dict, int]:
    """A checkpoint's tensors (full names), in place -> (the same dict with every
    float8 `X.weight` replaced by float32 `q * scale` and the scale tensors dropped,
    or every AWQ / GPTQ packed layer by its float32 `X.weight`; how many were
    dequantized)."""
    if found is not None and found.method in ("awq", "gptq"):
        from engine import packed_ints

        try:
            n = packed_ints.dequantize(weights, found.method, found.bits, found.group, found.v2)
        except ValueError as exc:
            raise UnsupportedQuantization(str(exc)) from None
        return weights, n
    float8 = sorted(n for n, a in weights.items() if _is_float8(a))
    if found is None:
        if float8:
            raise UnsupportedQuantization(f"{float8[0]!r} is stored as float8, but config.json "
                                          f"has no quantization_config saying how it is "
                                          f"scaled")  # fmt: skip
        return weights, 0
    for name in float8:
        base = name[: -len("weight")] if name.endswith(".weight") else None
        scales = [base + s for s in SCALES if base is not None and base + s in weights]
        if len(scales) != 1:
            raise UnsupportedQuantization(f"{name!r} is stored as float8 with "
                                          f"{'no scale' if not scales else 'two scales'} "
                                          f"({' or '.join(SCALES)})")  # fmt: skip
        assert base is not None  # a scale was found beside it
        zero = weights.get(base + "weight_zero_point")
        if zero is not None and zero.astype("float32").any():
            raise UnsupportedQuantization(f"{name!r} has a nonzero zero point: float8 "
                                          f"weights are served symmetric only")  # fmt: skip
        weights[name] = dequantize_weight(name, weights[name], weights[scales[0]],
                                          found.layouts)  # fmt: skip
    for name in [n for n in weights if n.rsplit(".", 1)[-1] in SCALES]:
        weight = name.rsplit(".", 1)[0] + ".weight"
        if weight not in float8:
            raise UnsupportedQuantization(f"{name!r} scales {weight!r}, which is not stored "
                                          f"as float8")  # fmt: skip
        del weights[name]
    for name in [n for n in weights if n.rsplit(".", 1)[-1] in UNUSED]:
        del weights[name]
    return weights, len(float8)
