"""Math both decoder families share: norms, activations, RoPE, causal attention.

Everything is a pure function of arrays. Activations stay in the parameter dtype;
norms, softmax and logits are computed in float32, as the reference implementation
does, so bfloat16/float16 runs drift no more than theirs.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from engine import quant
from engine.decoder.config import DecoderConfig

NEG_INF = -1e30  # finite, so a fully masked row (padding) gives a uniform softmax, not NaN


def precision(dtype):
    """float32 asks for full precision: accelerators otherwise default to TF32."""
    return jax.lax.Precision.HIGHEST if dtype == jnp.float32 else None


def dense(x, w, b=None):
    """x: [N, IN] @ w: [IN, OUT] (float, or a quant.QWeight) -> [N, OUT]"""
    if isinstance(w, quant.QWeight):
        y = quant.matmul(x, w, precision(x.dtype))
    else:
        y = jnp.matmul(x, w, precision=precision(x.dtype))
    return y if b is None else y + b


def unembed(h, w):
    """h: [N, E], w: [V, E] (embedding layout, no transpose copy) -> [N, V] float32"""
    if isinstance(w, quant.QWeight):
        return quant.unembed(h, w, precision(h.dtype))
    return jnp.einsum(
        "ne,ve->nv", h, w, preferred_element_type=jnp.float32, precision=precision(h.dtype)
    )


def layer_norm(x, w, b, eps: float):
    xf = x.astype(jnp.float32)
    mean = xf.mean(-1, keepdims=True)
    var = ((xf - mean) ** 2).mean(-1, keepdims=True)
    y = (xf - mean) * jax.lax.rsqrt(var + eps)
    return (y * w.astype(jnp.float32) + b.astype(jnp.float32)).astype(x.dtype)


def rms_norm(x, w, eps: float):
    xf = x.astype(jnp.float32)
    y = xf * jax.lax.rsqrt((xf * xf).mean(-1, keepdims=True) + eps)
    return w * y.astype(x.dtype)  # cast before the weight, as Llama's reference does


def activation(name: str, x):
    if name in ("gelu_new", "gelu_pytorch_tanh", "gelu_fast"):
        return jax.nn.gelu(x, approximate=True)
    if name == "gelu":
        return jax.nn.gelu(x, approximate=False)
    if name == "relu":
        return jax.nn.relu(x)
    if name in ("silu", "swish"):
        return jax.nn.silu(x)
    raise NotImplementedError(f"activation {name!r} is not supported")


# ----------------------------------------------------------------------- RoPE
def inv_frequencies(cfg: DecoderConfig, local: bool = False, long: bool = False) -> np.ndarray:
    """[R/2] float32 (R: the rotary dims), with the configured context-extension
    scaling applied (`local`: the sliding layers' own base and no scaling, where the
    model has them; `long`: longrope's long factors, for sequences past the
    pre-training length). Dynamic NTK is the default RoPE up to max_positions, the
    longest a sequence is served (engine/decoder/host.py)."""
    d = cfg.rotary_dim
    theta = cfg.local_rope_theta if local and cfg.local_rope_theta else cfg.rope_theta
    shape = np.arange(0, d, 2, dtype=np.float64) / d
    inv = 1.0 / (theta ** shape)
    kind = cfg.rope_scaling[0] if theta == cfg.rope_theta else "default"
    if kind == "linear":
        inv = inv / cfg.rope_scaling[1]
    elif kind == "llama3":
        factor, low, high, original = cfg.rope_scaling[1:]
        wavelen = 2 * math.pi / inv
        low_wl, high_wl = original / low, original / high
        smooth = (original / wavelen - low) / (high - low)
        mid = (1 - smooth) * inv / factor + smooth * inv
        inv = np.where(wavelen > low_wl, inv / factor, np.where(wavelen < high_wl, inv, mid))
    elif kind == "yarn":  # transformers' _compute_yarn_parameters
        factor, original, fast, slow, _, truncate = cfg.rope_scaling[1:]
        dim_of = lambda rot: d * math.log(original / (rot * 2 * math.pi)) / (2 * math.log(theta))  # noqa: E731
        lo, hi = dim_of(fast), dim_of(slow)
        if truncate:
            lo, hi = math.floor(lo), math.ceil(hi)
        lo, hi = max(lo, 0), min(hi, d - 1)
        hi = hi + 0.001 if lo == hi else hi
        ramp = np.clip((np.arange(d // 2, dtype=np.float64) - lo) / (hi - lo), 0, 1)
        inv = inv / factor * ramp + inv * (1 - ramp)
    elif kind == "longrope":
        factors = np.asarray(cfg.rope_scaling[2 if long else 1], np.float64)
        inv = 1.0 / (factors * theta ** shape)
    return inv.astype(np.float32)


def rope_scale(cfg: DecoderConfig, local: bool = False) -> float:
    """What cos and sin are multiplied by (YaRN's and longrope's attention factor)."""
    if local and cfg.local_rope_theta:
        return 1.0
    kind = cfg.rope_scaling[0]
    if kind == "yarn":
        return float(cfg.rope_scaling[5])
    if kind == "longrope":
        return float(cfg.rope_scaling[4])
    return 1.0


def rope(x, positions, inv_freq, scale: float = 1.0):
    """Rotate-half RoPE (the Hugging Face Llama convention, not interleaved pairs) on
    the first R = 2 * len(inv_freq) dims of each head; the rest pass (partial rotary).

    x: [N, H, D], positions: [N] int32, inv_freq: [R/2], or [N, R/2] (a row's own)
    -> [N, H, D]
    """
    angles = positions.astype(jnp.float32)[:, None] * inv_freq  # [N, R/2]
    emb = jnp.concatenate([angles, angles], -1)
    cos, sin = jnp.cos(emb), jnp.sin(emb)
    if scale != 1.0:
        cos, sin = cos * scale, sin * scale
    cos, sin = cos[:, None, :], sin[:, None, :]  # [N, 1, R]
    xf = x.astype(jnp.float32)
    r = emb.shape[-1]
    xr, half = xf[..., :r], r // 2
    rotated = jnp.concatenate([-xr[..., half:], xr[..., :half]], -1)
    out = xr * cos + rotated * sin
    if r < x.shape[-1]:
        out = jnp.concatenate([out, xf[..., r:]], -1)
    return out.astype(x.dtype)


# ------------------------------------------------------------------ attention
def _scaled(scores, cfg: DecoderConfig):
    """Raw q.k scores -> logits: the model's scale, then its soft cap (Gemma 2)."""
    scores = scores * cfg.scale
    if cfg.attn_softcap:
        scores = jnp.tanh(scores / cfg.attn_softcap) * cfg.attn_softcap
    return scores


def visible(keys, queries, window: int | None):
    """keys: [C] positions, queries: [T] positions -> [T, C] bool: a query sees the
    keys at or before it, and within its sliding window when it has one."""
    seen = keys[None, :] <= queries[:, None]
    if window is not None:
        seen &= keys[None, :] > queries[:, None] - window
    return seen


def causal_attention(q, k, v, cfg: DecoderConfig, window: int | None = None):
    """Attention within one prompt (prefill).

    q: [T, H, D], k, v: [T, KV, D] -> [T, H * D]
    """
    t = q.shape[0]
    qg = q.reshape(t, cfg.kv_heads, cfg.groups, cfg.head_dim)  # [T, KV, G, D]
    scores = jnp.einsum(
        "tkgd,skd->kgts", qg, k, preferred_element_type=jnp.float32, precision=precision(q.dtype)
    )
    scores = _scaled(scores, cfg)  # [KV, G, T, T]
    pos = jnp.arange(t)
    causal = visible(pos, pos, window)
    probs = jax.nn.softmax(jnp.where(causal, scores, NEG_INF), axis=-1).astype(v.dtype)
    out = jnp.einsum(
        "kgts,skd->tkgd", probs, v, preferred_element_type=jnp.float32, precision=precision(q.dtype)
    )
    return out.astype(q.dtype).reshape(t, cfg.heads * cfg.head_dim)


def cached_attention(q, k_cache, v_cache, positions, cfg: DecoderConfig,
                     window: int | None = None):
    """One new query per slot against that slot's cache (decode).

    q: [S, H, D], k_cache, v_cache: [S, KV, MAX_LEN, D], positions: [S] -> [S, H * D]
    Cache entries past a slot's position (stale or padding) are masked out.
    """
    s, max_len = q.shape[0], k_cache.shape[2]
    qg = q.reshape(s, cfg.kv_heads, cfg.groups, cfg.head_dim)  # [S, KV, G, D]
    scores = jnp.einsum(
        "skgd,sktd->skgt", qg, k_cache, preferred_element_type=jnp.float32,
        precision=precision(q.dtype),
    )  # fmt: skip
    scores = _scaled(scores, cfg)  # [S, KV, G, MAX_LEN]
    seen = visible(jnp.arange(max_len), positions, window)  # [S, MAX_LEN]
    scores = jnp.where(seen[:, None, None, :], scores, NEG_INF)
    probs = jax.nn.softmax(scores, axis=-1).astype(v_cache.dtype)
    out = jnp.einsum(
        "skgt,sktd->skgd", probs, v_cache, preferred_element_type=jnp.float32,
        precision=precision(q.dtype),
    )  # fmt: skip
    return out.astype(q.dtype).reshape(s, cfg.heads * cfg.head_dim)


def context_attention(q, k_ctx, v_ctx, positions, cfg: DecoderConfig,
                      window: int | None = None):
    """A chunk of one prompt against its sequence's cache, itself included (prefill).

    q: [T, H, D], k_ctx, v_ctx: [KV, C, D] (cache positions 0..C), positions: [T]
    -> [T, H * D]. Query t sees cache positions <= positions[t].
    """
    t, c = q.shape[0], k_ctx.shape[1]
    qg = q.reshape(t, cfg.kv_heads, cfg.groups, cfg.head_dim)  # [T, KV, G, D]
    # XLA's CPU runtime has no bfloat16 x bfloat16 -> float32 dot for the form this
    # takes after the gather (UNIMPLEMENTED at run time): half-precision chunks attend
    # in float32, which the reference's own float32 softmax is closer to anyway.
    dtype = q.dtype
    if dtype != jnp.float32:
        qg, k_ctx, v_ctx = (a.astype(jnp.float32) for a in (qg, k_ctx, v_ctx))
    k_ctx, v_ctx = k_ctx.swapaxes(0, 1), v_ctx.swapaxes(0, 1)  # [C, KV, D]
    scores = jnp.einsum(
        "tkgd,ckd->kgtc", qg, k_ctx, preferred_element_type=jnp.float32,
        precision=precision(q.dtype),
    )  # fmt: skip
    scores = _scaled(scores, cfg)  # [KV, G, T, C]
    seen = visible(jnp.arange(c), positions, window)  # [T, C]
    probs = jax.nn.softmax(jnp.where(seen, scores, NEG_INF), axis=-1)
    out = jnp.einsum(
        "kgtc,ckd->tkgd", probs, v_ctx, preferred_element_type=jnp.float32,
        precision=precision(q.dtype),
    )  # fmt: skip
    return out.astype(dtype).reshape(t, cfg.heads * cfg.head_dim)
