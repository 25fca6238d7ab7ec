"""What a worker needs from an engine. Engines never see NATS; workers never see tensors.

Both JAX (the default: `engine.encoder.JaxEncoder`, `engine.decoder.DecoderEngine`)
and torch (`engine.torch_encoder.TorchEncoder`, `engine.torch_decoder.TorchDecoder`)
backends implement these; the worker picks one by `TENSORBUS_ENGINE` and nothing
else in the serving layer changes.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

import numpy as np

if TYPE_CHECKING:
    from engine.tokenizer import Tokenizer
    from shared.messages import Sampling


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


class PendingStep(Protocol):
    """A dispatched decode step."""

    def result(self) -> np.ndarray:
        """[slots] int32: the token each slot drew (waits for the step if needed)."""


class Decoder(Protocol):
    """Text generation over a fixed set of KV-cache slots, one sequence per slot.

    The caller (the worker's continuous-batching loop) owns the slots: it starts a
    sequence with `prefill_insert`, runs `step` for all slots at once, decides when a
    sequence ends (EOS, stop string, max tokens, `context_left(slot) == 0`) and
    calls `free`. Every call comes from one thread.
    """

    name: str
    device: str  # e.g. "cpu", "cuda:0"
    tokenizer: "Tokenizer | None"  # the model's own, for detokenizing on the worker

    @property
    def slots(self) -> int:
        """Sequences that can decode at once."""

    @property
    def max_context(self) -> int:
        """Tokens per slot, prompt and generated together."""

    @property
    def vocab_size(self) -> int: ...

    @property
    def dtype(self) -> str:
        """float32 | bfloat16 | float16"""

    @property
    def eos_token_ids(self) -> tuple[int, ...]: ...

    @property
    def kv_usage(self) -> float:
        """Fraction of the cache's positions held by active sequences (0..1)."""

    @property
    def active_slots(self) -> int:
        """Slots holding a sequence (inserted and not yet freed)."""

    def warmup(self, progress: bool = True) -> int:
        """Compile (or exercise) every shape served; return how many were compiled."""

    def check_prompt(self, prompt: list[int]) -> None:
        """ValueError, with a message for the user, if `prompt` cannot be served."""

    def prefill_insert(self, slot: int, prompt: list[int], sampling: "Sampling", seed: int) -> int:
        """Run `prompt` into `slot` and return the sequence's first token. Sampling
        draws come from `seed` alone, whatever the slot and the other sequences."""

    def step(self) -> np.ndarray:
        """One decode step for every active slot -> [slots] int32 (ignore free slots)."""

    def step_async(self) -> PendingStep:
        """Start one decode step; its `result()` is what `step()` returns. A slot
        inserted before `result()` is read joins the next step, not this one."""

    def free(self, slot: int) -> None:
        """End the sequence in `slot`; the slot may be inserted into again."""

    def context_left(self, slot: int) -> int:
        """Tokens `slot` may still generate before its context is full."""

    def generate_static(self, prompts: list[list[int]], max_new: int) -> list[list[int]]:
        """Greedy, `max_new` tokens for each prompt, decoding in lock-step (benchmarks)."""
