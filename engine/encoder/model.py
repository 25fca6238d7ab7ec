"""The encoder's math: pure JAX functions over the parameter pytree
(engine/encoder/params.py).

`forward` = embeddings -> L x (fused-QKV attention, GELU MLP, post-LayerNorm) ->
the model's own sentence-transformers head (engine/encoder/spec.py): pooling over
the mask (CLS, mean, max, mean/sqrt(len), weighted mean, last token, concatenated in
sentence-transformers' order), its Dense layers, and L2 normalisation when it has a
Normalize module. `score_forward` is a cross-encoder's: the same transformer over a
text pair, then its sequence-classification head. BERT and RoBERTa / XLM-RoBERTa
differ only in where positions start (engine/encoder/config.py); ModernBERT's
transformer and classifier are its own (engine/encoder/modernbert.py), the
sentence-transformers head is shared. Matmuls run in the
model dtype; LayerNorm, softmax, pooling and the head in float32.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

from engine.encoder import modernbert
from engine.encoder.config import BertConfig, relative_buckets
from engine.encoder.ops import gelu, layer_norm, mm
from engine.encoder.params import Params
from engine.quant import take_rows


# Shapes: B batch, S seq, D hidden, H heads, K head dim.


def _attention(qkv, bias, heads: int, tp: int = 1):
    """qkv: [B, S, 3D]; bias: [B, 1, 1, S] float32 (0 or a large negative), or [B, H, S, S]
    with a relative position bias added (MPNet) -> [B, S, D].

    One explicit transpose to head-major [3, B, H, S, K] up front: XLA's CPU batched
    dot then runs on contiguous [S, K] tiles; letting einsum pick the layout from
    [B, S, H, K] measured 15-20% slower end to end at S >= 128 (no change at S=16).
    Split over `tp` devices, qkv's columns are shard-major: [B, S, TP, 3, H/TP, K]."""
    b, s, three_d = qkv.shape
    d = three_d // 3
    k_dim = d // heads
    if tp == 1:
        qkv = qkv.reshape(b, s, 3, heads, k_dim).transpose(2, 0, 3, 1, 4)  # [3, B, H, S, K]
    else:
        qkv = qkv.reshape(b, s, tp, 3, heads // tp, k_dim).transpose(3, 0, 2, 4, 1, 5)
        qkv = qkv.reshape(3, b, heads, s, k_dim)  # [3, B, H, S, K], head order kept
    q, k, v = qkv[0], qkv[1], qkv[2]  # each [B, H, S, K]
    q = q * jnp.asarray(1.0 / np.sqrt(k_dim), q.dtype)  # scale the small operand
    scores = jnp.einsum("bhqk,bhsk->bhqs", q, k, preferred_element_type=jnp.float32)
    probs = jax.nn.softmax(scores + bias, axis=-1).astype(v.dtype)  # [B, H, S, S]
    ctx = jnp.einsum("bhqs,bhsk->bhqk", probs, v)  # [B, H, S, K]
    return ctx.transpose(0, 2, 1, 3).reshape(b, s, d)  # [B, S, D]


def _layer(x, bias, p: Params, cfg: BertConfig, tp: int = 1):
    """x: [B, S, D] -> [B, S, D]: post-LN BERT block."""
    qkv = mm(x, p["qkv_w"]) + p["qkv_b"]  # [B, S, 3D]
    attn = mm(_attention(qkv, bias, cfg.heads, tp), p["o_w"]) + p["o_b"]  # [B, S, D]
    x = layer_norm(attn + x, p["ln1_g"], p["ln1_b"], cfg.eps)
    h = gelu(mm(x, p["i_w"]) + p["i_b"], cfg.act)  # [B, S, F]
    y = mm(h, p["f_w"]) + p["f_b"]  # [B, S, D]
    return layer_norm(y + x, p["ln2_g"], p["ln2_b"], cfg.eps)


def _pool(x32, m, mode: str):
    """x32: [B, S, D] float32, m: [B, S] float32 0/1 (right padding) -> [B, D],
    as sentence-transformers' Pooling computes `mode`."""
    if mode == "cls":
        return x32[:, 0]  # right padding: the first token is always real
    if mode == "lasttoken":
        last = jnp.maximum(jnp.sum(m, axis=1).astype(jnp.int32) - 1, 0)  # [B]
        return jnp.take_along_axis(x32, last[:, None, None], axis=1)[:, 0]
    if mode == "max":
        return jnp.max(jnp.where(m[:, :, None] > 0, x32, -jnp.inf), axis=1)
    if mode == "weightedmean":
        m = m * jnp.arange(1, m.shape[1] + 1, dtype=jnp.float32)[None, :]  # weight i + 1
    summed = jnp.einsum("bsd,bs->bd", x32, m)  # [B, D]
    count = jnp.maximum(jnp.sum(m, axis=1, keepdims=True), 1e-9)  # [B, 1]
    return summed / (jnp.sqrt(count) if mode == "mean_sqrt_len_tokens" else count)


_HEAD_ACTS = {
    "identity": lambda x: x, "tanh": jnp.tanh, "relu": jax.nn.relu,
    "gelu": lambda x: jax.nn.gelu(x, approximate=False), "sigmoid": jax.nn.sigmoid,
    "silu": jax.nn.silu,
}  # fmt: skip


_erf = np.vectorize(math.erf, otypes=[np.float64])
_HOST_ACTS: dict[str, Callable[[np.ndarray], np.ndarray]] = {
    "identity": lambda x: x, "tanh": np.tanh, "relu": lambda x: np.maximum(x, 0.0),
    "gelu": lambda x: 0.5 * x * (1.0 + _erf(x / np.sqrt(2.0))),
    "sigmoid": lambda x: _sigmoid(x), "silu": lambda x: x * _sigmoid(x),
}  # fmt: skip


def _sigmoid(x: np.ndarray) -> np.ndarray:
    """1 / (1 + e^-x) without overflow, and to full precision near 0 and 1."""
    e = np.exp(-np.abs(x))
    return np.where(x >= 0, 1.0 / (1.0 + e), e / (1.0 + e))


def activate(logits: np.ndarray, cfg: BertConfig) -> np.ndarray:
    """A cross-encoder's logits [N, L] -> its scores: the model's activation
    (CrossEncoder.predict's), on the host in float64, as float32."""
    return _HOST_ACTS[cfg.spec.score_activation](logits.astype(np.float64)).astype(np.float32)


def head(params: Params, x32, m, cfg: BertConfig):
    """x32: [B, S, D] float32 token states -> [B, dim] float32: the model's pooling,
    Dense layers and (when it has one) Normalize."""
    y = jnp.concatenate([_pool(x32, m, mode) for mode in cfg.spec.pooling], axis=-1)  # [B, P]
    return _project(params, y, cfg)


def _project(params: Params, y, cfg: BertConfig):
    """Pooled [N, P] float32 -> [N, dim]: the Dense layers, then Normalize if any."""
    spec = cfg.spec
    for layer, p in zip(spec.dense, params["head"]):
        out = _HEAD_ACTS[layer.activation](y @ p["head_w"] + p["head_b"])  # [B, OUT]
        y = out + y @ p["head_r"] if "head_r" in p else out
    if spec.normalize:
        norm = jnp.sqrt(jnp.sum(jnp.square(y), axis=1, keepdims=True))  # [B, 1]
        y = y / jnp.maximum(norm, 1e-12)
    return y


def encode(params: Params, ids, mask, cfg: BertConfig, tp: int = 1, types=None):
    """ids, mask (and a pair's token types): [B, S] int32 -> (token states [B, S, D]
    in the model dtype, mask [B, S] float32). `tp`: devices the heads are split over
    (the layout of the fused QKV columns)."""
    if cfg.family == "modernbert":  # pre-norm, rotary, local attention, GeGLU
        return modernbert.encode(params, ids, mask, cfg)
    s = ids.shape[1]
    word, pos = params["word"], params["pos"]  # pos: [P, D] in the model dtype
    x = take_rows(word, ids, jnp.float32).astype(jnp.float32) + pos[:s].astype(jnp.float32)
    if types is not None:  # type 0 is already in `pos`; the table holds the differences
        x = x + params["types"][types].astype(jnp.float32)
    x = layer_norm(x, params["emb_ln_g"], params["emb_ln_b"], cfg.eps).astype(pos.dtype)
    m = mask.astype(jnp.float32)  # [B, S]
    # Padding keys get a large negative logit (not -inf: an all-padding row of a
    # padded batch must stay finite, its output is discarded anyway).
    bias = ((m - 1.0) * 1e9)[:, None, None, :]  # [B, 1, 1, S]
    if "rel_bias" in params:  # MPNet: the same relative position bias in every layer
        buckets = relative_buckets(s)  # [S, S], static: S is the bucket's length
        rel = params["rel_bias"][buckets].transpose(2, 0, 1)  # [H, S, S]
        bias = bias + rel[None]  # [B, H, S, S]
    for p in params["layers"]:
        x = _layer(x, bias, p, cfg, tp)
    return x, m


def _pool_packed(xf, slot, pos, n: int, mode: str):
    """xf: [T, D] float32 token states of a packed program, slot: [T] int32 output row
    of each token (n for padding), pos: [T] its position in its input -> [n, D], as
    `_pool` computes `mode` for each input alone."""
    seg = lambda v: jax.ops.segment_sum(v, slot, n + 1)[:n]  # noqa: E731 - [n, ...]
    at = jnp.arange(slot.shape[0], dtype=jnp.int32)  # [T]
    if mode in ("cls", "lasttoken"):
        pick = jax.ops.segment_min if mode == "cls" else jax.ops.segment_max
        idx = jnp.clip(pick(at, slot, n + 1)[:n], 0, slot.shape[0] - 1)  # [n]
        return xf[idx]
    if mode == "max":
        top = jax.ops.segment_max(xf, slot, n + 1)[:n]
        return jnp.where(jnp.isfinite(top), top, 0.0)  # empty slots: discarded, finite
    w = (pos + 1).astype(jnp.float32) if mode == "weightedmean" else jnp.ones_like(pos, jnp.float32)
    count = jnp.maximum(seg(w)[:, None], 1e-9)  # [n, 1]
    return seg(xf * w[:, None]) / (jnp.sqrt(count) if mode == "mean_sqrt_len_tokens" else count)


def encode_packed(params: Params, ids, slot, pos, cfg: BertConfig, tp: int = 1, types=None):
    """A packed program (engine/encoder/packing.py): ids, slot, pos (and a pair's
    token types): [R, W] int32 -> token states [R, W, D] in the model dtype. A token
    attends to the tokens of its own slot only, so each input is computed as alone;
    positions restart at each input. MPNet's relative bias is the row's: inside one
    input a key's distance in the row is its distance in the input."""
    word, table = params["word"], params["pos"]
    x = take_rows(word, ids, jnp.float32).astype(jnp.float32) + table[pos].astype(jnp.float32)
    if types is not None:
        x = x + params["types"][types].astype(jnp.float32)
    x = layer_norm(x, params["emb_ln_g"], params["emb_ln_b"], cfg.eps).astype(table.dtype)
    same = slot[:, :, None] == slot[:, None, :]  # [R, W, W]
    bias = jnp.where(same, 0.0, -1e9).astype(jnp.float32)[:, None]  # [R, 1, W, W]
    if "rel_bias" in params:
        buckets = relative_buckets(ids.shape[1])  # [W, W], static
        bias = bias + params["rel_bias"][buckets].transpose(2, 0, 1)[None]  # [R, H, W, W]
    for p in params["layers"]:
        x = _layer(x, bias, p, cfg, tp)
    return x


def forward_packed(params: Params, ids, slot, pos, cfg: BertConfig, tp: int = 1, *, slots: int):
    """A packed program -> [slots, dim] float32: output row k is the input of slot k
    (rows past the program's inputs are discarded by the caller)."""
    x = encode_packed(params, ids, slot, pos, cfg, tp)
    xf = x.astype(jnp.float32).reshape(-1, x.shape[-1])  # [T, D]
    sf, pf = slot.reshape(-1), pos.reshape(-1)
    y = jnp.concatenate([_pool_packed(xf, sf, pf, slots, m) for m in cfg.spec.pooling], axis=-1)
    return _project(params, y, cfg)  # [slots, dim]


def score_packed(params: Params, ids, slot, pos, types, cfg: BertConfig, tp: int = 1, *,
                 slots: int):
    """A cross-encoder's packed program -> [slots, L] float32 logits (`score_forward`
    on each pair's first token)."""
    x = encode_packed(params, ids, slot, pos, cfg, tp, types)
    xf = x.astype(jnp.float32).reshape(-1, x.shape[-1])  # [T, D]
    return _classify(params, _pool_packed(xf, slot.reshape(-1), pos.reshape(-1), slots, "cls"),
                     cfg)


def _classify(params: Params, cls, cfg: BertConfig):
    """First-token states [N, D] float32 -> [N, L] logits: BERT's pooler (dense, tanh;
    RoBERTa's classifier head has the same shape), then the classifier. The model's
    activation is the host's (`activate`): one program gives raw and activated scores."""
    c = params["classifier"]
    h = jnp.tanh(cls @ c["cls_w"] + c["cls_b"])  # [N, D]
    return h @ c["out_w"] + c["out_b"]  # [N, L]


def forward(params: Params, ids, mask, cfg: BertConfig, tp: int = 1):
    """ids, mask: [B, S] int32 -> [B, dim] float32 sentence embeddings (`head`)."""
    x, m = encode(params, ids, mask, cfg, tp)
    return head(params, x.astype(jnp.float32), m, cfg)  # [B, dim]


def score_forward(params: Params, ids, mask, types, cfg: BertConfig, tp: int = 1):
    """A cross-encoder: ids, mask, token types of text pairs: [B, S] int32 -> [B, L]
    float32 logits. CLS state -> dense, tanh (BERT's pooler; RoBERTa's classifier
    head has the same shape) -> L logits; `activate` applies the model's activation."""
    x, m = encode(params, ids, mask, cfg, tp, types)
    if cfg.family == "modernbert":  # no token types; its own head
        return modernbert.classify(params, x.astype(jnp.float32), m, cfg)  # [B, L]
    return _classify(params, x[:, 0].astype(jnp.float32), cfg)  # [B, L]


def decoder_forward(params: Params, ids, mask, cfg: BertConfig):
    """A decoder-based embedder: ids, mask [B, S] int32 (right padding: a causal
    model's true tokens never see it) -> [B, dim] float32, the decoder's last hidden
    states after its final norm, pooled and normalised as `head` says."""
    from engine.decoder.layers import rms_norm
    from engine.decoder.model import forward_prompt

    dec, dcfg = params["decoder"], cfg.decoder
    x = jax.vmap(lambda t, m: forward_prompt(dec, dcfg, t, m.sum())[0])(ids, mask)  # [B, S, E]
    x = rms_norm(x, dec["norm_w"], dcfg.norm_eps)
    return head(params, x.astype(jnp.float32), mask.astype(jnp.float32), cfg)
