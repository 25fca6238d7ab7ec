"""A hand-checkable encoder for scheduling tests: no model, exact known outputs.

Input i's vector is one-hot at (sum of its ids) % dim, so a test can tell which
input produced which row. `gate` (a threading.Event) lets a test hold a batch on the
engine thread for as long as it likes, to create overload or a wedged worker.
"""

from __future__ import annotations

import threading

import numpy as np


class MockEncoder:
    def __init__(self, name: str = "all-MiniLM-L6-v2", dim: int = 8, max_batch: int = 64,
                 fail_on: int | None = None) -> None:
        self.name = name
        self.dim = dim
        self.max_tokens = 256
        self.dtype = "float32"
        self.device = "mock"
        self.max_batch = max_batch
        self.fail_on = fail_on  # a token id that makes the engine raise
        self.gate = threading.Event()
        self.gate.set()
        self.entered = threading.Event()  # set when a batch starts computing
        self.batches: list[int] = []

    def warmup(self, progress: bool = True) -> int:
        return 0

    def embed(self, inputs: list[list[int]]) -> np.ndarray:
        self.entered.set()
        self.gate.wait()
        if self.fail_on is not None and any(self.fail_on in x for x in inputs):
            raise RuntimeError("poisoned input")
        self.batches.append(len(inputs))
        out = np.zeros((len(inputs), self.dim), np.float32)
        for i, ids in enumerate(inputs):
            out[i, sum(ids) % self.dim] = 1.0
        return out
