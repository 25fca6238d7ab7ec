"""ModernBERT in the JAX encoder engine: its weights -> the parameter pytree, its
transformer, and its sequence-classification head (a cross-encoder's).

How it differs from BERT (engine/encoder/model.py), as transformers computes it
(models/modernbert/modeling_modernbert.py, padded path):
  - embeddings: token embeddings -> LayerNorm (no position table, no token types);
  - pre-norm layers: x + attn(norm(x)), then x + mlp(norm(x)); the first layer's
    attention norm is the identity; a final LayerNorm after the last layer;
  - rotary positions on q and k, with base `rope_theta[0]` in global layers and
    `rope_theta[1]` in local ones; a local layer's token sees the tokens at most
    `window` (= local_attention // 2) positions away, a global one all of them;
  - GeGLU MLP: Wi's output halves are (input, gate), act(input) * gate -> Wo;
  - LayerNorms and dense layers carry biases only where the config says
    (`norm_bias`, `attention_bias`, `mlp_bias`, `classifier_bias`); a missing bias
    is stored as zeros;
  - the classifier: CLS state or the masked mean (`classifier_pooling`) -> dense ->
    act -> LayerNorm -> `classifier` -> the model's score activation.
Matmuls in the model dtype; norms, rotary positions, softmax and heads in float32.
"""

from __future__ import annotations

from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from engine import jaxrt
from engine.encoder.config import BertConfig
from engine.encoder.ops import gelu, layer_norm, mm
from engine.encoder.spec import UnsupportedEncoder, dense_weights
from engine.quant import cast_tree, quantize_tree, take_rows

Params = dict

# Shapes: B batch, S seq, D hidden, H heads, K head dim, F MLP width.
QUANT_AXES = {"qkv_w": 0, "o_w": 0, "i_w": 0, "f_w": 0, "word": 1}
KEEP_F32 = frozenset({"emb_ln_g", "emb_ln_b", "ln1_g", "ln1_b", "ln2_g", "ln2_b", "final_g",
                      "final_b", "head_w", "head_b", "head_r", "cls_w", "cls_b", "cls_ln_g",
                      "cls_ln_b", "out_w", "out_b"})  # fmt: skip


def load_params(model_dir: str | Path, cfg: BertConfig, w: dict, dtype: str, quant: str,
                mesh) -> Params:
    """Hugging Face ModernBERT weights (prefix already stripped) -> the pytree
    `encode` expects: dense weights as [in, out]; the fused Wqkv kept fused ([D, 3D],
    columns q | k | v, heads inside each), Wi kept fused ([D, 2F], input | gate)."""
    if mesh is not None:
        raise UnsupportedEncoder("ModernBERT runs on one device (no tensor parallelism)")
    d = cfg.hidden

    def f32(name: str) -> np.ndarray:
        return np.asarray(w[name], dtype=np.float32)

    def opt(name: str, size: int) -> np.ndarray:  # a bias the config may leave out
        return f32(name) if name in w else np.zeros(size, np.float32)

    def norm(prefix: str) -> tuple[np.ndarray, np.ndarray]:
        return f32(prefix + ".weight"), opt(prefix + ".bias", d)

    layers = []
    for i in range(cfg.layers):
        p = f"layers.{i}."
        ln1 = norm(p + "attn_norm") if i else (np.ones(d, np.float32), np.zeros(d, np.float32))
        ln2 = norm(p + "mlp_norm")
        layers.append({
            "ln1_g": ln1[0], "ln1_b": ln1[1],  # identity in layer 0
            "qkv_w": f32(p + "attn.Wqkv.weight").T, "qkv_b": opt(p + "attn.Wqkv.bias", 3 * d),
            "o_w": f32(p + "attn.Wo.weight").T, "o_b": opt(p + "attn.Wo.bias", d),
            "ln2_g": ln2[0], "ln2_b": ln2[1],
            "i_w": f32(p + "mlp.Wi.weight").T,  # [D, 2F]
            "i_b": opt(p + "mlp.Wi.bias", 2 * cfg.intermediate),
            "f_w": f32(p + "mlp.Wo.weight").T, "f_b": opt(p + "mlp.Wo.bias", d),  # [F, D]
        })  # fmt: skip
    emb_ln, final = norm("embeddings.norm"), norm("final_norm")
    tree = {
        "word": f32("embeddings.tok_embeddings.weight"),  # [V, D]
        "emb_ln_g": emb_ln[0], "emb_ln_b": emb_ln[1],
        "layers": layers,
        "final_g": final[0], "final_b": final[1],
        "head": [{"head_w": h["w"], "head_b": h["b"]} | ({} if h["r"] is None else {"head_r": h["r"]})
                 for h in dense_weights(model_dir, cfg.spec)],
    }  # fmt: skip
    if cfg.spec.task == "score":
        cls_ln = norm("head.norm")
        tree["classifier"] = {
            "cls_w": f32("head.dense.weight").T, "cls_b": opt("head.dense.bias", d),  # [D, D]
            "cls_ln_g": cls_ln[0], "cls_ln_b": cls_ln[1],
            "out_w": f32("classifier.weight").T, "out_b": opt("classifier.bias", cfg.dim),  # [D, L]
        }  # fmt: skip
    return cast_tree(quantize_tree(tree, quant, QUANT_AXES), jaxrt.parse_dtype(dtype), KEEP_F32)


def _rope_tables(s: int, k: int, theta: float) -> tuple[np.ndarray, np.ndarray]:
    """cos, sin: [S, K] float32 for positions 0..S-1 (right padding: token i is at
    position i), as transformers builds them: inv_freq over even dims, duplicated."""
    inv = 1.0 / (np.float32(theta) ** (np.arange(0, k, 2, dtype=np.float32) / np.float32(k)))
    freqs = np.arange(s, dtype=np.float32)[:, None] * inv[None, :].astype(np.float32)  # [S, K/2]
    emb = np.concatenate([freqs, freqs], axis=-1)
    return np.cos(emb).astype(np.float32), np.sin(emb).astype(np.float32)


def _rotate(x, cos, sin):
    """x: [B, H, S, K] -> the same, rotated in float32 (transformers' rotate_half)."""
    x32 = x.astype(jnp.float32)
    half = x.shape[-1] // 2
    rot = jnp.concatenate([-x32[..., half:], x32[..., :half]], axis=-1)
    return (x32 * cos + rot * sin).astype(x.dtype)


def _attention(x, p, bias, cos, sin, heads: int):
    """x: [B, S, D] (normed); bias: [B, 1, S, S] or [B, 1, 1, S] float32 -> [B, S, D]."""
    b, s, d = x.shape
    k = d // heads
    qkv = mm(x, p["qkv_w"]) + p["qkv_b"]  # [B, S, 3D]
    qkv = qkv.reshape(b, s, 3, heads, k).transpose(2, 0, 3, 1, 4)  # [3, B, H, S, K]
    q, key, v = _rotate(qkv[0], cos, sin), _rotate(qkv[1], cos, sin), qkv[2]
    q = q * jnp.asarray(1.0 / np.sqrt(k), q.dtype)
    scores = jnp.einsum("bhqk,bhsk->bhqs", q, key, preferred_element_type=jnp.float32)
    probs = jax.nn.softmax(scores + bias, axis=-1).astype(v.dtype)  # [B, H, S, S]
    ctx = jnp.einsum("bhqs,bhsk->bhqk", probs, v).transpose(0, 2, 1, 3).reshape(b, s, d)
    return mm(ctx, p["o_w"]) + p["o_b"]


def _mlp(x, p, act: str):
    """GeGLU: x: [B, S, D] -> [B, S, D]."""
    h = mm(x, p["i_w"]) + p["i_b"]  # [B, S, 2F]
    inp, gate = jnp.split(h, 2, axis=-1)
    return mm(gelu(inp, act) * gate, p["f_w"]) + p["f_b"]


def encode(params: Params, ids, mask, cfg: BertConfig):
    """ids, mask: [B, S] int32 -> (token states [B, S, D] after the final norm, in the
    model dtype; mask [B, S] float32)."""
    s = ids.shape[1]
    dt = params["layers"][0]["o_b"].dtype
    x = take_rows(params["word"], ids, jnp.float32).astype(jnp.float32)  # [B, S, D]
    x = layer_norm(x, params["emb_ln_g"], params["emb_ln_b"], cfg.eps).astype(dt)
    m = mask.astype(jnp.float32)
    pad = ((m - 1.0) * 1e9)[:, None, None, :]  # [B, 1, 1, S]: padding keys
    dist = np.abs(np.arange(s)[:, None] - np.arange(s)[None, :])  # [S, S], static
    local = pad + jnp.asarray(np.where(dist <= cfg.window, 0.0, -1e9), jnp.float32)[None, None]
    k = cfg.hidden // cfg.heads
    tables = [_rope_tables(s, k, theta) for theta in cfg.rope_theta]  # (global, local)
    for i, p in enumerate(params["layers"]):
        glob = cfg.global_layers[i]
        cos, sin = tables[0 if glob else 1]
        h = layer_norm(x, p["ln1_g"], p["ln1_b"], cfg.eps) if i else x
        x = x + _attention(h, p, pad if glob else local, cos, sin, cfg.heads)
        x = x + _mlp(layer_norm(x, p["ln2_g"], p["ln2_b"], cfg.eps), p, cfg.act)
    return layer_norm(x, params["final_g"], params["final_b"], cfg.eps), m


def classify(params: Params, x32, m, cfg: BertConfig):
    """x32: [B, S, D] float32 final states, m: [B, S] -> [B, L] logits, before the
    score activation: CLS or masked mean -> dense -> act -> LayerNorm -> classifier."""
    c = params["classifier"]
    if cfg.classifier_pooling == "cls":
        pooled = x32[:, 0]
    else:
        pooled = jnp.einsum("bsd,bs->bd", x32, m) / jnp.maximum(jnp.sum(m, 1, keepdims=True), 1.0)
    h = gelu(pooled @ c["cls_w"] + c["cls_b"], cfg.head_act)  # [B, D]
    h = layer_norm(h, c["cls_ln_g"], c["cls_ln_b"], cfg.eps)
    return h @ c["out_w"] + c["out_b"]  # [B, L]
