"""What a worker needs from an engine. Engines never see NATS; workers never see tensors.

Both JAX (the default: `engine.encoder.EncoderEngine`, `engine.decoder.DecoderEngine`)
and torch (`engine.torch_encoder.TorchEncoder`, `engine.torch_decoder.TorchDecoder`)
backends implement these; the worker picks one by `TENSORBUS_ENGINE` and nothing
else in the serving layer changes.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
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
        """Compile what it serves first; return how many programs were compiled."""

    def program_counts(self) -> tuple[int, int]:
        """(programs compiled so far, programs it serves): (0, 0) where nothing compiles."""

    def embed(self, inputs: list[list[int]]) -> np.ndarray:
        """[len(inputs), dim] float32. Inputs already tokenized (with [CLS]/[SEP]).

        Any len(inputs) is accepted: larger than max_batch is split internally.
        """

    def close(self, wait_s: float = 0.0) -> bool:
        """Compile nothing more in the background; wait up to `wait_s` for the
        program being compiled -> False while one still is."""


class Reranker(Protocol):
    """A cross-encoder: token ids of text pairs in, one score per label out. The JAX
    encoder engine implements it for *ForSequenceClassification models (BERT,
    RoBERTa, XLM-RoBERTa); workers serve it at the rerank and score endpoints."""

    name: str
    dim: int  # labels per pair (1 for ms-marco / bge-reranker style models)
    max_tokens: int  # longest pair, special tokens included

    def warmup(self, progress: bool = True) -> int: ...

    def score(self, inputs: list[list[int]], token_types: list[list[int]],
              raw: bool = False) -> np.ndarray:
        """[len(inputs), dim] float32 after the model's activation (sentence-
        transformers' CrossEncoder.predict: sigmoid for one label unless the model
        says otherwise), or with `raw` the classifier's logits before it (TEI's
        `raw_scores`). Inputs come from `Tokenizer.encode_pairs`."""

    def activate(self, logits: np.ndarray) -> np.ndarray:
        """`score(..., raw=True)`'s logits -> what `score` gives without `raw`: a
        batch of raw and activated requests is computed once."""


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


@dataclass(frozen=True)
class DecoderInfo:
    """What a decoder is, fixed when it is built."""

    name: str
    device: str  # e.g. "cpu", "cuda:0"
    devices: tuple[str, ...]  # every device it computes on, e.g. ("cpu:0", "cpu:1")
    dtype: str  # float32 | bfloat16 | float16
    slots: int  # sequences that can decode at once
    max_context: int  # tokens per slot, prompt and generated together
    vocab_size: int
    eos_token_ids: tuple[int, ...]
    prefix_block: int  # tokens per prefix key of `DecoderStats.prefixes` (0: no prefix cache)
    tokenizer: "Tokenizer | None"  # the model's own, for detokenizing on the worker


@dataclass
class DecoderStats:
    """What a decoder reports between steps (the heartbeat and the model card read it)."""

    active: int  # slots holding a live sequence
    cache: CacheStats
    spec: SpecStats
    compiled: int = 0  # programs compiled ...
    programs: int = 0  # ... of those it serves (0, 0: it compiles nothing ahead)
    compiling: bool = False  # the engine thread waits on a compile now: slow, not stuck
    compile_waited_s: float = 0.0  # seconds steps waited on compiles since start
    forms_measured: int = 0  # (bucket, form) pairs measured ...
    forms_total: int = 0  # ... of those to measure (0, 0: none measured)
    quant: str = "none"  # the stored weights, TENSORBUS_QUANT's value after `auto`
    compute_forms: dict[str, str] = field(default_factory=dict)  # bucket -> form now
    tune_due: bool = False  # `tune` has work it can do now without compiling
    prefixes: list[int] = field(default_factory=list)  # short keys of cached prefixes


Victim = Callable[[list[int]], int]
"""The preemption policy: given the slots whose sequences hold cache (oldest
first), the one to give its cache back."""


class Decoder(Protocol):
    """Text generation over a set of decode slots, one sequence per slot.

    The caller (the worker's continuous-batching loop) owns the slots and the
    policy: it starts a sequence with `begin` (False: the cache has no room now) and
    computes its prompt with `prefill_step` (a chunk per call); before each
    `step_async` it calls `make_room` with its preemption policy and re-runs the
    sequences it preempted; it decides when a sequence ends (EOS, stop string, max
    tokens, a full context) and calls `free`. Every call comes from one thread.
    (Whole prompts and lock-step batches, for tests and benchmarks:
    engine/decoder/static.py.)
    """

    info: DecoderInfo

    def warmup(self, progress: bool = True) -> int:
        """Compile what a first request needs (and, as the engine compiles ahead,
        the rest and structured outputs' programs in the background); return how
        many programs were compiled before it returned."""

    def check(self, prompt: list[int], sampling: "Sampling | None" = None) -> None:
        """ValueError, with a message for the user, if `prompt` cannot be served, or
        the request asks for sampling controls this engine does not apply."""

    def prompt_logprobs(self, tokens: list[int], top: int) -> list[tuple[int, float, list, int]]:
        """For each token after the first: (token, logprob given those before it, the
        `top` most likely (token, logprob) there, best first, the token's rank there:
        1 + how many tokens are more likely); ValueError where the engine does not
        compute them."""

    def begin(self, slot: int, prompt: list[int], sampling: "Sampling", seed: int,
              generated: int = 0) -> bool:
        """Reserve `slot` and the prompt's cache (False, nothing taken: the cache has
        no room now); `prefill_step` computes it. Sampling draws come from `seed`
        alone, whatever the slot and the other sequences. `generated`: how many of
        the prompt's last tokens a preempted sequence had generated (a grammar's
        matcher is fed them again)."""

    def prefilling(self, slot: int) -> int:
        """Prompt tokens `slot` has still to compute (0 when none)."""

    def prefill_step(self, slot: int, budget: int = 0, mix: bool = False) -> int | None:
        """Compute the next piece of `slot`'s prompt (at most `budget` tokens when the
        engine chunks and budget > 0); the first token after the last piece, else None.
        Re-running a sequence from prompt + its tokens so far draws what it would have
        drawn next (draws are keyed by seed and position). `mix`: the engine may
        compute the piece inside the next `step_async` instead (a mixed step); it
        returns None then, and a prompt that step finishes (`prefilling` 0 after it)
        is in that step, its first token in its result."""

    def make_room(self, victim: Victim) -> list[int]:
        """Cache for every live slot's next step, preempting (freeing) the sequences
        `victim` picks while the cache is short -> the slots preempted, which the
        caller re-runs later."""

    def step_async(self) -> PendingStep | None:
        """Start one decode step of the live slots (None: no slot is live); a slot
        begun before `result()` is read joins the next step, not this one."""

    def free(self, slot: int) -> None:
        """End the sequence in `slot`; the slot may be begun again."""

    def token_logprobs(self, slot: int) -> tuple[float, list[tuple[int, float]]] | None:
        """(logprob, top [(token, logprob)]) of the token `slot` got last, when its
        request asked for logprobs; else None."""

    def stats(self, prefixes: int = 0) -> DecoderStats:
        """Its counts now; `prefixes`: at most that many cached prefix keys."""

    def tune(self, limit: int = 1) -> int:
        """Between steps, on the engine thread: up to `limit` units of the work an
        engine does after ready (a quantized one measures its compute forms,
        engine/decoder/formchoice.py) -> units done."""

    def on_compiled(self, callback: Callable[[], None]) -> None:
        """`callback()` (on another thread) each time a background compile joins."""

    def close(self, wait_s: float = 0.0) -> bool:
        """Compile nothing more in the background; wait up to `wait_s` for the
        program being compiled -> False while one still is (the process should not
        exit then)."""


Engine = Encoder | Decoder
"""What a worker holds for one model version: which of the two follows the model's kind."""
