"""What a worker needs from an engine. Engines never see NATS; workers never see tensors.

Both JAX (the default: `engine.encoder.EncoderEngine`, `engine.decoder.DecoderEngine`)
and torch (`engine.torch_encoder.TorchEncoder`, `engine.torch_decoder.TorchDecoder`)
backends implement these; the worker picks one by `TENSORBUS_ENGINE` and nothing
else in the serving layer changes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import numpy as np

if TYPE_CHECKING:
    from engine.tokenizer import Tokenizer
    from shared.messages import Sampling


class Encoder(Protocol):
    """Sentence embeddings: token ids in, float32 vectors out, pooled (and projected,
    and L2-normalised) as the model's sentence-transformers modules say
    (engine/encoder/spec.py)."""

    name: str
    dim: int  # width of the vectors: the last Dense layer's, else pooled hidden size
    normalize: bool  # its vectors are L2-normalised (a sentence-transformers Normalize module)
    prompts: dict[str, str]  # prompt name -> prefix text the tokenizer must prepend
    default_prompt_name: str | None  # applied when a request names no prompt
    max_tokens: int  # longest accepted input, special tokens included
    dtype: str
    device: str  # e.g. "cpu", "cuda:0"
    devices: list[str]  # every device it computes on, e.g. ["cpu:0", "cpu:1"]
    max_batch: int
    task: str  # "embed"; "score" for a cross-encoder, which also implements `Reranker`

    def warmup(self, progress: bool = True) -> int:
        """Compile every (batch, seq) bucket; return how many were compiled."""

    def embed(self, inputs: list[list[int]]) -> np.ndarray:
        """[len(inputs), dim] float32. Inputs already tokenized (with [CLS]/[SEP]).

        Any len(inputs) is accepted: larger than max_batch is split internally.
        """


class Reranker(Protocol):
    """A cross-encoder: token ids of text pairs in, one score per label out. The JAX
    encoder engine implements it for *ForSequenceClassification models (BERT,
    RoBERTa, XLM-RoBERTa); workers serve it at the rerank and score endpoints."""

    name: str
    dim: int  # labels per pair (1 for ms-marco / bge-reranker style models)
    max_tokens: int  # longest pair, special tokens included

    def warmup(self, progress: bool = True) -> int: ...

    def score(self, inputs: list[list[int]], token_types: list[list[int]]) -> np.ndarray:
        """[len(inputs), dim] float32 after the model's activation (sentence-
        transformers' CrossEncoder.predict: sigmoid for one label unless the model
        says otherwise). Inputs come from `Tokenizer.encode_pairs`."""


class PendingStep(Protocol):
    """A dispatched decode step."""

    # Slot -> its further tokens, after its entry in `result()` (a speculative step's
    # accepted drafts and bonus token); empty for an engine that does not speculate.
    more: dict[int, list[int]]

    def result(self) -> np.ndarray:
        """[slots] int32: the token each slot drew (waits for the step if needed)."""


@dataclass
class CacheStats:
    """A decoder's KV cache as vLLM users read it."""

    blocks: int  # cache blocks sequences can hold (a contiguous cache: its slots)
    held: int  # blocks held by running or prefilling sequences
    cached: int  # blocks keyed by a prompt prefix, reusable by the next prompt
    queries: int  # prompt tokens looked up in the prefix cache, since start
    hits: int  # of those, tokens whose K/V was reused instead of computed
    preemptions: int  # sequences whose cache was taken back mid-decode, since start


@dataclass
class SpecStats:
    """A decoder's speculative decoding since start (all 0: off, or not supported)."""

    steps: int = 0  # verify passes run
    drafted: int = 0  # draft tokens proposed to them
    accepted: int = 0  # of those, accepted

    @property
    def acceptance(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def tokens_per_step(self) -> float:
        """Tokens a verify pass emitted on average (accepted drafts plus the bonus)."""
        return (self.accepted + self.steps) / self.steps if self.steps else 0.0


class Decoder(Protocol):
    """Text generation over a set of decode slots, one sequence per slot.

    The caller (the worker's continuous-batching loop) owns the slots: it starts a
    sequence with `begin` (when `can_admit` says the cache has room) and computes
    its prompt with `prefill_step` (a chunk per call); before each `step` for all
    slots at once it calls `make_room` and re-runs the sequences it preempted; it
    decides when a sequence ends (EOS, stop string, max tokens, `context_left(slot)
    == 0`) and calls `free`. Every call comes from one thread. (Whole prompts and
    lock-step batches, for tests and benchmarks: engine/decoder/static.py.)
    """

    name: str
    device: str  # e.g. "cpu", "cuda:0"
    devices: list[str]  # every device it computes on, e.g. ["cpu:0", "cpu:1"]
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

    def check_sampling(self, sampling: Sampling) -> None:
        """ValueError, naming them, when the request asks for controls this engine
        does not apply (never served without them)."""

    def prompt_logprobs(self, tokens: list[int], top: int) -> list[tuple[int, float, list]]:
        """For each token after the first: (token, logprob given those before it, the
        `top` most likely (token, logprob) there, best first); ValueError where the
        engine does not compute them."""

    def compile_progress(self) -> tuple[int, int]:
        """(programs compiled, programs it serves); (0, 0) for an engine that does
        not compile ahead (the model card reports it)."""

    def prepare_grammars(self) -> None:
        """After warm-up: structured outputs' tables and masked programs, built ahead
        as `compile_ahead` says (docs/decisions/0048); nothing for an engine that
        builds them where first needed."""

    def compile_wait(self) -> tuple[bool, float]:
        """(whether the engine thread is blocked on a program being compiled now: a
        step that is slow, not stuck, and the stall checks let it be; the seconds
        steps have been blocked so since start: not the model's cost)."""

    def forms_progress(self) -> tuple[int, int]:
        """((bucket, form) pairs measured, pairs to measure) of a quantized engine
        choosing its compute forms after ready (engine/decoder/formchoice.py); (0, 0)
        when it measures none (the model card reports it)."""

    def weight_forms(self) -> tuple[str, dict[str, str]]:
        """(the stored weights, TENSORBUS_QUANT's value after `auto`; each bucket's
        compute form now, e.g. {"step 16": "kernel8"}): the model card reports them."""

    def forms_due(self) -> bool:
        """Whether `measure_forms` has work it can do now without compiling."""

    def measure_forms(self, limit: int = 1) -> int:
        """Measure up to `limit` (bucket, form) pairs and switch buckets to their
        choice; between steps, on the engine thread -> pairs measured."""

    def on_compiled(self, callback) -> None:
        """`callback()` (on another thread) each time a background compile joins."""

    def close(self, wait_s: float = 0.0) -> bool:
        """Compile nothing more in the background; wait up to `wait_s` for the
        program being compiled -> False while one still is (the process should not
        exit then)."""

    def can_admit(self, prompt: list[int]) -> bool:
        """Whether the cache has room to `begin` this prompt now."""

    def begin(self, slot: int, prompt: list[int], sampling: "Sampling", seed: int,
              generated: int = 0) -> None:
        """Reserve `slot` and the prompt's cache; `prefill_step` computes it. Sampling
        draws come from `seed` alone, whatever the slot and the other sequences.
        `generated`: how many of the prompt's last tokens a preempted sequence had
        generated (a grammar's matcher is fed them again)."""

    def prefilling(self, slot: int) -> int:
        """Prompt tokens `slot` has still to compute (0 when none)."""

    def prefill_step(self, slot: int, budget: int = 0) -> int | None:
        """Compute the next piece of `slot`'s prompt (at most `budget` tokens when the
        engine chunks and budget > 0); the first token after the last piece, else None.
        Re-running a sequence from prompt + its tokens so far draws what it would have
        drawn next (draws are keyed by seed and position)."""

    def make_room(self) -> list[int]:
        """Cache for every live slot's next step; the slots preempted (and freed) to
        find it, which the caller re-runs later."""

    def cache_stats(self) -> CacheStats: ...

    def speculation(self) -> SpecStats:
        """Its speculative decoding counts, since start."""

    def held_prefixes(self, limit: int) -> list[int]:
        """Short keys (shared.prefix) of the prompt prefixes cached, at most `limit`."""

    @property
    def prefix_block(self) -> int:
        """Tokens per prefix key of `held_prefixes` (0: no prefix cache)."""

    def step(self) -> np.ndarray:
        """One decode step for every active slot -> [slots] int32 (ignore free slots)."""

    def step_async(self) -> PendingStep:
        """Start one decode step; its `result()` is what `step()` returns. A slot
        inserted before `result()` is read joins the next step, not this one."""

    def free(self, slot: int) -> None:
        """End the sequence in `slot`; the slot may be inserted into again."""

    def context_left(self, slot: int) -> int:
        """Tokens `slot` may still generate before its context is full."""


Engine = Encoder | Decoder
"""What a worker holds for one model version: which of the two follows the model's kind."""


class WholePrompt:
    """`begin`/`prefill_step` for an engine that computes a prompt in one call into a
    cache with a row per slot (nothing to chunk, share or preempt): the torch engine
    and test doubles. Needs `check_prompt`, `prefill_whole(slot, prompt, sampling,
    seed) -> first token`, `slots` and `kv_usage`."""

    def compile_progress(self) -> tuple[int, int]:
        return (0, 0)  # nothing compiled ahead

    def compile_wait(self) -> tuple[bool, float]:
        return False, 0.0  # nothing compiled

    def prepare_grammars(self) -> None:
        pass  # no masked programs

    def forms_progress(self) -> tuple[int, int]:
        return (0, 0)  # one compute form

    def weight_forms(self) -> tuple[str, dict[str, str]]:
        return ("none", {})  # float weights, one form

    def forms_due(self) -> bool:
        return False

    def measure_forms(self, limit: int = 1) -> int:
        return 0

    def on_compiled(self, callback) -> None:
        pass

    def close(self, wait_s: float = 0.0) -> bool:
        return True  # nothing compiles in the background

    def can_admit(self, prompt: list[int]) -> bool:
        return True

    def begin(self, slot: int, prompt: list[int], sampling: "Sampling", seed: int,
              generated: int = 0) -> None:  # no grammar here (check_sampling refuses it)
        self.check_prompt(prompt)
        self.__dict__.setdefault("_begun", {})[slot] = (list(prompt), sampling, seed)

    def prefilling(self, slot: int) -> int:
        job = self.__dict__.get("_begun", {}).get(slot)
        return len(job[0]) if job else 0

    def prefill_step(self, slot: int, budget: int = 0) -> int | None:
        prompt, sampling, seed = self._begun.pop(slot)
        return self.prefill_whole(slot, prompt, sampling, seed)

    def make_room(self) -> list[int]:
        return []

    prefix_block = 0  # no prefix cache: nothing to route by

    def held_prefixes(self, limit: int) -> list[int]:
        return []

    def cache_stats(self) -> CacheStats:
        held = round(self.kv_usage * self.slots)
        return CacheStats(self.slots, held, 0, 0, 0, 0)

    def speculation(self) -> SpecStats:
        return SpecStats()  # never speculates
