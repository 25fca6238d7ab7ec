"""A GGUF tensor's blocks as the `engine.quant.QWeight` the CPU kernel reads, holding
the same numbers: w = q * scale (+ offset) per group of inputs, computed in float32,
is the gguf package's `dequantize` bit for bit (tests/engine/test_gguf_blocks.py).

Each block type is an integer grid with a scale (and a minimum) per group, so it maps
onto the kernel's two integer widths without rounding anything:

| type | values | q kept as | group | scale, offset |
|---|---|---|---|---|
| Q8_0 | int8 | int8 | 32 | d (float16) |
| Q4_0 | 0..15 | 4 bits | 32 | d, -8 d (float16) |
| Q4_1 | 0..15 | 4 bits | 32 | d, m (float16) |
| Q5_0 | -16..15 | int8 | 32 | d (float16) |
| Q5_1 | 0..31 | int8 | 32 | d, m (float16) |
| Q4_K | 0..15 | 4 bits | 32 | d sc, -dmin m (float32) |
| Q5_K | 0..31 | int8 | 32 | d sc, -dmin m (float32) |
| Q6_K | -32..31 | int8 | 16 | d sc (float32) |

The K-quants' super-block scale times a sub-block's 6-bit (Q6_K: 8-bit) scale is not
a float16 number, so their scales are kept as the float32 products the gguf package
computes: 6 bits a weight for Q4_K (the file: 4.5), 10 for Q6_K (the file: 6.6), a
quarter of float32's. Five-bit values take a byte each: the kernel reads 4 or 8 bits.
Any other type (Q2_K, Q3_K, the IQ types) has no such form: `kept_blocks` gives None
and `BLOCK_TYPES` leaves it out.
"""

from __future__ import annotations

import numpy as np

from engine.quant import QWeight

# GGUF type name -> (the quantization mode whose layout holds its values, group): what
# engine/decoder/model.py requantizes to where blocks cannot be kept (several devices).
BLOCK_TYPES = {
    "Q8_0": ("int8", 32), "Q4_0": ("int4", 32), "Q4_1": ("int4", 32),
    "Q5_0": ("int8", 32), "Q5_1": ("int8", 32),
    "Q4_K": ("int4", 32), "Q5_K": ("int8", 32), "Q6_K": ("int8", 16),
}  # fmt: skip
QK_K = 256  # values per K-quant super-block


def _f16(a: np.ndarray) -> np.ndarray:
    """Bytes [..., 2] -> float16 [...]."""
    return np.ascontiguousarray(a).view(np.float16)[..., 0]


def _nibbles(qs: np.ndarray) -> np.ndarray:
    """[blocks, 16] bytes of a 32-value block -> [blocks, 32]: the low nibbles are
    values 0-15, the high ones 16-31."""
    return np.concatenate([qs & np.uint8(0x0F), qs >> np.uint8(4)], axis=1)


def _high_bits(qh: np.ndarray) -> np.ndarray:
    """[blocks, 4] bytes (a little-endian uint32) -> [blocks, 32] bit i of it."""
    bits = np.ascontiguousarray(qh).view(np.uint32)  # [blocks, 1]
    return ((bits >> np.arange(32, dtype=np.uint32)) & np.uint32(1)).astype(np.uint8)


def _k_scales(scales: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """[blocks, 12] packed 6-bit scales and minimums of Q4_K / Q5_K -> two [blocks, 8]
    (the gguf package's `Q4_K.get_scale_min`)."""
    s = scales.reshape(-1, 3, 4)
    d, m, md = s[:, 0], s[:, 1], s[:, 2]
    sc = np.concatenate([d & 0x3F, (md & 0x0F) | ((d >> 2) & 0x30)], axis=-1)
    mn = np.concatenate([m & 0x3F, (md >> 4) | ((m >> 2) & 0x30)], axis=-1)
    return sc, mn


def _values(b: np.ndarray, kind: str):
    """[blocks, bytes] of one type -> (values [blocks, block values] int, scale
    [blocks, groups], offset [blocks, groups] or None, group)."""
    if kind == "Q8_0":
        return b[:, 2:].view(np.int8), _f16(b[:, 0:2])[:, None], None, 32
    if kind in ("Q4_0", "Q4_1"):
        d = _f16(b[:, 0:2])[:, None]
        if kind == "Q4_1":
            return _nibbles(b[:, 4:]), d, _f16(b[:, 2:4])[:, None], 32
        return _nibbles(b[:, 2:]), d, d * np.float16(-8), 32  # times 8: exact in float16
    if kind in ("Q5_0", "Q5_1"):
        d = _f16(b[:, 0:2])[:, None]
        at = 4 if kind == "Q5_1" else 2
        v = (_nibbles(b[:, at + 4:]) | (_high_bits(b[:, at:at + 4]) << np.uint8(4))).astype(np.int8)
        if kind == "Q5_1":
            return v, d, _f16(b[:, 2:4])[:, None], 32
        return v - np.int8(16), d, None, 32
    if kind in ("Q4_K", "Q5_K"):
        d = _f16(b[:, 0:2]).astype(np.float32)[:, None]
        dmin = _f16(b[:, 2:4]).astype(np.float32)[:, None]
        sc, mn = _k_scales(b[:, 4:16])
        scale, offset = d * sc.astype(np.float32), -(dmin * mn.astype(np.float32))  # [blocks, 8]
        qs = b[:, 48:] if kind == "Q5_K" else b[:, 16:]  # 128 bytes: 4 chunks of 32
        low = (qs.reshape(-1, 4, 1, 32) >> np.array([0, 4], np.uint8).reshape(1, 1, 2, 1))
        v = (low & np.uint8(0x0F)).reshape(-1, QK_K)
        if kind == "Q5_K":
            qh = b[:, 16:48].reshape(-1, 1, 32) >> np.arange(8, dtype=np.uint8).reshape(1, 8, 1)
            v = (v | ((qh & np.uint8(1)).reshape(-1, QK_K) << np.uint8(4))).astype(np.int8)
        return v, scale, offset, 32
    if kind == "Q6_K":
        ql, qh = b[:, :128], b[:, 128:192]
        scales = b[:, 192:208].view(np.int8).astype(np.float32)  # [blocks, 16]
        d = _f16(b[:, 208:210]).astype(np.float32)[:, None]
        low = (ql.reshape(-1, 2, 1, 64) >> np.array([0, 4], np.uint8).reshape(1, 1, 2, 1))
        low = (low & np.uint8(0x0F)).reshape(-1, 8, 32)
        high = (qh.reshape(-1, 2, 1, 32) >> np.array([0, 2, 4, 6], np.uint8).reshape(1, 1, 4, 1))
        high = (high & np.uint8(0x03)).reshape(-1, 8, 32)
        v = (low | (high << np.uint8(4))).astype(np.int8) - np.int8(32)
        return v.reshape(-1, QK_K), d * scales, None, 16
    return None


def block_floats(data: np.ndarray, kind: str) -> np.ndarray | None:
    """A tensor's stored bytes of GGUF type `kind` -> its float32 values, the gguf
    package's `dequantize` bit for bit, over the whole tensor at once (the package
    works 16 rows at a time); None for a type `BLOCK_TYPES` leaves out."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    if kind not in BLOCK_TYPES:
        return None
    block, size = GGML_QUANT_SIZES[GGMLQuantizationType[kind]]
    shape = (*data.shape[:-1], data.shape[-1] // size * block)
    b = np.ascontiguousarray(data).view(np.uint8).reshape(-1, size)  # [blocks, bytes]
    found = _values(b, kind)
    assert found is not None  # every type of BLOCK_TYPES has its values
    v, scale, offset, group = found
    g = v.reshape(len(b), -1, group).astype(np.float32)  # [blocks, groups, G]
    if kind == "Q4_0":  # (q - 8) * d, as the package: q * d - 8 d gives +0 where it has -0
        g, offset = g - 8, None
    w = g * scale.astype(np.float32)[..., None]
    if offset is not None:
        w = w + offset.astype(np.float32)[..., None]
    return w.reshape(shape)


def kept_blocks(data: np.ndarray, kind: str) -> QWeight | None:
    """A tensor's stored bytes ([rows..., bytes per row], the file's [out, in] order)
    of GGUF type `kind` (its name: "Q4_K") -> the QWeight contracted over its last
    axis holding the same numbers (the table above); None for a type it cannot hold."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    if kind not in BLOCK_TYPES:
        return None
    block, size = GGML_QUANT_SIZES[GGMLQuantizationType[kind]]
    rows, n = data.shape[:-1], data.shape[-1] // size * block
    b = np.ascontiguousarray(data).view(np.uint8).reshape(-1, size)  # [blocks, bytes]
    found = _values(b, kind)
    assert found is not None  # every type of BLOCK_TYPES has its values
    v, scale, offset, group = found
    scale = scale.reshape(*rows, n // group)
    offset = None if offset is None else offset.reshape(scale.shape)
    mode = BLOCK_TYPES[kind][0]
    if mode == "int8":
        return QWeight(v.astype(np.int8).reshape(*rows, n), scale, offset, len(rows), 8, group)
    u = v.astype(np.uint8).reshape(-1, n)
    q = (u[:, 0::2] | (u[:, 1::2] << np.uint8(4))).reshape(*rows, n // 2)  # even input low
    return QWeight(q, scale, offset, len(rows), 4, group)
