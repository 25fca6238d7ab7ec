"""Hand-checkable engines for serving tests: no model, exact known outputs.

MockDecoder: every generated token is its `tag`. `gate` (a threading.Event) lets a
test hold a decode step on the engine thread for as long as it likes, to create
overload, a wedged worker or a swap mid-stream. (The mock encoder, which bench/nomath.py
serves too, is bench/support/mock_encoder.py.)
"""

from __future__ import annotations

import threading

import numpy as np

from engine.interface import CacheStats, DecoderInfo, DecoderStats, SpecStats


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


class MockDecoder:
    """A hand-checkable decoder (`engine.interface.Decoder`): every token it generates
    is `tag` (so its text is one letter repeated, and two versions with other tags are
    told apart by eye). A prompt is computed whole, a row per slot: nothing to chunk,
    share or preempt. `gate` holds its decode steps on the engine thread; `entered` is
    set when one waits."""

    def __init__(self, name: str = "mock-lm", tag: int = 0, slots: int = 2,
                 max_context: int = 64) -> None:
        self.name = name
        self.tag = tag
        self.info = DecoderInfo(name=name, device="mock", devices=("mock",), dtype="float32",
                                slots=slots, max_context=max_context, vocab_size=256,
                                eos_token_ids=(), prefix_block=0,
                                tokenizer=LetterTokenizer())  # fmt: skip
        self.slots = slots
        self.max_context = max_context
        self.gate = threading.Event()
        self.gate.set()
        self.entered = threading.Event()
        self._lengths = [0] * slots
        self._active = [False] * slots
        self._begun: dict[int, int] = {}  # slot -> its prompt's length

    def warmup(self, progress: bool = True) -> int:
        return 0

    def check(self, prompt: list[int], sampling=None) -> None:
        """The mock samples nothing: every request is greedy over its script."""
        if not prompt or len(prompt) > self.max_context - 1:
            raise ValueError(f"prompt of {len(prompt)} tokens does not fit")

    def prompt_logprobs(self, tokens: list[int], top: int) -> list:
        raise ValueError("the mock decoder computes no prompt logprobs")

    def begin(self, slot: int, prompt: list[int], sampling, seed: int,
              generated: int = 0) -> bool:
        self.check(prompt)
        self._begun[slot] = len(prompt)
        return True

    def prefilling(self, slot: int) -> int:
        return self._begun.get(slot, 0)

    def prefill_step(self, slot: int, budget: int = 0, mix: bool = False) -> int | None:
        self._active[slot], self._lengths[slot] = True, self._begun.pop(slot) + 1
        return self.tag

    def make_room(self, victim) -> list[int]:
        return []

    @property
    def active_slots(self) -> int:
        return sum(self._active)

    def context_left(self, slot: int) -> int:
        return self.max_context - self._lengths[slot]

    def step_async(self) -> _Step | None:
        if not any(self._active):
            return None
        self.entered.set()
        self.gate.wait()
        for s in range(self.slots):
            if self._active[s]:
                self._lengths[s] += 1
        return _Step(np.full(self.slots, self.tag, np.int32))

    def step(self) -> np.ndarray:
        return self.step_async().result()

    def free(self, slot: int) -> None:
        self._active[slot], self._lengths[slot] = False, 0
        self._begun.pop(slot, None)

    def token_logprobs(self, slot: int) -> None:
        return None

    def stats(self, prefixes: int = 0) -> DecoderStats:
        used = sum(n for n, a in zip(self._lengths, self._active) if a)
        held = round(used / self.max_context)
        return DecoderStats(active=self.active_slots,
                            cache=CacheStats(self.slots, held, 0, 0, 0, 0), spec=SpecStats())

    def tune(self, limit: int = 1) -> int:
        return 0

    def on_compiled(self, callback) -> None:
        pass

    def close(self, wait_s: float = 0.0) -> bool:
        return True
