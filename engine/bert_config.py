"""BERT encoder settings read from a model directory, shared by both encoder engines.

Pure Python on purpose: the torch engine imports it without pulling in jax.
"""

from __future__ import annotations

import json
from pathlib import Path

# Accepted spellings of the three compute dtypes, mapped to the canonical name.
DTYPE_ALIASES = {
    "float32": "float32", "fp32": "float32", "f32": "float32", "float": "float32",
    "bfloat16": "bfloat16", "bf16": "bfloat16",
    "float16": "float16", "fp16": "float16", "f16": "float16", "half": "float16",
}  # fmt: skip


def canonical_dtype(name: str) -> str:
    """'bf16' -> 'bfloat16'; anything but float32/bfloat16/float16 is refused."""
    key = str(name).strip().lower().removeprefix("jnp.").removeprefix("torch.")
    if key not in DTYPE_ALIASES:
        raise ValueError(f"unknown dtype {name!r}; use float32, bfloat16 or float16")
    return DTYPE_ALIASES[key]


class BertConfig:
    """The config.json fields the math needs, plus the sentence-transformers limit."""

    def __init__(self, model_dir: str | Path) -> None:
        d = Path(model_dir)
        cfg = json.loads((d / "config.json").read_text())
        self.hidden = int(cfg["hidden_size"])
        self.heads = int(cfg["num_attention_heads"])
        self.intermediate = int(cfg.get("intermediate_size", 4 * self.hidden))
        self.layers = int(cfg["num_hidden_layers"])
        self.eps = float(cfg.get("layer_norm_eps", 1e-12))
        self.act = str(cfg.get("hidden_act", "gelu"))
        self.pad_id = int(cfg.get("pad_token_id") or 0)
        self.max_positions = int(cfg.get("max_position_embeddings", 512))
        # sentence-transformers truncates at max_seq_length (256 for MiniLM), not at
        # the tokenizer file's 128 nor the 512 positions: that is the input limit.
        st = d / "sentence_bert_config.json"
        limit = json.loads(st.read_text()).get("max_seq_length") if st.exists() else None
        self.max_tokens = min(int(limit or self.max_positions), self.max_positions)
