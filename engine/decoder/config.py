"""Static shape of a decoder, read once from a Hugging Face `config.json` (or the
metadata of a GGUF file, mapped to the same keys).

One frozen dataclass for both families, so the shared attention and KV cache code
never asks which family it serves. It is hashable: jitted functions take it as a
static argument, and two engines of one architecture share their compiles.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

GPT2 = "gpt2"
LLAMA = "llama"
# model_type values that load as Llama: same tensor names, same math.
LLAMA_LIKE = {"llama", "mistral", "qwen2"}


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
    # ("default",) or ("linear", factor) or
    # ("llama3", factor, low_freq_factor, high_freq_factor, original_max_positions)
    rope_scaling: tuple = ("default",)
    attn_bias: bool = False  # q/k/v biases in a Llama-like model (Qwen2 has them)
    # Mistral-style local attention. Inside the window it is plain causal attention,
    # so the engine caps its context at the window instead of masking by distance.
    sliding_window: int | None = None
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    # Devices the engine splits heads and MLP columns over (engine/sharding.py); set
    # by the engine, not read from the model's files. 1 = one device.
    tensor_parallel: int = 1

    @property
    def groups(self) -> int:
        """Query heads per key/value head (grouped-query attention)."""
        return self.heads // self.kv_heads


def _ids(value: Any) -> tuple[int, ...]:
    if isinstance(value, bool) or value is None:
        return ()
    if isinstance(value, int):
        return (value,)
    return tuple(v for v in value if isinstance(v, int) and not isinstance(v, bool))


def _rope(cfg: dict) -> tuple[float, tuple]:
    """rope_theta and scaling, whether written flat (transformers 4) or nested
    under `rope_parameters` (transformers 5)."""
    nested = cfg.get("rope_parameters") or {}
    theta = float(nested.get("rope_theta", cfg.get("rope_theta", 10000.0)))
    scaling = cfg.get("rope_scaling") or nested
    kind = scaling.get("rope_type", scaling.get("type", "default")) if scaling else "default"
    if kind == "default":
        return theta, ("default",)
    if kind == "linear":
        return theta, ("linear", float(scaling["factor"]))
    if kind == "llama3":
        return theta, (
            "llama3",
            float(scaling["factor"]),
            float(scaling["low_freq_factor"]),
            float(scaling["high_freq_factor"]),
            int(scaling["original_max_position_embeddings"]),
        )
    raise NotImplementedError(f"rope scaling {kind!r} is not supported")


def _gpt2(cfg: dict) -> DecoderConfig:
    if cfg.get("scale_attn_by_inverse_layer_idx") or cfg.get("reorder_and_upcast_attn"):
        raise NotImplementedError("GPT-2 attention variants are not supported")
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


def _window(cfg: dict) -> int | None:
    window = cfg.get("sliding_window")
    if not window or not cfg.get("use_sliding_window", cfg.get("model_type") == "mistral"):
        return None
    return int(window)


def _llama(cfg: dict) -> DecoderConfig:
    hidden, heads = int(cfg["hidden_size"]), int(cfg["num_attention_heads"])
    theta, scaling = _rope(cfg)
    return DecoderConfig(
        family=LLAMA,
        vocab_size=int(cfg["vocab_size"]),
        hidden=hidden,
        layers=int(cfg["num_hidden_layers"]),
        heads=heads,
        kv_heads=int(cfg.get("num_key_value_heads") or heads),
        head_dim=int(cfg.get("head_dim") or hidden // heads),
        intermediate=int(cfg["intermediate_size"]),
        max_positions=int(cfg.get("max_position_embeddings", 2048)),
        norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        activation=cfg.get("hidden_act", "silu"),
        tie_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        rope_theta=theta,
        rope_scaling=scaling,
        attn_bias=bool(cfg.get("attention_bias", cfg.get("model_type") == "qwen2")),
        sliding_window=_window(cfg),
        bos_token_id=cfg.get("bos_token_id"),
        eos_token_ids=_ids(cfg.get("eos_token_id")),
    )


def from_dict(cfg: dict) -> DecoderConfig:
    kind = cfg.get("model_type", "")
    if kind == "gpt2":
        return _gpt2(cfg)
    if kind in LLAMA_LIKE:
        return _llama(cfg)
    raise NotImplementedError(f"model_type {kind!r} is not a supported decoder")


def load_config(model_dir: str | Path) -> DecoderConfig:
    """From `config.json`, or from the metadata of the directory's one GGUF file."""
    from shared import gguf

    path = gguf.find_file(model_dir)
    if path is not None:
        return from_dict(gguf.hf_config(gguf.read_header(path)))
    return from_dict(json.loads((Path(model_dir) / "config.json").read_text()))
