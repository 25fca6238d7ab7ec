"""What a worker needs from an engine. Engines never see NATS; workers never see tensors.

Both JAX (the default) and torch backends implement these; the worker picks one by
`TENSORBUS_ENGINE` and nothing else in the serving layer changes.
"""

from __future__ import annotations

from typing import Protocol

import numpy as np


class Encoder(Protocol):
    """Sentence embeddings: token ids in, L2-normalised float32 vectors out."""

    name: str
    dim: int
    max_tokens: int  # longest accepted input, special tokens included
    dtype: str
    device: str  # e.g. "cpu", "cuda:0"
    max_batch: int

    def warmup(self, progress: bool = True) -> int:
        """Compile every (batch, seq) bucket; return how many were compiled."""

    def embed(self, inputs: list[list[int]]) -> np.ndarray:
        """[len(inputs), dim] float32. Inputs already tokenized (with [CLS]/[SEP]).

        Any len(inputs) is accepted: larger than max_batch is split internally.
        """
