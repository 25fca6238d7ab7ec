"""Hand-checkable engines for serving tests: no model, exact known outputs.

MockEncoder: input i's vector is one-hot at (sum of its ids) % dim, so a test can
tell which input produced which row; it may take a fixed time per batch and per token
(sleeping on the engine thread), a model whose cost is known exactly. bench/nomath.py
serves it in a real worker process to measure the serving path alone; it lives here
because tests may not import bench/, while bench/ may use this support package.
MockDecoder: every generated token is its `tag`.
`gate` (a threading.Event) lets a test hold a batch or a decode step on the engine
thread for as long as it likes, to create overload, a wedged worker or a swap
mid-stream.
"""

from __future__ import annotations

import threading
import time

import numpy as np

from engine.interface import WholePrompt


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

    def warmup(self, progress: bool = True) -> int:
        return 0

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


class LetterTokenizer:
    """Token i is the letter chr(ord('a') + i % 26)."""

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return "".join(chr(ord("a") + i % 26) for i in ids)


class _Step:
    def __init__(self, tokens: np.ndarray) -> None:
        self._tokens = tokens
        self.more: dict[int, list[int]] = {}

    def result(self) -> np.ndarray:
        return self._tokens


class MockDecoder(WholePrompt):
    """A hand-checkable decoder: every token it generates is `tag` (so its text is
    one letter repeated, and two versions with other tags are told apart by eye).
    `gate` holds its decode steps on the engine thread; `entered` is set when one waits."""

    def prompt_logprobs(self, tokens: list[int], top: int) -> list:
        raise ValueError("the mock decoder computes no prompt logprobs")

    def check_sampling(self, sampling) -> None:
        """The mock samples nothing: every request is greedy over its script."""

    def __init__(self, name: str = "mock-lm", tag: int = 0, slots: int = 2,
                 max_context: int = 64) -> None:
        self.name = name
        self.tag = tag
        self.slots = slots
        self.max_context = max_context
        self.dtype = "float32"
        self.device = "mock"
        self.devices = ["mock"]
        self.eos_token_ids: tuple[int, ...] = ()
        self.vocab_size = 256  # the Decoder protocol's; it draws only `tag`
        self.tokenizer = LetterTokenizer()
        self.gate = threading.Event()
        self.gate.set()
        self.entered = threading.Event()
        self._lengths = [0] * slots
        self._active = [False] * slots

    def warmup(self, progress: bool = True) -> int:
        return 0

    def check_prompt(self, prompt: list[int]) -> None:
        if not prompt or len(prompt) > self.max_context - 1:
            raise ValueError(f"prompt of {len(prompt)} tokens does not fit")

    def prefill_whole(self, slot: int, prompt: list[int], sampling, seed: int) -> int:
        self._active[slot], self._lengths[slot] = True, len(prompt) + 1
        return self.tag

    @property
    def active_slots(self) -> int:
        return sum(self._active)

    @property
    def kv_usage(self) -> float:
        used = sum(n for n, a in zip(self._lengths, self._active) if a)
        return used / (self.slots * self.max_context)

    def context_left(self, slot: int) -> int:
        return self.max_context - self._lengths[slot]

    def step_async(self) -> _Step:
        self.entered.set()
        self.gate.wait()
        for s in range(self.slots):
            if self._active[s]:
                self._lengths[s] += 1
        return _Step(np.full(self.slots, self.tag, np.int32))

    def free(self, slot: int) -> None:
        self._active[slot], self._lengths[slot] = False, 0
