"""Llama family: RoPE, RMSNorm, gated MLP, grouped-query attention, optionally tied
embeddings. Mistral, Qwen2 and Qwen3 (RMSNorm of each query and key head), Phi-3 (q/k/v
and gate/up stored fused) and Gemma 2 / Gemma 3 (see `DecoderConfig.gemma`) are the
same loop with the differences their configs set.

Hugging Face stores `nn.Linear` weights as [out, in]; they are transposed once at
load to [in, out]. q, k and v are concatenated into one [E, (H + 2 KV) * D] matrix and
gate and up into one [E, 2I], so a decode step runs two matmuls where it would run
five: at batch 16 a step is launch-bound more than FLOP-bound.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from engine.decoder.config import DecoderConfig
from engine.decoder.layers import activation, dense, unembed, rms_norm, rope
from engine.quant import concatenated, take_rows, transposed
from engine.sharding import split_fused

# Contracted axis of each weight a quantized model stores as integers.
QUANT_AXES = {"qkv_w": 0, "o_w": 0, "gate_up_w": 0, "down_w": 0, "embed": 1, "lm_head": 1}


def fused(cfg: DecoderConfig) -> dict[str, tuple[int, ...]]:
    """Column blocks of the fused matrices (stored shard-major under tensor parallelism)."""
    d = cfg.head_dim
    qkv = (cfg.heads * d, cfg.kv_heads * d, cfg.kv_heads * d)
    return {"qkv_w": qkv, "qkv_b": qkv, "gate_up_w": (cfg.intermediate, cfg.intermediate)}


def _t(a):
    """[out, in] -> [in, out]; a GGUF file's blocks too (engine/gguf.py load_blocks)."""
    return transposed(a)


def _fused(w: dict, prefix: str, fused: str, parts: tuple[str, ...]):
    """[in, out] of projections stored apart (Llama) or already fused (Phi-3)."""
    if prefix + fused + ".weight" in w:
        return _t(w[prefix + fused + ".weight"])
    return concatenated([_t(w[prefix + f"{n}.weight"]) for n in parts], axis=1)


def load_params(weights: dict[str, np.ndarray], cfg: DecoderConfig) -> dict:
    """HF tensor names ("model." already stripped) -> parameter pytree."""
    w = weights
    # Gemma's RMSNorm multiplies by (1 + weight): the 1 is added once, here.
    norm = (lambda a: a.astype(np.float32) + 1.0) if cfg.gemma else (lambda a: a)

    def layer(i: int) -> dict:
        p = f"layers.{i}."
        a = p + "self_attn."
        mlp_in = "pre_feedforward_layernorm" if cfg.gemma else "post_attention_layernorm"
        lp = {
            "ln1_w": norm(w[p + "input_layernorm.weight"]),
            "qkv_w": _fused(w, a, "qkv_proj", ("q_proj", "k_proj", "v_proj")),  # [E, (H + 2 KV) * D]
            "o_w": _t(w[a + "o_proj.weight"]),  # [H * D, E]
            "ln2_w": norm(w[p + mlp_in + ".weight"]),
            "gate_up_w": _fused(w, p + "mlp.", "gate_up_proj", ("gate_proj", "up_proj")),  # [E, 2I]
            "down_w": _t(w[p + "mlp.down_proj.weight"]),  # [I, E]
        }
        if cfg.attn_bias:
            lp["qkv_b"] = np.concatenate([w[a + f"{n}_proj.bias"] for n in "qkv"])
        if cfg.qk_norm:  # one [D] weight shared by every head
            lp["q_norm_w"], lp["k_norm_w"] = norm(w[a + "q_norm.weight"]), norm(w[a + "k_norm.weight"])
        if cfg.gemma:  # norms of the attention's and the MLP's outputs
            lp["post_attn_w"] = norm(w[p + "post_attention_layernorm.weight"])
            lp["post_mlp_w"] = norm(w[p + "post_feedforward_layernorm.weight"])
        return lp

    params = {
        "embed": w["embed_tokens.weight"],  # [V, E]
        "norm_w": norm(w["norm.weight"]),
        "layers": [layer(i) for i in range(cfg.layers)],
    }
    if not cfg.tie_embeddings:
        params["lm_head"] = w["lm_head.weight"]  # [V, E]
    return params


def embed(params: dict, cfg: DecoderConfig, tokens, positions):
    """tokens: [N] -> x: [N, E] (positions enter through RoPE instead)."""
    x = take_rows(params["embed"], tokens, params["norm_w"].dtype)
    if cfg.gemma:  # scaled by sqrt(hidden), the factor rounded to the activations' dtype
        x = x * jnp.asarray(cfg.hidden ** 0.5, x.dtype)
    return x


def attn_in(lp: dict, cfg: DecoderConfig, x, positions, inv_freq, scale: float = 1.0):
    """x: [N, E] -> q: [N, H, D], k, v: [N, KV, D], RoPE applied to q and k."""
    n, d = x.shape[0], cfg.head_dim
    h = rms_norm(x, lp["ln1_w"], cfg.norm_eps)
    qkv = dense(h, lp["qkv_w"], lp.get("qkv_b"))  # [N, (H + 2 KV) * D]
    q, k, v = split_fused(qkv, fused(cfg)["qkv_w"], cfg.tensor_parallel)
    q = q.reshape(n, cfg.heads, d)
    k = k.reshape(n, cfg.kv_heads, d)
    v = v.reshape(n, cfg.kv_heads, d)
    if cfg.qk_norm:
        q, k = rms_norm(q, lp["q_norm_w"], cfg.norm_eps), rms_norm(k, lp["k_norm_w"], cfg.norm_eps)
    return rope(q, positions, inv_freq, scale), rope(k, positions, inv_freq, scale), v


def attn_out(lp: dict, cfg: DecoderConfig, x, attn):
    """Residual adds of the attention output and the gated MLP (Gemma: each output
    normed before its residual add). attn: [N, H * D]"""
    out = dense(attn, lp["o_w"])
    if cfg.gemma:
        out = rms_norm(out, lp["post_attn_w"], cfg.norm_eps)
    x = x + out
    h = rms_norm(x, lp["ln2_w"], cfg.norm_eps)
    gate_up = dense(h, lp["gate_up_w"])  # [N, 2I]
    gate, up = split_fused(gate_up, fused(cfg)["gate_up_w"], cfg.tensor_parallel)
    out = dense(activation(cfg.activation, gate) * up, lp["down_w"])
    if cfg.gemma:
        out = rms_norm(out, lp["post_mlp_w"], cfg.norm_eps)
    return x + out


def head(params: dict, cfg: DecoderConfig, x):
    """x: [N, E] -> logits: [N, V] float32"""
    h = rms_norm(x, params["norm_w"], cfg.norm_eps)
    w = params.get("lm_head", params["embed"])  # [V, E]
    logits = unembed(h, w)
    if cfg.final_softcap:  # Gemma 2
        logits = jnp.tanh(logits / cfg.final_softcap) * cfg.final_softcap
    return logits
