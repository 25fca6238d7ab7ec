"""Quantized weights: int8 and int4 with a scale per output channel and group of
inputs, fp8 (e4m3) with a scale per output channel, and int8 per output channel for
int8 x int8 matmuls.

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
- fp8: `q` float8_e4m3fn, w's shape; one scale per output channel (the whole axis
  is one group), scale = amax / 448 (e4m3's largest finite value).
- w8a8: int8 as above with one scale per output channel (the whole axis one group),
  for the int8 x int8 -> int32 matmul: per-input-group scales would split the dot
  into one per group, which measured slower here than float32 (docs/decisions/0013).
- `scale` (and int4's `offset`): float32, w's shape with the contracted axis IN / group;
  float16 where a GGUF file's blocks are kept as they are (engine/gguf.py).

`compute` (static) says how a matmul uses the weight:
- "dequant": convert and scale inside the jitted step, then the float matmul (XLA
  fuses the first two into one loop over the weight);
- "int8" (w8a8 weights only): each activation row is quantized to int8 inside the
  step (symmetric, its own amax / 127), `dot_general` accumulates in int32, and the
  result is scaled by the row's scale times the channel's;
- "kernel" (int8 and int4 weights, float32 rows, CPU): the FFI matrix-vector kernel
  of engine/kernels reads the groups, four rows a pass over them. A dense weight
  (axis 0) is packed for it in tiles of 16 output columns, each tile's bytes
  contiguous: q [OUT/16, IN (/2), 16], scale and offset [OUT/16, IN/G, 16] (OUT
  padded with zeros; `n` keeps OUT); an embedding (axis 1) is read as it is.
- "kernel8": the kernel with each row rounded to int8 per group of inputs and
  integer dot products, for int4 dense weights (the rest as "kernel"; the same
  packed arrays): the activations' rounding of w8a8, half the kernel's vector
  instructions per weight (docs/decisions/0064).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from engine.forms import KERNEL_FORMS

MODES = ("none", "int8", "int4", "fp8", "gguf")  # gguf: a GGUF file's own blocks (model.py)
GROUPS = {8: (128, 64, 32), 4: (32, 16, 8)}  # preferred group sizes, largest first
FP8_MAX = 448.0  # largest finite float8_e4m3fn


@dataclasses.dataclass(frozen=True)
class QWeight:
    q: Any  # int8 or float8_e4m3fn [w's shape], or uint8 [w's shape, contracted axis / 2]
    scale: Any  # float32 (float16: kept GGUF blocks) [w's shape, contracted axis / group]
    offset: Any  # int4: float32, scale's shape (each group's minimum); else None
    axis: int  # the contracted axis of the float weight (static)
    bits: int  # 8 or 4 (static)
    group: int  # inputs per scale (static)
    compute: str = "dequant"  # "dequant" | "int8" | "kernel" | "kernel8" (static; module docstring)
    n: int = 0  # "kernel", axis 0: output columns (q, scale, offset packed by `with_compute`)


jax.tree_util.register_dataclass(
    QWeight, data_fields=["q", "scale", "offset"],
    meta_fields=["axis", "bits", "group", "compute", "n"],
)  # fmt: skip


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


def quantize(w: np.ndarray, mode: str, axis: int, group: int = 0) -> QWeight:
    """Float weight -> QWeight contracted over `axis` (host numpy, done once at load).
    `mode`: int8 | int4 | fp8 | w8a8 (int8 per output channel, for int8 matmuls);
    `group` (int8, int4): inputs per scale instead of the preferred size."""
    bits = {"int8": 8, "int4": 4, "fp8": 8, "w8a8": 8}.get(mode)
    if bits is None:
        raise ValueError(f"cannot quantize to {mode!r}")
    w = np.asarray(w, np.float32)
    n = w.shape[axis]
    if mode == "fp8":
        amax = np.maximum(np.abs(w).max(axis=axis, keepdims=True), 1e-30)  # [..., 1, ...]
        scale = (amax / FP8_MAX).astype(np.float32)
        q = (w / scale).astype(jnp.float8_e4m3fn)  # round to nearest even, as XLA does
        return QWeight(q, scale, None, axis, bits, n)
    g = n if mode == "w8a8" else group or group_size(n, bits)
    if n % g:
        raise ValueError(f"groups of {g} do not divide the contracted size {n}")
    x = np.moveaxis(w, axis, -1)  # [..., IN]
    x = x.reshape(x.shape[:-1] + (n // g, g))  # [..., IN/G, G]
    back = lambda a: np.moveaxis(a[..., 0], -1, axis).astype(np.float32)  # noqa: E731
    if bits == 8:
        scale = np.maximum(np.abs(x).max(axis=-1, keepdims=True), 1e-30) / 127.0  # [..., IN/G, 1]
        q = np.clip(np.rint(x / scale), -127, 127).astype(np.int8).reshape(x.shape[:-2] + (n,))
        compute = "int8" if mode == "w8a8" else "dequant"
        return QWeight(np.moveaxis(q, -1, axis), back(scale), None, axis, bits, g, compute)
    lo = x.min(axis=-1, keepdims=True)  # [..., IN/G, 1]
    scale = np.maximum(x.max(axis=-1, keepdims=True) - lo, 1e-30) / 15.0
    u = np.clip(np.rint((x - lo) / scale), 0, 15).astype(np.uint8).reshape(x.shape[:-2] + (n,))
    q = u[..., 0::2] | (u[..., 1::2] << 4)  # [..., IN/2]
    return QWeight(np.moveaxis(q, -1, axis), back(scale), back(lo), axis, bits, g)


def transposed(w):
    """A 2-D host weight, float or `QWeight` (a file's blocks, engine/gguf.py), turned
    from the [out, in] a file stores to the [in, out] the model multiplies by."""
    if not isinstance(w, QWeight):
        return np.ascontiguousarray(np.asarray(w).T)
    t = lambda a: None if a is None else np.ascontiguousarray(a.T)  # noqa: E731
    return dataclasses.replace(w, q=t(w.q), scale=t(w.scale), offset=t(w.offset),
                               axis=1 - w.axis)  # fmt: skip


def concatenated(ws: list, axis: int):
    """Host weights side by side along `axis`, float or `QWeight`s of one kind
    contracted over the other axis (fused projections of a file's blocks)."""
    if not any(isinstance(w, QWeight) for w in ws):
        return np.concatenate(ws, axis=axis)
    if not all(isinstance(w, QWeight) for w in ws) or len({w.axis for w in ws}) > 1 \
            or ws[0].axis == axis:
        raise ValueError("fused weights must all be blocks, across the contracted axis")
    kinds = {(w.bits, w.group, w.offset is None, np.dtype(w.scale.dtype)) for w in ws}
    if len(kinds) > 1:  # e.g. a Q4_K file's Q6_K v_proj beside its Q4_K q and k
        ws = widened(ws)
    cat = lambda f: np.concatenate([getattr(w, f) for w in ws], axis=axis)  # noqa: E731
    return dataclasses.replace(ws[0], q=cat("q"), scale=cat("scale"),
                               offset=None if ws[0].offset is None else cat("offset"))


def widened(ws: list[QWeight]) -> list[QWeight]:
    """Host QWeights of different kinds -> the same numbers in one kind: int8 if any
    is (4-bit values are bytes 0-15), the smallest group (the larger groups' scales
    repeated), an offset if any has one (zero elsewhere), float32 scales if their
    dtypes differ. Exact: every value is q * scale + offset as before."""
    bits = 8 if any(w.bits == 8 for w in ws) else 4
    group = min(w.group for w in ws)
    offset = any(w.offset is not None for w in ws)
    dtype = ws[0].scale.dtype if len({np.dtype(w.scale.dtype) for w in ws}) == 1 else np.float32
    out = []
    for w in ws:
        q, ax = np.asarray(w.q), w.axis
        if w.bits == 4 and bits == 8:  # unpack along the contracted axis, even input low
            q = np.stack([q & 0xF, q >> 4], axis=ax + 1)
            shape = list(w.q.shape)
            shape[ax] *= 2
            q = q.reshape(shape).astype(np.int8)
        if w.group % group:
            raise ValueError(f"groups of {group} do not divide groups of {w.group}")
        rep = lambda a: np.repeat(np.asarray(a), w.group // group, axis=ax).astype(dtype)  # noqa: E731
        scale = rep(w.scale)
        off = (rep(w.offset) if w.offset is not None else np.zeros_like(scale)) if offset else None
        out.append(QWeight(q, scale, off, ax, bits, group, w.compute, w.n))
    return out


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


def quantize_rows(x):
    """x: [N, K] float -> (int8 [N, K], float32 [N, 1]): each row symmetric over its
    own amax, x ~ q * scale."""
    xf = x.astype(jnp.float32)
    scale = jnp.maximum(jnp.abs(xf).max(axis=-1, keepdims=True), 1e-30) / 127.0
    return jnp.clip(jnp.round(xf / scale), -127, 127).astype(jnp.int8), scale


def _int8_dot(x, w: QWeight):
    """x: [N, K] float, w: w8a8 weight contracted over its axis K -> [N, OUT] float32"""
    xq, sx = quantize_rows(x)
    acc = jax.lax.dot_general(xq, w.q, (((1,), (w.axis,)), ((), ())),
                              preferred_element_type=jnp.int32)  # [N, OUT]  # fmt: skip
    sw = w.scale[0] if w.axis == 0 else w.scale[:, 0]  # [OUT]
    return acc.astype(jnp.float32) * sx * sw


def _kernel_dot(x, w: QWeight):
    from engine import kernels

    return kernels.matvec(x, w.q, w.scale, w.offset, w.axis, w.bits, w.group, w.n,
                          act8=w.compute == "kernel8")  # fmt: skip


KERNELS = KERNEL_FORMS  # the computes that call engine/kernels


def matmul(x, w: QWeight, precision=None):
    """x: [N, IN] @ w: [IN, OUT] (contracted over axis 0) -> [N, OUT] in x's dtype."""
    if w.compute in KERNELS:
        return _kernel_dot(x, w).astype(x.dtype)
    if w.compute == "int8":
        return _int8_dot(x, w).astype(x.dtype)
    return jnp.matmul(x, dequantize(w, x.dtype), precision=precision)


def unembed(h, w: QWeight, precision=None):
    """h: [N, E], w: [V, E] (contracted over axis 1) -> [N, V] float32"""
    if w.compute in KERNELS:
        return _kernel_dot(h, w)
    if w.compute == "int8":
        return _int8_dot(h, w)
    return jnp.einsum("ne,ve->nv", h, dequantize(w, h.dtype),
                      preferred_element_type=jnp.float32, precision=precision)  # fmt: skip


def take_rows(w, ids, dtype=None):
    """Embedding lookup: w: [V, E] (float or QWeight over axis 1), ids: [...] -> [..., E]"""
    if not isinstance(w, QWeight):
        return w[ids]
    offset = None if w.offset is None else w.offset[ids]
    rows = QWeight(w.q[ids], w.scale[ids], offset, w.axis + ids.ndim - 1, w.bits, w.group,
                   w.compute)  # fmt: skip
    return dequantize(rows, dtype or jnp.float32)


def quantize_tree(tree: dict, mode: str | dict[str, tuple[str, int]], axes: dict[str, int]) -> dict:
    """Quantize the leaves named in `axes` (name -> contracted axis), at any depth.
    `mode`: one for every such leaf, or per name (name -> (mode, group); names left
    out stay float)."""
    if mode == "none":
        return tree
    modes = mode if isinstance(mode, dict) else {k: (mode, 0) for k in axes}

    def walk(node):
        if isinstance(node, dict):
            return {k: quantize(v, modes[k][0], axes[k], modes[k][1])
                    if k in modes and k in axes and not isinstance(v, QWeight)  # kept blocks
                    else walk(v) for k, v in node.items()}  # fmt: skip
        if isinstance(node, list):
            return [walk(v) for v in node]
        return node

    return walk(tree)


TILE = 16  # output columns per tile of a dense weight packed for the kernel


def _tiles(a, n: int):
    """[R, N] -> [ceil(N / 16), R, 16], the columns past N zero. In numpy: the kernel
    runs on the CPU, where the arrays are host memory already, and three eager jnp
    ops per weight cost about a second of every start for SmolLM2."""
    a = np.pad(np.asarray(a), ((0, 0), (0, -n % TILE)))
    return jnp.asarray(np.ascontiguousarray(a.reshape(a.shape[0], -1, TILE).transpose(1, 0, 2)))


def with_compute(tree, compute: str):
    """The tree with every int8 and int4 QWeight's `compute` set to `compute` (fp8
    weights keep theirs); "kernel" packs the dense ones (see the module docstring;
    the embeddings' arrays are shared)."""
    def one(w):
        if not isinstance(w, QWeight) or w.q.dtype not in (jnp.int8, jnp.uint8):
            return w
        if compute not in KERNELS or w.axis != 0 or w.q.ndim != 2:
            return dataclasses.replace(w, compute=compute)  # kernel8 from kernel: shared
        n = w.q.shape[1]
        offset = None if w.offset is None else _tiles(w.offset, n)
        return QWeight(_tiles(w.q, n), _tiles(w.scale, n), offset, 0, w.bits, w.group,
                       compute, n)  # fmt: skip

    return jax.tree.map(one, tree, is_leaf=is_qweight)


def dequantize_tree(tree, dtype):
    """Every QWeight of a device tree -> its float weight in `dtype` (the float form:
    the same numbers as the quantized weights, at float size)."""
    return jax.tree.map(lambda n: dequantize(n, dtype) if isinstance(n, QWeight) else n,
                        tree, is_leaf=is_qweight)


def float_bytes(tree, dtype) -> int:
    """Bytes `tree`'s weights take as floats in `dtype` (QWeights at their float
    shape; other leaves as they are)."""
    size = np.dtype(dtype).itemsize

    def nbytes(n) -> int:
        if not isinstance(n, QWeight):
            return int(np.prod(n.shape)) * n.dtype.itemsize
        shape = list(n.q.shape)
        shape[n.axis] *= 8 // n.bits if n.q.dtype == np.uint8 else 1  # int4: two a byte
        return int(np.prod(shape)) * size

    return sum(nbytes(n) for n in jax.tree.leaves(tree, is_leaf=is_qweight))


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
