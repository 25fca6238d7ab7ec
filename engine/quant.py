"""Weight-only quantization: int8 and int4, each with a scale per output channel
and group of inputs.

A quantized weight is a `QWeight` standing in the parameter pytree where the float
weight stood; the model code's `dense`, `unembed` and row lookups accept either, so
the layer math is written once. Activations, norms and the KV cache keep the model
dtype; only the stored weights shrink.

Layout, for a float weight `w` contracted over axis `axis` (0 for a dense [IN, OUT]
matrix, 1 for a [V, E] embedding that is also the lm head), IN split into groups of
`group` inputs, symmetric (zero stays zero):
- int8: `q` int8, w's shape; groups of 128 inputs (64 or 32 where 128 does not
  divide IN; IN itself below that); scale = amax / 127. One scale per whole output
  channel left MiniLM's worst cosine against float32 at 0.9983 (inputs like "hi");
  groups of 128 give 0.9993 for 3 % more bytes (docs/decisions/0010).
- int4: `q` uint8, w's shape with the contracted axis halved, two 4-bit values per
  byte (the even input in the low nibble); groups of 32 (as GGUF's Q4 blocks; 16 or
  8 where 32 does not divide IN); asymmetric, as GGUF's Q4_1: w = q * scale + offset
  with q in [0, 15], scale = (max - min) / 15, offset = min. The symmetric form
  (q in [-7, 7]) raised SmolLM2's perplexity on the fixed texts by 49 %, Q4_0's
  (the signed extreme at -8) by 34 %, this one by 6 %. Packed by hand because
  XLA:CPU keeps `jnp.int4` arrays at one byte per value.
- `scale` (and int4's `offset`): float32, w's shape with the contracted axis IN / group.

The matmul dequantizes inside the jitted step (convert, scale, then the float
matmul; XLA fuses the first two into one loop over the weight).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

MODES = ("none", "int8", "int4")
GROUPS = {8: (128, 64, 32), 4: (32, 16, 8)}  # preferred group sizes, largest first


@dataclasses.dataclass(frozen=True)
class QWeight:
    q: Any  # int8 [w's shape] or uint8 [w's shape, contracted axis / 2]
    scale: Any  # float32 [w's shape, contracted axis / group]
    offset: Any  # int4: float32, scale's shape (each group's minimum); int8: None
    axis: int  # the contracted axis of the float weight (static)
    bits: int  # 8 or 4 (static)
    group: int  # inputs per scale (static)


jax.tree_util.register_dataclass(
    QWeight, data_fields=["q", "scale", "offset"], meta_fields=["axis", "bits", "group"]
)


def group_size(n: int, bits: int) -> int:
    for g in GROUPS[bits]:
        if n % g == 0:
            return g
    if bits == 4:
        raise ValueError(f"int4 needs the contracted size ({n}) to be a multiple of 8")
    return n


def check_mode(mode: str) -> str:
    if mode not in MODES:
        raise ValueError(f"unknown quantization {mode!r}; use one of {', '.join(MODES)}")
    return mode


def quantize(w: np.ndarray, mode: str, axis: int) -> QWeight:
    """Float weight -> QWeight contracted over `axis` (host numpy, done once at load)."""
    bits = {"int8": 8, "int4": 4}.get(mode)
    if bits is None:
        raise ValueError(f"cannot quantize to {mode!r}")
    w = np.asarray(w, np.float32)
    n = w.shape[axis]
    g = group_size(n, bits)
    x = np.moveaxis(w, axis, -1)  # [..., IN]
    x = x.reshape(x.shape[:-1] + (n // g, g))  # [..., IN/G, G]
    back = lambda a: np.moveaxis(a[..., 0], -1, axis).astype(np.float32)  # noqa: E731
    if bits == 8:
        scale = np.maximum(np.abs(x).max(axis=-1, keepdims=True), 1e-30) / 127.0  # [..., IN/G, 1]
        q = np.clip(np.rint(x / scale), -127, 127).astype(np.int8).reshape(x.shape[:-2] + (n,))
        return QWeight(np.moveaxis(q, -1, axis), back(scale), None, axis, bits, g)
    lo = x.min(axis=-1, keepdims=True)  # [..., IN/G, 1]
    scale = np.maximum(x.max(axis=-1, keepdims=True) - lo, 1e-30) / 15.0
    u = np.clip(np.rint((x - lo) / scale), 0, 15).astype(np.uint8).reshape(x.shape[:-2] + (n,))
    q = u[..., 0::2] | (u[..., 1::2] << 4)  # [..., IN/2]
    return QWeight(np.moveaxis(q, -1, axis), back(scale), back(lo), axis, bits, g)


def dequantize(w: QWeight, dtype) -> jax.Array:
    """-> the float weight in `dtype`."""
    q = jnp.moveaxis(w.q, w.axis, -1)  # [..., IN] int8 or [..., IN/2] uint8
    s = jnp.moveaxis(w.scale, w.axis, -1)  # [..., IN/G]
    if w.bits == 4:
        q = jnp.stack([q & 0xF, q >> 4], axis=-1).reshape(q.shape[:-1] + (-1,))  # [..., IN]
    v = q.reshape(q.shape[:-1] + (-1, w.group)).astype(dtype)  # [..., IN/G, G]
    f = v * s[..., None].astype(dtype)
    if w.offset is not None:
        f = f + jnp.moveaxis(w.offset, w.axis, -1)[..., None].astype(dtype)
    return jnp.moveaxis(f.reshape(q.shape), -1, w.axis)  # back to w's shape


def matmul(x, w: QWeight, precision=None):
    """x: [N, IN] @ w: [IN, OUT] (contracted over axis 0) -> [N, OUT] in x's dtype."""
    return jnp.matmul(x, dequantize(w, x.dtype), precision=precision)


def unembed(h, w: QWeight, precision=None):
    """h: [N, E], w: [V, E] (contracted over axis 1) -> [N, V] float32"""
    return jnp.einsum("ne,ve->nv", h, dequantize(w, h.dtype),
                      preferred_element_type=jnp.float32, precision=precision)  # fmt: skip


def take_rows(w, ids, dtype=None):
    """Embedding lookup: w: [V, E] (float or QWeight over axis 1), ids: [...] -> [..., E]"""
    if not isinstance(w, QWeight):
        return w[ids]
    offset = None if w.offset is None else w.offset[ids]
    rows = QWeight(w.q[ids], w.scale[ids], offset, w.axis + ids.ndim - 1, w.bits, w.group)
    return dequantize(rows, dtype or jnp.float32)


def quantize_tree(tree: dict, mode: str, axes: dict[str, int]) -> dict:
    """Quantize the leaves named in `axes` (name -> contracted axis), at any depth."""
    if mode == "none":
        return tree

    def walk(node):
        if isinstance(node, dict):
            return {k: quantize(v, mode, axes[k]) if k in axes else walk(v) for k, v in node.items()}
        if isinstance(node, list):
            return [walk(v) for v in node]
        return node

    return walk(tree)


def is_qweight(x) -> bool:
    return isinstance(x, QWeight)


def cast_tree(tree, dtype, keep_f32: frozenset[str] = frozenset()):
    """numpy tree -> device arrays: float leaves in `dtype` (or float32 when named in
    `keep_f32`), QWeight parts as they are."""

    def walk(node, name=None):
        if isinstance(node, dict):
            return {k: walk(v, k) for k, v in node.items()}
        if isinstance(node, list):
            return [walk(v, name) for v in node]
        if isinstance(node, QWeight):
            return jax.tree.map(jnp.asarray, node)
        return jnp.asarray(node, dtype=jnp.float32 if name in keep_f32 else dtype)

    return walk(tree)


def tree_bytes(tree) -> int:
    """Bytes the weights take (QWeight: integers plus scales)."""
    return int(sum(np.prod(a.shape) * a.dtype.itemsize for a in jax.tree.leaves(tree)))
