"""A hand-checkable encoder: no model, exact known outputs. Input i's vector is
one-hot at (sum of its ids) % dim, so a test can tell which input produced which row;
it may take a fixed time per batch and per token (sleeping on the engine thread), a
model whose cost is known exactly. bench/nomath.py serves it in a real worker process
to measure the serving path alone; the tests serve it to test batching, overload and
faults. `gate` (a threading.Event) holds a batch on the engine thread for as long as
a test likes.
"""

from __future__ import annotations

import threading
import time

import numpy as np


class MockEncoder:
    """Implements engine.interface.Encoder; cost = per_batch_s + per_token_s x tokens."""

    def __init__(self, name: str = "all-MiniLM-L6-v2", dim: int = 8, max_batch: int = 64,
                 fail_on: int | None = None, per_batch_s: float = 0.0,
                 per_token_s: float = 0.0) -> None:
        self.name = name
        self.task = "embed"
        self.dim = dim
        self.normalize = True
        self.max_tokens = 256
        self.dtype = "float32"
        self.device = "mock"
        self.devices = ["mock"]
        self.max_batch = max_batch
        self.fail_on = fail_on  # a token id that makes the engine raise
        self.per_batch_s = per_batch_s
        self.per_token_s = per_token_s
        self.gate = threading.Event()
        self.gate.set()
        self.entered = threading.Event()  # set when a batch starts computing
        self.batches: list[int] = []

    def close(self, wait_s: float = 0.0) -> bool:
        return True  # nothing compiles

    def warmup(self, progress: bool = True) -> int:
        return 0

    def program_counts(self) -> tuple[int, int]:
        return 0, 0

    def embed(self, inputs: list[list[int]]) -> np.ndarray:
        self.entered.set()
        self.gate.wait()
        if self.fail_on is not None and any(self.fail_on in x for x in inputs):
            raise RuntimeError("poisoned input")
        cost = self.per_batch_s + self.per_token_s * sum(len(x) for x in inputs)
        if cost > 0:
            time.sleep(cost)
        self.batches.append(len(inputs))
        out = np.zeros((len(inputs), self.dim), np.float32)
        for i, ids in enumerate(inputs):
            out[i, sum(ids) % self.dim] = 1.0
        return out
