"""AWQ and GPTQ checkpoints: weights stored as integers packed into int32 words, with
a scale and a zero point per group of inputs and output column. Read here into the
float32 weights they stand for, w = (q - zero) * scale, exactly (the integers and the
float16 scales give float32 products without rounding), so everything downstream
(both decoder engines, `TENSORBUS_QUANT`, the compute forms, the prepared-weights
cache) sees the float weights a float checkpoint would have given
(docs/decisions/0091-awq-gptq-checkpoints.md).

The two layouts, for a linear layer of IN inputs and OUT outputs, groups of G inputs
(`group_size`; -1: the whole input), B bits (32 / B values a word):

- AWQ (AutoAWQ's `version: "gemm"`): `qweight` [IN, OUT / (32 / B)] packed along the
  outputs, `qzeros` [IN / G, OUT / (32 / B)] the same way, `scales` [IN / G, OUT]. A
  word's values sit in AWQ's interleaved order: its k-th B bits hold output column
  `AWQ_ORDER[k]` of its 8.
- GPTQ (AutoGPTQ / GPTQModel): `qweight` [IN / (32 / B), OUT] packed along the
  inputs, `qzeros` [groups, OUT / (32 / B)] along the outputs, both in plain order;
  `scales` [groups, OUT]; `g_idx` [IN] each input's group (act-order checkpoints
  permute it; without it, input i is in group i / G). `checkpoint_format: "gptq"`
  (v1, the default) stores each zero point minus one; `"gptq_v2"` stores it as is.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import numpy as np

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # word position -> output column of its 8 (4 bits)
PACKED = ("qweight", "qzeros", "scales", "g_idx")  # a packed linear layer's tensors


def unpack(words: np.ndarray, bits: int, axis: int) -> np.ndarray:
    """int32 words -> their `32 / bits` unsigned values each, low bits first, laid
    out along `axis` (each word's values side by side where the word stood)."""
    import numpy as np

    per = 32 // bits
    u = words.astype(np.uint32)[..., None] >> (np.arange(per, dtype=np.uint32) * bits)
    v = (u & np.uint32((1 << bits) - 1)).astype(np.int32)  # [..., per]
    v = np.moveaxis(v, -1, axis + 1) if axis == 0 else v
    shape = list(words.shape)
    shape[axis] *= per
    return v.reshape(shape)


def awq_weight(qweight, qzeros, scales, bits: int, group: int) -> np.ndarray:
    """AWQ's tensors -> the float32 [OUT, IN] weight."""
    import numpy as np

    per = 32 // bits
    order = np.argsort(AWQ_ORDER[:per]) if per == 8 else np.arange(per)
    fix = lambda a: a.reshape(a.shape[0], -1, per)[:, :, order].reshape(a.shape)  # noqa: E731
    q = fix(unpack(qweight, bits, 1))  # [IN, OUT]
    z = fix(unpack(qzeros, bits, 1))  # [IN / G, OUT]
    rows = np.arange(q.shape[0]) // (group if group > 0 else q.shape[0])
    w = (q - z[rows]).astype(np.float32) * np.asarray(scales, np.float32)[rows]
    return np.ascontiguousarray(w.T)


def gptq_weight(qweight, qzeros, scales, g_idx, bits: int, group: int,
                v2: bool) -> np.ndarray:  # fmt: skip
    """GPTQ's tensors -> the float32 [OUT, IN] weight."""
    import numpy as np

    q = unpack(qweight, bits, 0)  # [IN, OUT]
    z = unpack(qzeros, bits, 1) + (0 if v2 else 1)  # [groups, OUT]
    if g_idx is None:
        rows = np.arange(q.shape[0]) // (group if group > 0 else q.shape[0])
    else:
        rows = np.asarray(g_idx, np.int64)
    w = (q - z[rows]).astype(np.float32) * np.asarray(scales, np.float32)[rows]
    return np.ascontiguousarray(w.T)


def dequantize(weights: dict, method: str, bits: int, group: int, v2: bool = False) -> int:
    """A checkpoint's tensors, in place: every packed layer's `X.qweight`, `X.qzeros`,
    `X.scales` (and GPTQ's `X.g_idx`) replaced by the float32 `X.weight` -> how many
    layers. ValueError for a packed layer missing a part or of a shape that does not
    fit the config's bits and group size."""
    bases = sorted(n[: -len("qweight")] for n in weights if n.endswith(".qweight"))
    for base in bases:
        parts = {p: weights.pop(base + p, None) for p in PACKED}
        if parts["qzeros"] is None or parts["scales"] is None:
            raise ValueError(f"{base}qweight has no qzeros or scales beside it")
        try:
            if method == "awq":
                w = awq_weight(parts["qweight"], parts["qzeros"], parts["scales"], bits, group)
            else:
                w = gptq_weight(parts["qweight"], parts["qzeros"], parts["scales"],
                                parts["g_idx"], bits, group, v2)  # fmt: skip
        except (IndexError, ValueError) as exc:
            raise ValueError(f"{base}qweight does not fit {bits}-bit {method} groups of "
                             f"{group}: {exc}") from None
        weights[base + "weight"] = w
    return len(bases)
