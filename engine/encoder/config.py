"""BERT encoder settings read from a model directory, shared by both encoder engines.

Pure Python on purpose: the torch engine and the worker's checks import it without
pulling in jax.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

from engine import prequant
from engine.encoder.spec import UnsupportedEncoder, pooled_dim, read_spec
from shared.catalog import encoder_limit

if TYPE_CHECKING:
    import numpy as np

# The transformer's MLP activations both engines compute (config.json `hidden_act`).
ACTIVATIONS = ("gelu", "gelu_new", "gelu_pytorch_tanh", "gelu_fast", "relu")

# Accepted spellings of the three compute dtypes, mapped to the canonical name.
# Where each family keeps a layer's weights, under `encoder.layer.{i}.`: our role ->
# its Hugging Face name (RoBERTa and XLM-R use BERT's).
LAYER_NAMES = {
    "bert": {"q": "attention.self.query", "k": "attention.self.key",
             "v": "attention.self.value", "o": "attention.output.dense",
             "ln1": "attention.output.LayerNorm", "i": "intermediate.dense",
             "f": "output.dense", "ln2": "output.LayerNorm"},
    "mpnet": {"q": "attention.attn.q", "k": "attention.attn.k", "v": "attention.attn.v",
              "o": "attention.attn.o", "ln1": "attention.LayerNorm", "i": "intermediate.dense",
              "f": "output.dense", "ln2": "output.LayerNorm"},
}  # fmt: skip
# MPNet's relative position bias: buckets and the distance past which they are shared
# (fixed in Hugging Face's MPNetEncoder.compute_position_bias, whatever the config).
MPNET_BUCKETS, MPNET_MAX_DISTANCE = 32, 128


def relative_buckets(s: int) -> np.ndarray:
    """[S, S] int32: MPNet's (T5's bidirectional) bucket of key j for query i, computed
    as Hugging Face computes it, in float32, so that the boundaries (distances 16,
    32, 64) fall in the same bucket. numpy only: both engines call it."""
    import numpy as np

    n = np.arange(s)[:, None] - np.arange(s)[None, :]  # query - key
    half = MPNET_BUCKETS // 2
    out = (n < 0).astype(np.int64) * half
    n = np.abs(n)
    exact = half // 2
    with np.errstate(divide="ignore"):
        scaled = (np.log(n.astype(np.float32) / np.float32(exact))
                  / np.float32(np.log(MPNET_MAX_DISTANCE / exact)) * np.float32(half - exact))
    large = np.minimum(exact + np.where(n < exact, 0, scaled).astype(np.int64), half - 1)
    return (out + np.where(n < exact, n, large)).astype(np.int32)


class BertConfig:
    """The config.json fields the math needs, the family's position numbering, the
    sentence-transformers limit, and how the model pools (engine/encoder/spec.py).
    Raises `UnsupportedEncoder` (a ValueError) for a model the engines do not serve."""

    def __init__(self, model_dir: str | Path) -> None:
        d = Path(model_dir)
        cfg = json.loads((d / "config.json").read_text())
        self.spec = read_spec(d)  # refuses an unserved family or module first
        try:  # AWQ, GPTQ, ... (engine/prequant.py); FP8 weights are dequantized at load
            prequant.scheme(cfg)
        except prequant.UnsupportedQuantization as exc:
            raise UnsupportedEncoder(str(exc)) from None
        self.family = self.spec.family
        if self.family == "decoder":
            self._decoder(d, cfg)
            return
        if self.family == "modernbert":
            self._modernbert(d, cfg)
            return
        self.hidden = int(cfg["hidden_size"])
        self.heads = int(cfg["num_attention_heads"])
        self.intermediate = int(cfg.get("intermediate_size", 4 * self.hidden))
        self.layers = int(cfg["num_hidden_layers"])
        self.eps = float(cfg.get("layer_norm_eps", 1e-12))
        self.act = str(cfg.get("hidden_act", "gelu"))
        if self.act not in ACTIVATIONS:
            raise UnsupportedEncoder(f"hidden_act {self.act!r} is not one of {', '.join(ACTIVATIONS)}")
        position_type = cfg.get("position_embedding_type", "absolute")
        if position_type != "absolute":
            raise UnsupportedEncoder(f"position_embedding_type {position_type!r}: the encoder "
                                     f"engines add learned absolute positions only")  # fmt: skip
        self.pad_id = int(cfg.get("pad_token_id") or 0)
        self.max_positions = int(cfg.get("max_position_embeddings", 512))
        # RoBERTa / XLM-R number real tokens from padding_idx + 1 (right padding, so
        # token i sits at position offset + i); BERT from 0.
        # MPNet: the same numbering, from its fixed padding_idx 1.
        self.position_offset = {"roberta": self.pad_id + 1, "mpnet": 2}.get(self.family, 0)
        self.names = LAYER_NAMES["mpnet" if self.family == "mpnet" else "bert"]
        self.dim = pooled_dim(self.spec, self.hidden)  # width of the served vectors
        # sentence-transformers truncates at max_seq_length (256 for MiniLM), not at
        # the tokenizer file's 128 nor the 512 positions: that is the input limit.
        self.max_tokens = encoder_limit(d, cfg)

    def _decoder(self, d: Path, cfg: dict) -> None:
        """A decoder-based embedder: the decoder engine's own config (pure Python)
        for its layers, the head and limit as any encoder's."""
        import dataclasses

        from engine.decoder.config import UnsupportedDecoder, from_dict

        try:  # no lm head: the last hidden states are what it pools
            self.decoder = dataclasses.replace(from_dict(cfg), tie_embeddings=True)
        except UnsupportedDecoder as exc:
            raise UnsupportedEncoder(str(exc)) from None
        except KeyError as exc:
            raise UnsupportedEncoder(f"config.json lacks {exc} for a decoder-based embedder") from None
        self.hidden, self.heads = self.decoder.hidden, self.decoder.heads
        self.intermediate, self.layers = self.decoder.intermediate, self.decoder.layers
        self.pad_id = int(cfg.get("pad_token_id") or 0)
        self.dim = pooled_dim(self.spec, self.hidden)
        self.max_tokens = encoder_limit(d, cfg)

    def _modernbert(self, d: Path, cfg: dict) -> None:
        """ModernBERT (engine/encoder/modernbert.py): pre-norm layers, rotary positions
        with one theta for global layers and another for local (sliding-window) ones,
        GeGLU MLPs, LayerNorms and dense layers with or without biases. Both the
        configs on the hub (`global_attn_every_n_layers`, `global_rope_theta`) and
        those transformers >= 5 writes (`layer_types`, `rope_parameters`) are read."""
        self.hidden = int(cfg.get("hidden_size", 768))
        self.heads = int(cfg.get("num_attention_heads", 12))
        self.intermediate = int(cfg.get("intermediate_size", 1152))
        self.layers = int(cfg.get("num_hidden_layers", 22))
        self.eps = float(cfg.get("norm_eps", 1e-5))
        self.act = str(cfg.get("hidden_activation", "gelu"))
        self.head_act = str(cfg.get("classifier_activation", "gelu"))
        for what, act in (("hidden_activation", self.act), ("classifier_activation", self.head_act)):
            if act not in ACTIVATIONS:
                raise UnsupportedEncoder(f"ModernBERT {what} {act!r} is not one of "
                                         f"{', '.join(ACTIVATIONS)}")  # fmt: skip
        self.classifier_pooling = str(cfg.get("classifier_pooling", "cls"))
        if self.classifier_pooling not in ("cls", "mean"):
            raise UnsupportedEncoder(f"ModernBERT classifier_pooling "
                                     f"{self.classifier_pooling!r}: cls or mean are served")
        every = int(cfg.get("global_attn_every_n_layers") or 3)
        types = cfg.get("layer_types") or ["full_attention" if i % every == 0 else
                                           "sliding_attention" for i in range(self.layers)]
        self.global_layers = tuple(t == "full_attention" for t in types)  # per layer
        self.window = int(cfg.get("local_attention", 128)) // 2  # sees +/- this many tokens
        self.rope_theta = _rope_thetas(cfg)  # (global, local)
        self.pad_id = int(cfg.get("pad_token_id") or 0)
        self.max_positions = int(cfg.get("max_position_embeddings", 8192))
        self.position_offset = 0
        self.dim = pooled_dim(self.spec, self.hidden)
        self.max_tokens = encoder_limit(d, cfg)


def check_plain_bert(cfg: BertConfig) -> None:
    """UnsupportedEncoder unless the engines beside JAX's (torch, onnx) compute `cfg`:
    a sentence embedder of the BERT families, not a cross-encoder, a decoder-based
    embedder or ModernBERT (engine/torch_encoder.py writes that math once)."""
    if cfg.spec.task != "embed":
        raise UnsupportedEncoder("cross-encoders (rerankers) are scored by the JAX "
                                 "engine only: TENSORBUS_ENGINE=jax")  # fmt: skip
    if cfg.family == "decoder":
        raise UnsupportedEncoder("decoder-based embedders are computed by the JAX "
                                 "engine only: TENSORBUS_ENGINE=jax")  # fmt: skip
    if cfg.family == "modernbert":
        raise UnsupportedEncoder("ModernBERT is computed by the JAX engine only: "
                                 "TENSORBUS_ENGINE=jax")  # fmt: skip


def _rope_thetas(cfg: dict) -> tuple[float, float]:
    """ModernBERT's (global, local) RoPE bases; only unscaled RoPE is computed."""
    params = cfg.get("rope_parameters") or {}
    scaled = [p.get("rope_type") for p in params.values() if isinstance(p, dict)]
    if cfg.get("rope_scaling") or any(t not in (None, "default") for t in scaled):
        raise UnsupportedEncoder("ModernBERT with rope scaling is not computed by the encoder "
                                 "engine (plain rotary positions only)")  # fmt: skip
    full = (params.get("full_attention") or {}).get("rope_theta")
    glob = float(full or cfg.get("global_rope_theta") or 160000.0)
    local = (params.get("sliding_attention") or {}).get("rope_theta")
    local = local or cfg.get("local_rope_theta", 10000.0)
    return glob, float(local if local is not None else glob)  # None: the global base
