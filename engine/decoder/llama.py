"""Llama family (also Mistral and Qwen2 configs): RoPE, RMSNorm, SwiGLU MLP,
grouped-query attention, optionally tied embeddings.

Hugging Face stores `nn.Linear` weights as [out, in]; they are transposed once at
load to [in, out]. q, k and v are concatenated into one [E, (H + 2 KV) * D] matrix and
gate and up into one [E, 2I], so a decode step runs two matmuls where it would run
five: at batch 16 a step is launch-bound more than FLOP-bound.
"""

from __future__ import annotations

import numpy as np

from engine.decoder.config import DecoderConfig
from engine.decoder.layers import activation, dense, unembed, rms_norm, rope
from engine.quant import take_rows
from engine.sharding import split_fused

# Contracted axis of each weight a quantized model stores as integers.
QUANT_AXES = {"qkv_w": 0, "o_w": 0, "gate_up_w": 0, "down_w": 0, "embed": 1, "lm_head": 1}


def fused(cfg: DecoderConfig) -> dict[str, tuple[int, ...]]:
    """Column blocks of the fused matrices (stored shard-major under tensor parallelism)."""
    d = cfg.head_dim
    qkv = (cfg.heads * d, cfg.kv_heads * d, cfg.kv_heads * d)
    return {"qkv_w": qkv, "qkv_b": qkv, "gate_up_w": (cfg.intermediate, cfg.intermediate)}


def _t(a: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(a.T)


def load_params(weights: dict[str, np.ndarray], cfg: DecoderConfig) -> dict:
    """HF tensor names ("model." already stripped) -> parameter pytree."""
    w = weights

    def layer(i: int) -> dict:
        p = f"layers.{i}."
        a = p + "self_attn."
        lp = {
            "ln1_w": w[p + "input_layernorm.weight"],
            "qkv_w": np.concatenate(
                [_t(w[a + f"{n}_proj.weight"]) for n in "qkv"], axis=1
            ),  # [E, (H + 2 KV) * D]
            "o_w": _t(w[a + "o_proj.weight"]),  # [H * D, E]
            "ln2_w": w[p + "post_attention_layernorm.weight"],
            "gate_up_w": np.concatenate(
                [_t(w[p + "mlp.gate_proj.weight"]), _t(w[p + "mlp.up_proj.weight"])], axis=1
            ),  # [E, 2I]
            "down_w": _t(w[p + "mlp.down_proj.weight"]),  # [I, E]
        }
        if cfg.attn_bias:
            lp["qkv_b"] = np.concatenate([w[a + f"{n}_proj.bias"] for n in "qkv"])
        return lp

    params = {
        "embed": w["embed_tokens.weight"],  # [V, E]
        "norm_w": w["norm.weight"],
        "layers": [layer(i) for i in range(cfg.layers)],
    }
    if not cfg.tie_embeddings:
        params["lm_head"] = w["lm_head.weight"]  # [V, E]
    return params


def embed(params: dict, cfg: DecoderConfig, tokens, positions):
    """tokens: [N] -> x: [N, E] (positions enter through RoPE instead)."""
    return take_rows(params["embed"], tokens, params["norm_w"].dtype)


def attn_in(lp: dict, cfg: DecoderConfig, x, positions, inv_freq):
    """x: [N, E] -> q: [N, H, D], k, v: [N, KV, D], RoPE applied to q and k."""
    n, d = x.shape[0], cfg.head_dim
    h = rms_norm(x, lp["ln1_w"], cfg.norm_eps)
    qkv = dense(h, lp["qkv_w"], lp.get("qkv_b"))  # [N, (H + 2 KV) * D]
    q, k, v = split_fused(qkv, fused(cfg)["qkv_w"], cfg.tensor_parallel)
    q = q.reshape(n, cfg.heads, d)
    k = k.reshape(n, cfg.kv_heads, d)
    v = v.reshape(n, cfg.kv_heads, d)
    return rope(q, positions, inv_freq), rope(k, positions, inv_freq), v


def attn_out(lp: dict, cfg: DecoderConfig, x, attn):
    """Residual adds of the attention output and the SwiGLU MLP. attn: [N, H * D]"""
    x = x + dense(attn, lp["o_w"])
    h = rms_norm(x, lp["ln2_w"], cfg.norm_eps)
    gate_up = dense(h, lp["gate_up_w"])  # [N, 2I]
    gate, up = split_fused(gate_up, fused(cfg)["gate_up_w"], cfg.tensor_parallel)
    return x + dense(activation(cfg.activation, gate) * up, lp["down_w"])


def head(params: dict, cfg: DecoderConfig, x):
    """x: [N, E] -> logits: [N, V] float32"""
    h = rms_norm(x, params["norm_w"], cfg.norm_eps)
    w = params.get("lm_head", params["embed"])  # [V, E]
    return unembed(h, w)
