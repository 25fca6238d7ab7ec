"""Static shape of a decoder, read once from a Hugging Face `config.json` (or the
metadata of a GGUF file, mapped to the same keys).

One frozen dataclass for both families, so the shared attention and KV cache code
never asks which family it serves. It is hashable: jitted functions take it as a
static argument, and two engines of one architecture share their compiles.
"""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path
from typing import Any

GPT2 = "gpt2"
LLAMA = "llama"
# model_type values that load as Llama: the same layer loop, with the differences
# each config sets below (q/k norms, fused projections, Gemma's norms and capping).
LLAMA_LIKE = {"llama", "mistral", "qwen2", "qwen3", "phi3", "gemma2", "gemma3_text"}
GEMMA = {"gemma2", "gemma3_text"}


class UnsupportedDecoder(ValueError):
    """A decoder architecture or setting the engines do not compute: refused with the
    reason (a worker exits 78), never served approximately."""


@dataclasses.dataclass(frozen=True)
class DecoderConfig:
    family: str  # GPT2 | LLAMA
    vocab_size: int
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    max_positions: int
    norm_eps: float
    activation: str  # gelu_new | gelu | relu | silu
    tie_embeddings: bool
    rope_theta: float = 10000.0
    # ("default",) | ("linear", factor) | ("dynamic", factor) (default RoPE within
    # max_positions, as transformers computes it) |
    # ("llama3", factor, low_freq_factor, high_freq_factor, original_max_positions) |
    # ("yarn", factor, original_max_positions, beta_fast, beta_slow, attention_factor,
    #  truncate) | ("longrope", short_factors, long_factors, original_max_positions,
    #  attention_factor): layers.inv_frequencies / rope_scale compute them.
    rope_scaling: tuple = ("default",)
    partial_rotary: float = 1.0  # the leading fraction of each head's dims RoPE rotates
    attn_bias: bool = False  # q/k/v biases in a Llama-like model (Qwen2 has them)
    # Local attention (Mistral, Gemma): a query sees the `sliding_window` positions up
    # to its own. `sliding_layers` names the layers that use it (Gemma alternates
    # local and global layers); empty: every layer, when there is a window.
    sliding_window: int | None = None
    sliding_layers: tuple[bool, ...] = ()
    qk_norm: bool = False  # RMSNorm of each query and key head before RoPE (Qwen3, Gemma 3)
    # Gemma: embeddings scaled by sqrt(hidden), RMSNorm weights as (1 + w), norms
    # around both the attention and the MLP output, scores scaled by
    # query_pre_attn_scalar ** -0.5 instead of head_dim ** -0.5, and tanh
    # soft-capping of attention scores and final logits (Gemma 2).
    gemma: bool = False
    attn_scale: float | None = None  # None: head_dim ** -0.5
    attn_softcap: float | None = None
    final_softcap: float | None = None
    local_rope_theta: float | None = None  # Gemma 3's sliding layers: their own RoPE base
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    # Devices the engine splits heads and MLP columns over (engine/sharding.py); set
    # by the engine, not read from the model's files. 1 = one device.
    tensor_parallel: int = 1

    @property
    def groups(self) -> int:
        """Query heads per key/value head (grouped-query attention)."""
        return self.heads // self.kv_heads

    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary)

    @property
    def scale(self) -> float:
        return self.attn_scale if self.attn_scale is not None else self.head_dim ** -0.5

    def window(self, layer: int) -> int | None:
        """The sliding window of `layer`, or None where it attends to everything."""
        if self.sliding_window is None:
            return None
        if self.sliding_layers and not self.sliding_layers[layer]:
            return None
        return self.sliding_window

    @property
    def windowed(self) -> bool:
        return any(self.window(i) is not None for i in range(self.layers))


def _ids(value: Any) -> tuple[int, ...]:
    if isinstance(value, bool) or value is None:
        return ()
    if isinstance(value, int):
        return (value,)
    return tuple(v for v in value if isinstance(v, int) and not isinstance(v, bool))


def _mscale(factor: float, mscale: float = 1.0) -> float:
    """YaRN's attention temperature (transformers' `yarn_get_mscale`)."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def _original(scaling: dict, cfg: dict) -> int:
    """The pre-training length, where transformers reads it: a top-level
    `original_max_position_embeddings` (Phi-3) first, then the scaling's, then
    max_position_embeddings."""
    for value in (cfg.get("original_max_position_embeddings"),
                  scaling.get("original_max_position_embeddings")):
        if value is not None:
            return int(value)
    return int(cfg.get("max_position_embeddings", 2048))


def _factor(scaling: dict, cfg: dict, original: int) -> float:
    """The scaling's `factor`, else how far the context reaches past the pre-training
    length (transformers' default for YaRN and longrope)."""
    factor = scaling.get("factor")
    return float(factor) if factor is not None else (
        int(cfg.get("max_position_embeddings", 2048)) / original)


def _yarn(scaling: dict, cfg: dict) -> tuple:
    """transformers' `_compute_yarn_parameters`, its numbers read once here."""
    original = _original(scaling, cfg)
    factor = _factor(scaling, cfg, original)
    attention = scaling.get("attention_factor")
    if attention is None:
        mscale, mscale_all = scaling.get("mscale"), scaling.get("mscale_all_dim")
        attention = (_mscale(factor, mscale) / _mscale(factor, mscale_all)
                     if mscale and mscale_all else _mscale(factor))
    return ("yarn", factor, original, float(scaling.get("beta_fast") or 32),
            float(scaling.get("beta_slow") or 1), float(attention),
            bool(scaling.get("truncate", True)))


def _longrope(scaling: dict, cfg: dict) -> tuple:
    """transformers' `_compute_longrope_parameters`: short factors up to the
    pre-training length, long ones past it, cos/sin scaled by the attention factor."""
    original = _original(scaling, cfg)
    factor = _factor(scaling, cfg, original)
    attention = scaling.get("attention_factor")
    if attention is None:
        attention = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
    short = tuple(float(f) for f in scaling["short_factor"])
    long = tuple(float(f) for f in scaling["long_factor"])
    return ("longrope", short, long, original, float(attention))


def _scaling(scaling: dict | None, cfg: dict | None = None) -> tuple:
    kind = scaling.get("rope_type", scaling.get("type", "default")) if scaling else "default"
    if kind == "default":
        return ("default",)
    assert scaling is not None  # None reads as "default"
    cfg = cfg or {}
    if kind == "linear":
        return ("linear", float(scaling["factor"]))
    if kind == "dynamic":
        return ("dynamic", float(scaling["factor"]))
    if kind == "llama3":
        return (
            "llama3",
            float(scaling["factor"]),
            float(scaling["low_freq_factor"]),
            float(scaling["high_freq_factor"]),
            _original(scaling, cfg),
        )
    if kind == "yarn":
        return _yarn(scaling, cfg)
    if kind == "longrope":
        return _longrope(scaling, cfg)
    raise UnsupportedDecoder(f"rope scaling {kind!r} is not supported (default, linear, "
                             f"dynamic, llama3, yarn and longrope are)")


def _rope(cfg: dict) -> tuple[float, tuple, float | None]:
    """(rope_theta, scaling, the sliding layers' own theta or None), whether written
    flat (transformers 4), nested under `rope_parameters` (transformers 5), or nested
    per layer type (`{"full_attention": {...}, "sliding_attention": {...}}`, Gemma 3)."""
    nested = cfg.get("rope_parameters") or {}
    local = None
    if "full_attention" in nested or "sliding_attention" in nested:
        if "sliding_attention" in nested:
            lp = nested["sliding_attention"]
            if _scaling(lp) != ("default",):
                raise UnsupportedDecoder("scaled RoPE on sliding layers is not supported")
            local = float(lp.get("rope_theta", 10000.0))
        nested = nested.get("full_attention") or {}
    elif cfg.get("rope_local_base_freq") is not None:
        local = float(cfg["rope_local_base_freq"])
    theta = float(nested.get("rope_theta", cfg.get("rope_theta", 10000.0)))
    return theta, _scaling(cfg.get("rope_scaling") or nested, cfg), local


def _gpt2(cfg: dict) -> DecoderConfig:
    if cfg.get("scale_attn_by_inverse_layer_idx") or cfg.get("reorder_and_upcast_attn"):
        raise UnsupportedDecoder("GPT-2 attention variants are not supported")
    hidden, heads = int(cfg["n_embd"]), int(cfg["n_head"])
    return DecoderConfig(
        family=GPT2,
        vocab_size=int(cfg["vocab_size"]),
        hidden=hidden,
        layers=int(cfg["n_layer"]),
        heads=heads,
        kv_heads=heads,
        head_dim=hidden // heads,
        intermediate=int(cfg.get("n_inner") or 4 * hidden),
        max_positions=int(cfg.get("n_positions", 1024)),
        norm_eps=float(cfg.get("layer_norm_epsilon", 1e-5)),
        activation=cfg.get("activation_function", "gelu_new"),
        tie_embeddings=bool(cfg.get("tie_word_embeddings", True)),
        bos_token_id=cfg.get("bos_token_id"),
        eos_token_ids=_ids(cfg.get("eos_token_id")),
    )


def _window(cfg: dict) -> tuple[int | None, tuple[bool, ...]]:
    """(window, which layers use it) from `sliding_window`, `use_sliding_window`
    (Qwen2/3 keep a window they do not use), `layer_types` (transformers' per-layer
    list), or Gemma's patterns when a config predates that list."""
    kind, window, n = cfg.get("model_type"), cfg.get("sliding_window"), int(cfg["num_hidden_layers"])
    types = cfg.get("layer_types")
    if not types and kind == "gemma2":  # even layers local, odd global
        types = ["sliding_attention" if (i + 1) % 2 else "full_attention" for i in range(n)]
    if not types and kind == "gemma3_text":  # every `sliding_window_pattern`th global
        every = int(cfg.get("sliding_window_pattern", 6))
        types = ["sliding_attention" if (i + 1) % every else "full_attention" for i in range(n)]
    if kind in ("qwen2", "qwen3") and not cfg.get("use_sliding_window", False):
        return None, ()
    if not window:
        return None, ()
    if types:
        layers = tuple(t == "sliding_attention" for t in types)
        return (int(window), layers) if any(layers) else (None, ())
    if kind in ("mistral", "phi3") or cfg.get("use_sliding_window"):
        return int(window), ()
    return None, ()


def _gemma(cfg: dict) -> dict:
    """Gemma 2 / Gemma 3 text fields over the Llama ones."""
    kind = cfg["model_type"]
    out = dict(gemma=True, qk_norm=kind == "gemma3_text",
               attn_scale=float(cfg.get("query_pre_attn_scalar") or cfg["head_dim"]) ** -0.5,
               attn_softcap=cfg.get("attn_logit_softcapping"),
               final_softcap=cfg.get("final_logit_softcapping"),
               activation=cfg.get("hidden_activation") or cfg.get("hidden_act", "gelu_pytorch_tanh"),
               tie_embeddings=bool(cfg.get("tie_word_embeddings", True)))
    return out


def _partial(cfg: dict, head_dim: int) -> float:
    """`partial_rotary_factor`: served where the family's own attention rotates only
    that fraction (Phi-3's, so Phi-4-mini); Llama, Mistral, Qwen and Gemma's
    attention in transformers rotates every dim whatever the config says, so a
    factor there is refused rather than guessed."""
    partial = (cfg.get("rope_parameters") or {}).get("partial_rotary_factor",
                                                     cfg.get("partial_rotary_factor", 1.0))
    partial = 1.0 if partial is None else float(partial)
    if partial == 1.0:
        return partial
    kind = cfg.get("model_type")
    if kind != "phi3":
        raise UnsupportedDecoder(f"partial rotary embeddings (partial_rotary_factor "
                                 f"{partial}) are not supported for {kind} (phi3 only)")
    rotary = int(head_dim * partial)
    if not 0 < rotary <= head_dim or rotary % 2:
        raise UnsupportedDecoder(f"partial_rotary_factor {partial} gives {rotary} rotary "
                                 f"dims of {head_dim}: an even count is needed")
    return partial


def _refuse_unserved(cfg: dict) -> None:
    if cfg.get("use_bidirectional_attention"):
        raise UnsupportedDecoder("bidirectional attention is not a causal decoder")


def _llama(cfg: dict) -> DecoderConfig:
    _refuse_unserved(cfg)
    hidden, heads = int(cfg["hidden_size"]), int(cfg["num_attention_heads"])
    theta, scaling, local_theta = _rope(cfg)
    window, sliding = _window(cfg)
    kind = cfg.get("model_type")
    head_dim = int(cfg.get("head_dim") or hidden // heads)
    partial = _partial(cfg, head_dim)
    freqs = int(head_dim * partial) // 2
    if scaling[0] == "longrope" and not len(scaling[1]) == len(scaling[2]) == freqs:
        raise UnsupportedDecoder(f"longrope has {len(scaling[1])} short and {len(scaling[2])} "
                                 f"long factors for {freqs} frequencies")
    extra = _gemma(cfg) if kind in GEMMA else {"qk_norm": kind == "qwen3"}
    fields = dict(
        family=LLAMA,
        vocab_size=int(cfg["vocab_size"]),
        hidden=hidden,
        layers=int(cfg["num_hidden_layers"]),
        heads=heads,
        kv_heads=int(cfg.get("num_key_value_heads") or heads),
        head_dim=head_dim,
        intermediate=int(cfg["intermediate_size"]),
        max_positions=int(cfg.get("max_position_embeddings", 2048)),
        norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        activation=cfg.get("hidden_act", "silu"),
        tie_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        rope_theta=theta,
        rope_scaling=scaling,
        partial_rotary=partial,
        attn_bias=bool(cfg.get("attention_bias", kind == "qwen2")),
        sliding_window=window,
        sliding_layers=sliding,
        local_rope_theta=local_theta if kind == "gemma3_text" else None,
        bos_token_id=cfg.get("bos_token_id"),
        eos_token_ids=_ids(cfg.get("eos_token_id")),
    )
    return DecoderConfig(**{**fields, **extra})


def from_dict(cfg: dict) -> DecoderConfig:
    """Refuses, besides architectures, a `quantization_config` no engine serves
    exactly (engine/prequant.py): AWQ's or GPTQ's packed integers read as float would
    fail on a missing tensor at best; FP8 is served, dequantized at load."""
    from engine.prequant import UnsupportedQuantization, scheme

    try:
        scheme(cfg)
    except UnsupportedQuantization as exc:
        raise UnsupportedDecoder(str(exc)) from None
    kind = cfg.get("model_type", "")
    if kind == "gpt2":
        return _gpt2(cfg)
    if kind in LLAMA_LIKE:
        return _llama(cfg)
    raise UnsupportedDecoder(f"model_type {kind!r} is not a supported decoder (served: gpt2, "
                             f"{', '.join(sorted(LLAMA_LIKE))})")


def load_config(model_dir: str | Path) -> DecoderConfig:
    """From `config.json`, or from the metadata of the directory's one GGUF file."""
    from shared import gguf

    path = gguf.find_file(model_dir)
    if path is not None:
        return from_dict(gguf.hf_config(gguf.read_header(path)))
    return from_dict(json.loads((Path(model_dir) / "config.json").read_text()))
