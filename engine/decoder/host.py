"""What both decoders (JAX `engine.decoder.DecoderEngine`, torch
`engine.torch_decoder.TorchDecoder`) keep on the host alike: the model's config and
tokenizer, the context capped to what the model can attend to, the prompt checks,
and per slot its length and whether it is live.

A subclass computes; this base only says what a slot holds: `_lengths` (tokens in
context per slot) and `_active` (live: part of decode steps), which the subclass
sets when a prompt's last piece is computed (`_start`), grows in `step_async`
(`_advance`) and clears in `free` (`_clear`).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from engine.decoder.config import DecoderConfig
from shared.logging import get_logger

log = get_logger(__name__)


def capped_context(cfg: DecoderConfig, requested: int) -> int:
    """`requested` tokens per slot, at most the model's positions (a sliding window
    is served by masking, not by capping the context at it)."""
    limit = cfg.max_positions
    if requested > limit:
        log.warning("max_context_capped", requested=requested, limit=limit)
    context = min(int(requested), limit)
    if context < 2:
        raise ValueError("max_context must be at least 2")
    return context


def load_tokenizer(model_dir: Path):
    """The model's own tokenizer (tokenizer.json, or a GGUF file's vocabulary), or None."""
    from engine.tokenizer import Tokenizer, has_tokenizer

    return Tokenizer.from_dir(model_dir) if has_tokenizer(model_dir) else None


class DecoderHost:
    """The host side both decoders share; see the module docstring."""

    devices: list[str]  # every device the engine computes on, e.g. ["cpu:0", "cpu:1"]
    device: str  # the first of them as the heartbeat names it, e.g. "cpu", "cuda:0"

    def __init__(self, model_dir: str | Path, name: str, cfg: DecoderConfig, dtype: str,
                 slots: int, max_context: int) -> None:
        self.name = name
        self.model_dir = Path(model_dir)
        self.cfg = cfg
        self._max_context = capped_context(cfg, max_context)
        self._slots = int(slots)
        self._dtype = dtype
        self.tokenizer = load_tokenizer(self.model_dir)
        self._lengths = np.zeros(self._slots, np.int64)  # tokens in context per slot
        self._active = np.zeros(self._slots, bool)  # live: part of decode steps

    # ------------------------------------------------------------- properties
    @property
    def slots(self) -> int:
        return self._slots

    @property
    def max_context(self) -> int:
        return self._max_context

    @property
    def vocab_size(self) -> int:
        return self.cfg.vocab_size

    @property
    def dtype(self) -> str:
        return self._dtype

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        if self.tokenizer is not None and self.tokenizer.eos_token_ids:
            return tuple(self.tokenizer.eos_token_ids)
        return self.cfg.eos_token_ids

    @property
    def active_slots(self) -> int:
        return int(self._active.sum())

    def context_left(self, slot: int) -> int:
        """Tokens `slot` can still generate before its context is full."""
        return int(self._max_context - self._lengths[slot])

    # -------------------------------------------------------------- requests
    def check_slot(self, slot: int) -> None:
        if not 0 <= slot < self._slots:
            raise ValueError(f"slot {slot} out of range [0, {self._slots})")

    def check_prompt(self, prompt: list[int]) -> None:
        """ValueError, with a message for the user, if `prompt` cannot be served."""
        if not prompt:
            raise ValueError("prompt is empty: at least one token is needed")
        if len(prompt) > self._max_context - 1:
            raise ValueError(
                f"prompt has {len(prompt)} tokens; {self.name} accepts at most "
                f"{self._max_context - 1} (context {self._max_context}, one token "
                f"left to generate)"
            )

    def check_sampling(self, sampling) -> None:
        """ValueError naming the sampling controls this engine does not apply (the
        JAX engine applies every one)."""

    def prompt_logprobs(self, tokens: list[int], top: int) -> list[tuple[int, float, list]]:
        """Each prompt token's logprob given those before it, and the `top` most
        likely there (engine/decoder/scoring.py); one pass, no slot touched."""
        from engine.decoder.scoring import prompt_logprobs

        return prompt_logprobs(self.params, self.cfg, tokens, top)

    def step(self) -> np.ndarray:
        """One decode step for every slot -> [slots] int32 (free slots: ignore)."""
        return self.step_async().result()

    def _start(self, slot: int, prompt_length: int) -> None:
        """`slot` is live with its prompt and first token in context."""
        self._active[slot] = True
        self._lengths[slot] = prompt_length + 1

    def _advance(self) -> None:
        """A decode step was dispatched: every live slot holds one more token."""
        self._lengths[self._active] = np.minimum(self._lengths[self._active] + 1,
                                                 self._max_context)  # fmt: skip

    def _clear(self, slot: int) -> None:
        self._active[slot] = False
        self._lengths[slot] = 0
