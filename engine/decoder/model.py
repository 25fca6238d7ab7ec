"""Forward passes shared by both families, over a per-family module of four parts.

A family module (gpt2, llama) provides `load_params`, `embed`, `attn_in` (norm, qkv,
positions), `attn_out` (output projection, MLP, residuals) and `head`. This module
owns the layer loop and where keys and values go:

- `forward_prompt`: a whole (padded) prompt, causal attention, returns its K/V.
- `decode_forward`: one token per slot against the preallocated cache, written in
  place at each slot's own position.
"""

from __future__ import annotations

from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from engine.decoder import gpt2, llama
from engine.decoder.config import GPT2, LLAMA, DecoderConfig
from engine.decoder.layers import cached_attention, causal_attention, inv_frequencies

FAMILIES = {GPT2: gpt2, LLAMA: llama}
_PREFIXES = {GPT2: ("transformer.",), LLAMA: ("model.",)}


def family(cfg: DecoderConfig):
    return FAMILIES[cfg.family]


def load_params(model_dir: str | Path, cfg: DecoderConfig, dtype) -> dict:
    """Weights of a Hugging Face directory -> parameter pytree of device arrays."""
    from engine.weights import load_weights, strip_prefix

    weights = strip_prefix(load_weights(model_dir), _PREFIXES[cfg.family])
    tree = family(cfg).load_params(weights, cfg)
    del weights  # the tree holds transposed copies: one host copy fewer at the peak
    return jax.tree.map(lambda a: jnp.asarray(a, dtype=dtype), tree)


def _inv_freq(cfg: DecoderConfig):
    return jnp.asarray(inv_frequencies(cfg)) if cfg.family == LLAMA else None


def forward_prompt(params: dict, cfg: DecoderConfig, tokens):
    """tokens: [T] -> x: [T, E] (before the final norm), k, v: L x [KV, T, D]

    Padding after the true length cannot reach earlier positions (causal mask), so
    the caller reads hidden states and K/V only below the true length.
    """
    fam, inv_freq = family(cfg), _inv_freq(cfg)
    positions = jnp.arange(tokens.shape[0], dtype=jnp.int32)
    x = fam.embed(params, cfg, tokens, positions)
    ks, vs = [], []
    for lp in params["layers"]:
        q, k, v = fam.attn_in(lp, cfg, x, positions, inv_freq)
        x = fam.attn_out(lp, cfg, x, causal_attention(q, k, v, cfg))
        ks.append(k.swapaxes(0, 1))  # [KV, T, D]
        vs.append(v.swapaxes(0, 1))
    return x, tuple(ks), tuple(vs)


def prompt_logits(params: dict, cfg: DecoderConfig, tokens):
    """tokens: [T] -> logits: [T, V] float32 at every position."""
    x, _, _ = forward_prompt(params, cfg, tokens)
    return family(cfg).head(params, cfg, x)


def last_logits(params: dict, cfg: DecoderConfig, x, true_length):
    """x: [T, E] -> logits: [V] float32 of the last true token only (the lm head is
    the largest matmul of a small model: run it on one row, not T)."""
    row = jax.lax.dynamic_slice_in_dim(x, true_length - 1, 1, axis=0)  # [1, E]
    return family(cfg).head(params, cfg, row)[0]


def decode_forward(
    params: dict, cfg: DecoderConfig, tokens, positions, k_cache, v_cache, window: int | None = None
):
    """One step for every slot.

    tokens, positions: [S] int32; k_cache, v_cache: L x [S, KV, MAX_LEN, D]
    -> logits: [S, V] float32, and both caches with each slot's new K/V at its position.

    `window` (static) limits attention to the first `window` cache positions: reading
    the whole cache is most of a step's cost, and live sequences are usually short.
    Every slot whose output is used must have its position below the window.
    """
    fam, inv_freq = family(cfg), _inv_freq(cfg)
    slots = jnp.arange(tokens.shape[0])
    x = fam.embed(params, cfg, tokens, positions)
    new_k, new_v = [], []
    for lp, kc, vc in zip(params["layers"], k_cache, v_cache):
        q, k, v = fam.attn_in(lp, cfg, x, positions, inv_freq)  # k, v: [S, KV, D]
        # Donated buffers: XLA writes these scatters in place, no cache copy.
        kc = kc.at[slots, :, positions].set(k)
        vc = vc.at[slots, :, positions].set(v)
        kw, vw = (kc, vc) if window is None else (kc[:, :, :window], vc[:, :, :window])
        x = fam.attn_out(lp, cfg, x, cached_attention(q, kw, vw, positions, cfg))
        new_k.append(kc)
        new_v.append(vc)
    return fam.head(params, cfg, x), tuple(new_k), tuple(new_v)


def param_bytes(params: dict) -> int:
    return int(sum(np.prod(a.shape) * a.dtype.itemsize for a in jax.tree.leaves(params)))
