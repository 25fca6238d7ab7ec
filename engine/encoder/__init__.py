"""Encoder engine: BERT, RoBERTa / XLM-RoBERTa, MPNet and ModernBERT sentence encoders
and cross-encoders, and decoder-based embedders, in JAX.

  config.py  the config.json fields the math needs, dtypes, MPNet's position buckets
  spec.py    how the model was trained to be used: sentence-transformers' pooling,
             Dense, Normalize and prompts, or a cross-encoder's head
  params.py  weights -> the parameter pytree
  model.py   the forward functions: `forward` (embeddings), `score_forward` (pairs)
  modernbert.py  ModernBERT's weights, transformer and classifier head
  engine.py  `EncoderEngine`, what a worker calls

config.py and spec.py are pure Python: the worker's checks, the registry's push and
the torch engine read them without jax, so `EncoderEngine` is imported on first use.
"""

from __future__ import annotations

from typing import Any

__all__ = ["EncoderEngine"]


def __getattr__(name: str) -> Any:
    if name == "EncoderEngine":
        from engine.encoder.engine import EncoderEngine

        return EncoderEngine
    raise AttributeError(f"module 'engine.encoder' has no attribute {name!r}")
