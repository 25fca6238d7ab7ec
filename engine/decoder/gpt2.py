"""GPT-2 family: learned positions, pre-LayerNorm blocks, gelu_new MLP, tied lm head.

Hugging Face stores GPT-2's projections as `Conv1D`, whose weight is already
[in, out], so no transpose at load. c_attn packs q, k and v side by side: [E, 3E].
"""

from __future__ import annotations

import numpy as np

from engine.decoder.config import DecoderConfig
from engine.decoder.layers import activation, dense, unembed, layer_norm
from engine.quant import take_rows
from engine.sharding import split_fused

# Contracted axis of each weight a quantized model stores as integers.
QUANT_AXES = {"qkv_w": 0, "o_w": 0, "up_w": 0, "down_w": 0, "wte": 1, "lm_head": 1}


def fused(cfg: DecoderConfig) -> dict[str, tuple[int, ...]]:
    """Column blocks of the fused q/k/v matrix (stored shard-major under tensor parallelism)."""
    e = cfg.hidden
    return {"qkv_w": (e, e, e), "qkv_b": (e, e, e)}


def load_params(weights: dict[str, np.ndarray], cfg: DecoderConfig) -> dict:
    """HF tensor names ("transformer." already stripped) -> parameter pytree."""
    w = weights

    def layer(i: int) -> dict:
        p = f"h.{i}."
        return {
            "ln1_w": w[p + "ln_1.weight"], "ln1_b": w[p + "ln_1.bias"],
            "qkv_w": w[p + "attn.c_attn.weight"], "qkv_b": w[p + "attn.c_attn.bias"],  # [E, 3E]
            "o_w": w[p + "attn.c_proj.weight"], "o_b": w[p + "attn.c_proj.bias"],  # [E, E]
            "ln2_w": w[p + "ln_2.weight"], "ln2_b": w[p + "ln_2.bias"],
            "up_w": w[p + "mlp.c_fc.weight"], "up_b": w[p + "mlp.c_fc.bias"],  # [E, I]
            "down_w": w[p + "mlp.c_proj.weight"], "down_b": w[p + "mlp.c_proj.bias"],  # [I, E]
        }  # fmt: skip

    params = {
        "wte": w["wte.weight"],  # [V, E]
        "wpe": w["wpe.weight"],  # [P, E]
        "lnf_w": w["ln_f.weight"],
        "lnf_b": w["ln_f.bias"],
        "layers": [layer(i) for i in range(cfg.layers)],
    }
    if not cfg.tie_embeddings and "lm_head.weight" in w:
        params["lm_head"] = w["lm_head.weight"]  # [V, E]
    return params


def embed(params: dict, cfg: DecoderConfig, tokens, positions):
    """tokens, positions: [N] -> x: [N, E]"""
    return take_rows(params["wte"], tokens, params["wpe"].dtype) + params["wpe"][positions]


def attn_in(lp: dict, cfg: DecoderConfig, x, positions, inv_freq, scale: float = 1.0):
    """x: [N, E] -> q: [N, H, D], k, v: [N, KV, D] (GPT-2 has no RoPE)."""
    n = x.shape[0]
    h = layer_norm(x, lp["ln1_w"], lp["ln1_b"], cfg.norm_eps)
    qkv = dense(h, lp["qkv_w"], lp["qkv_b"])  # [N, 3E]
    if cfg.tensor_parallel == 1:
        qkv = qkv.reshape(n, 3, cfg.heads, cfg.head_dim)
        return qkv[:, 0], qkv[:, 1], qkv[:, 2]
    q, k, v = split_fused(qkv, fused(cfg)["qkv_w"], cfg.tensor_parallel)
    shape = (n, cfg.heads, cfg.head_dim)
    return q.reshape(shape), k.reshape(shape), v.reshape(shape)


def attn_out(lp: dict, cfg: DecoderConfig, x, attn):
    """Residual adds of the attention output and the MLP. attn: [N, H * D] -> [N, E]"""
    x = x + dense(attn, lp["o_w"], lp["o_b"])
    h = layer_norm(x, lp["ln2_w"], lp["ln2_b"], cfg.norm_eps)
    h = activation(cfg.activation, dense(h, lp["up_w"], lp["up_b"]))
    return x + dense(h, lp["down_w"], lp["down_b"])


def head(params: dict, cfg: DecoderConfig, x):
    """x: [N, E] -> logits: [N, V] float32"""
    h = layer_norm(x, params["lnf_w"], params["lnf_b"], cfg.norm_eps)
    w = params.get("lm_head", params["wte"])  # [V, E]
    return unembed(h, w)
