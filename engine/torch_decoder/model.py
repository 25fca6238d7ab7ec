"""Both decoder families in eager torch: weights, the prompt pass and the decode step.

The math is the JAX engine's (engine/decoder/layers.py), written with torch ops:

- Weights come from `engine.weights.load_weights`, `engine.decoder.config` and the
  JAX engine's per-family name mapping (`gpt2.load_params`, `llama.load_params`,
  which are numpy only), so every directory the JAX engine loads loads here too,
  with the same layout: projections [in, out], Llama's q/k/v and gate/up fused
  (two matmuls where there would be five: a small decode step is bound by op
  count more than by FLOPs).
- Precision: parameters, activations and the KV cache in the configured dtype;
  norms and RoPE in float32; attention through `scaled_dot_product_attention`,
  which accumulates and takes its softmax in float32 for half dtypes; logits in
  float32 from a float32 [E, V] copy of the output matrix. That copy costs V x E x 4
  bytes more when the head is tied to the embedding (the embedding stays [V, E] for
  the lookup); it buys logits that are not rounded to 8 bits of mantissa (where
  greedy ties would be common) and a matmul in its fast layout.
- The KV cache is one [SLOTS, KV, MAX_LEN, D] tensor per layer, written in place:
  a prompt fills positions [0, T) of its slot; a decode step writes each row's new
  K/V at that row's own position, then attends to the first `window` positions
  with everything past the row's position masked.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from engine.decoder.config import GPT2, LLAMA, DecoderConfig
from engine.decoder.layers import inv_frequencies  # numpy: one place for RoPE scaling

# Wrapper names stripped before the family loaders see the tensors (as the JAX engine).
_PREFIXES = {GPT2: ("transformer.",), LLAMA: ("model.",)}

TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class Layer:
    ln1_w: torch.Tensor  # [E] (float32 for LayerNorm, dtype for RMSNorm)
    ln1_b: torch.Tensor | None  # [E] float32 (GPT-2 only)
    qkv_w: torch.Tensor  # [E, (H + 2 KV) * D]
    qkv_b: torch.Tensor | None  # [(H + 2 KV) * D]
    o_w: torch.Tensor  # [H * D, E]
    o_b: torch.Tensor | None  # [E]
    ln2_w: torch.Tensor
    ln2_b: torch.Tensor | None
    up_w: torch.Tensor  # GPT-2: [E, I]; Llama: gate and up side by side, [E, 2I]
    up_b: torch.Tensor | None  # [I] (GPT-2 only)
    down_w: torch.Tensor  # [I, E]
    down_b: torch.Tensor | None  # [E]


@dataclass
class Params:
    embed: torch.Tensor  # [V, E], dtype
    head: torch.Tensor  # [E, V] float32: the output matrix, transposed once at load
    norm_w: torch.Tensor  # [E]
    norm_b: torch.Tensor | None  # [E] (GPT-2 only)
    layers: list[Layer]
    positions: torch.Tensor | None = None  # [P, E] learned positions (GPT-2)
    cos: torch.Tensor | None = None  # [MAX_LEN, D] float32 RoPE tables (Llama)
    sin: torch.Tensor | None = None
    nbytes: int = field(default=0)


def _tensor(a: np.ndarray | None, dtype: torch.dtype, device: str, transpose: bool = False):
    """numpy (any float dtype, bfloat16 included) -> contiguous torch tensor."""
    if a is None:
        return None
    x = np.asarray(a, dtype=np.float32)  # exact for every stored float format
    if transpose:
        x = x.T
    return torch.from_numpy(np.ascontiguousarray(x)).to(device=device, dtype=dtype)


def _wide(a: np.ndarray | None, dtype: torch.dtype, device: str, transpose: bool = False):
    """Rounded to the model's dtype, then held in float32: for the parts computed in
    float32 (LayerNorm's affine, the logits), as the JAX engine computes them."""
    t = _tensor(a, dtype, device, transpose)
    return None if t is None else t.float()


def _rope_tables(cfg: DecoderConfig, max_len: int, device: str):
    """cos, sin: [MAX_LEN, D] float32, rotate-half layout (the Hugging Face convention)."""
    inv = torch.from_numpy(inv_frequencies(cfg))  # [D/2] float32
    angles = torch.arange(max_len, dtype=torch.float32)[:, None] * inv[None, :]  # [T, D/2]
    angles = torch.cat([angles, angles], -1)  # [T, D]
    return angles.cos().to(device), angles.sin().to(device)


def check_served(cfg: DecoderConfig) -> None:
    """The torch engine computes GPT-2 and the plain Llama loop (Llama, Mistral
    without a window, Qwen2, Phi-3 without one; default, linear, dynamic and llama3
    RoPE, every dim rotated); UnsupportedDecoder for the rest."""
    from engine.decoder.config import UnsupportedDecoder

    missing = [what for what, used in (
        ("q/k norms (Qwen3, Gemma 3)", cfg.qk_norm), ("Gemma's layers", cfg.gemma),
        ("sliding-window attention", cfg.windowed),
        (f"{cfg.rope_scaling[0]} RoPE scaling", cfg.rope_scaling[0] in ("yarn", "longrope")),
        ("partial rotary embeddings", cfg.rotary_dim != cfg.head_dim)) if used]  # fmt: skip
    if missing:
        raise UnsupportedDecoder(f"the torch engine does not compute {', '.join(missing)}: "
                                 f"serve this model with TENSORBUS_ENGINE=jax")


def load_params(model_dir: str | Path, cfg: DecoderConfig, dtype: torch.dtype, device: str,
                max_len: int) -> Params:  # fmt: skip
    """The JAX engine's own loaders map Hugging Face names to one numpy tree per
    family (projections [in, out], q/k/v and gate/up fused); this puts it in torch.

    [in, out] suits torch too: `x @ W` with W [in, out] measured 1.4 to 1.6x faster
    than `F.linear` on [out, in] for a decode step's small matrices on CPU."""
    from engine.decoder import gpt2, llama
    from engine.weights import load_weights, strip_prefix

    check_served(cfg)
    fam = gpt2 if cfg.family == GPT2 else llama
    w = strip_prefix(load_weights(model_dir), _PREFIXES[cfg.family])
    tree = fam.load_params(w, cfg)
    del w
    t = lambda a: _tensor(a, dtype, device)  # noqa: E731
    norm = (lambda a: _wide(a, dtype, device)) if cfg.family == GPT2 else t  # LayerNorm: float32
    layers = [
        Layer(
            ln1_w=norm(lp["ln1_w"]), ln1_b=norm(lp.get("ln1_b")),
            qkv_w=t(lp["qkv_w"]), qkv_b=t(lp.get("qkv_b")), o_w=t(lp["o_w"]), o_b=t(lp.get("o_b")),
            ln2_w=norm(lp["ln2_w"]), ln2_b=norm(lp.get("ln2_b")),
            up_w=t(lp.get("up_w", lp.get("gate_up_w"))), up_b=t(lp.get("up_b")),
            down_w=t(lp["down_w"]), down_b=t(lp.get("down_b")),
        )  # fmt: skip
        for lp in tree.pop("layers")
    ]
    embed = tree.get("wte", tree.get("embed"))  # [V, E]
    params = Params(
        embed=t(embed),
        head=_wide(tree.get("lm_head", embed), dtype, device, transpose=True),  # [E, V]
        norm_w=norm(tree.get("lnf_w", tree.get("norm_w"))), norm_b=norm(tree.get("lnf_b")),
        layers=layers, positions=t(tree.get("wpe")),
    )  # fmt: skip
    if cfg.family == LLAMA:
        params.cos, params.sin = _rope_tables(cfg, max_len, device)
    tensors = {id(x): x for x in _tensors(params)}
    params.nbytes = sum(x.numel() * x.element_size() for x in tensors.values())
    return params


def _tensors(params: Params):
    for v in vars(params).values():
        if isinstance(v, torch.Tensor):
            yield v
    for layer in params.layers:
        yield from (v for v in vars(layer).values() if isinstance(v, torch.Tensor))


# ----------------------------------------------------------------------- math
def _dense(x, w, b=None):
    """x: [N, in], w: [in, out] -> [N, out]"""
    return x @ w if b is None else torch.addmm(b, x, w)


def _layer_norm(x, w, b, eps: float):
    """Statistics and affine in float32, result in x's dtype (as the JAX engine)."""
    return F.layer_norm(x.float(), (x.shape[-1],), w, b, eps).to(x.dtype)


def _rms_norm(x, w, eps: float):
    xf = x.float()
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return w * y.to(x.dtype)  # cast before the weight, as Llama's reference does


def _activation(name: str, x):
    if name in ("gelu_new", "gelu_pytorch_tanh", "gelu_fast"):
        return F.gelu(x, approximate="tanh")
    if name == "gelu":
        return F.gelu(x)
    if name == "relu":
        return F.relu(x)
    if name in ("silu", "swish"):
        return F.silu(x)
    raise NotImplementedError(f"activation {name!r} is not supported")


def _rope(x, cos, sin):
    """x: [N, H, D], cos, sin: [N, D] float32 -> [N, H, D] in x's dtype."""
    xf = x.float()
    half = x.shape[-1] // 2
    rotated = torch.cat([-xf[..., half:], xf[..., :half]], -1)
    return (xf * cos[:, None, :] + rotated * sin[:, None, :]).to(x.dtype)


def embed(p: Params, cfg: DecoderConfig, tokens, positions):
    """tokens, positions: [N] int64 -> x: [N, E]"""
    x = p.embed[tokens]
    if cfg.family == GPT2:
        assert p.positions is not None  # GPT-2's learned positions (wpe) are always loaded
        return x + p.positions[positions]
    return x


def attn_in(p: Params, lp: Layer, cfg: DecoderConfig, x, positions):
    """x: [N, E] -> q: [N, H, D], k, v: [N, KV, D] (RoPE applied for Llama)."""
    n, d, h, kv = x.shape[0], cfg.head_dim, cfg.heads, cfg.kv_heads
    if cfg.family == GPT2:
        hx = _layer_norm(x, lp.ln1_w, lp.ln1_b, cfg.norm_eps)
    else:
        hx = _rms_norm(x, lp.ln1_w, cfg.norm_eps)
    qkv = _dense(hx, lp.qkv_w, lp.qkv_b)  # [N, (H + 2 KV) * D]
    q, k, v = qkv.split([h * d, kv * d, kv * d], dim=-1)
    q, k, v = q.view(n, h, d), k.view(n, kv, d), v.view(n, kv, d)
    if cfg.family == LLAMA:
        assert p.cos is not None and p.sin is not None  # a Llama's tables, made at load
        cos, sin = p.cos[positions], p.sin[positions]  # [N, D]
        q, k = _rope(q, cos, sin), _rope(k, cos, sin)
    return q, k, v


def attn_out(lp: Layer, cfg: DecoderConfig, x, attn):
    """Residual adds of the attention output and the MLP. attn: [N, H * D] -> [N, E]"""
    x = x + _dense(attn, lp.o_w, lp.o_b)
    if cfg.family == GPT2:
        hx = _layer_norm(x, lp.ln2_w, lp.ln2_b, cfg.norm_eps)
        hx = _activation(cfg.activation, _dense(hx, lp.up_w, lp.up_b))
    else:
        hx = _rms_norm(x, lp.ln2_w, cfg.norm_eps)
        gate, up = (hx @ lp.up_w).chunk(2, dim=-1)  # [N, I] each
        hx = _activation(cfg.activation, gate) * up
    return x + _dense(hx, lp.down_w, lp.down_b)


def head(p: Params, cfg: DecoderConfig, x):
    """x: [N, E] -> logits: [N, V] float32"""
    if cfg.family == GPT2:
        hx = _layer_norm(x, p.norm_w, p.norm_b, cfg.norm_eps)
    else:
        hx = _rms_norm(x, p.norm_w, cfg.norm_eps)
    return hx.float() @ p.head


def prompt_forward(p: Params, cfg: DecoderConfig, tokens, k_cache, v_cache, slot: int):
    """One prompt, written into `slot` of the cache.

    tokens: [T] int64; k_cache, v_cache: L x [S, KV, MAX_LEN, D]
    -> x: [T, E] hidden states before the final norm.
    """
    t = tokens.shape[0]
    positions = torch.arange(t, device=tokens.device)
    x = embed(p, cfg, tokens, positions)
    for lp, kc, vc in zip(p.layers, k_cache, v_cache):
        q, k, v = attn_in(p, lp, cfg, x, positions)
        k, v = k.transpose(0, 1), v.transpose(0, 1)  # [KV, T, D]
        kc[slot, :, :t] = k
        vc[slot, :, :t] = v
        out = F.scaled_dot_product_attention(
            q.transpose(0, 1)[None], k[None], v[None], is_causal=True, enable_gqa=True
        )  # [1, H, T, D]
        x = attn_out(lp, cfg, x, out[0].transpose(0, 1).reshape(t, -1))
    return x


def decode_forward(p: Params, cfg: DecoderConfig, tokens, positions, k_cache, v_cache,
                   window: int):  # fmt: skip
    """One step for the first N slots (rows [0, N) of the cache, a view, no copy).

    tokens, positions: [N] int64; k_cache, v_cache: L x [S, KV, MAX_LEN, D], S >= N
    -> logits: [N, V] float32; each row's new K/V is written at its own position.
    Every row's position must be below `window`.
    """
    n = tokens.shape[0]
    rows = torch.arange(n, device=tokens.device)
    visible = torch.arange(window, device=tokens.device)[None, :] <= positions[:, None]
    mask = visible[:, None, None, :]  # [N, 1, 1, W]
    x = embed(p, cfg, tokens, positions)
    for lp, kc, vc in zip(p.layers, k_cache, v_cache):
        q, k, v = attn_in(p, lp, cfg, x, positions)  # k, v: [N, KV, D]
        kc[rows, :, positions] = k
        vc[rows, :, positions] = v
        out = F.scaled_dot_product_attention(
            q[:, :, None, :], kc[:n, :, :window], vc[:n, :, :window], attn_mask=mask,
            enable_gqa=True,
        )  # [N, H, 1, D]
        x = attn_out(lp, cfg, x, out.reshape(n, -1))
    return head(p, cfg, x)
