"""Structured outputs on the host: one llguidance matcher per constrained slot, and
the token masks the engine's own programs apply inside the step (docs/decisions/0048,
0072: the mask is an argument of every step and prefill program, all set for a row
with no grammar, so structured outputs compile nothing of their own).

  1. `begin(slot, grammar, replay)`: a request's grammar (llguidance's JSON form,
     built and validated by the gateway) is noted; nothing is compiled on the
     caller's thread (the scheduler calls `begin` from the event loop).
  2. `first_mask(slot)`, from `prefill_step` on the engine thread: the matcher is
     built (a copy of the one compiled when the grammar was first seen; a preempted
     sequence's generated tokens, `replay`, fed back to it) and
     the mask of its first token computed; the last prompt chunk applies it.
  3. Every token a constrained slot gets (the prefill's first, each step's as it
     reaches the host) advances its matcher (`consume`).
  4. `step_program`: a step with no constrained row passes the all-set mask kept on
     the device: no host work, no wait. A step with one first reads the step before
     it (the tokens the masks depend on; so constrained steps do not overlap the
     host's work with the device's), then computes every constrained row's mask at
     once (llguidance's executor, on its own threads; the GIL is released);
     unconstrained rows get an all-allowed mask.

`min_tokens` (vLLM's) rides the same masks: a slot that must still generate k tokens
counts as constrained, its mask (all set without a grammar) has EOS and its stop
token ids cleared, and each token it gets counts down; at 0 it is unconstrained again.

A grammar may mark the point after which it constrains nothing (`tool_choice:
"auto"`'s, once a plain answer has begun: services/gateway/tool_auto.py) with a
capture named RELEASE: when its matcher reports that capture, the slot's grammar is
dropped and its next steps run as any unconstrained sequence's (`released` counts
them).

When a grammar is complete the matcher allows only EOS, so the sequence ends as
any other does at EOS, with finish_reason "stop". A matcher in an error state
(it cannot be, fed only tokens its masks allowed; guarded anyway) leaves its row
unconstrained rather than masking every token.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from typing import TYPE_CHECKING

import numpy as np

from engine.decoder.sampling import mask_words
from shared.logging import get_logger
from shared.messages import GRAMMAR_RELEASE as RELEASE

if TYPE_CHECKING:
    from llguidance import LLExecutor, LLMatcher, LLTokenizer

log = get_logger(__name__)

COMPILED_KEPT = 64  # compiled grammars kept for the next sequence that brings one again


class SlotGrammars:
    """The matchers of one engine's slots; see the module docstring."""

    def __init__(self, name: str, slots: int, vocab: int, tokenizer, eos: tuple[int, ...],
                 on_release: Callable[[int], None]) -> None:
        """tokenizer: the model's (engine.tokenizer.Tokenizer, or None: no structured
        outputs); on_release(slot): a grammar was dropped at its RELEASE capture."""
        self.name = name
        self._vocab = vocab
        self._model_tokenizer = tokenizer
        self._eos = list(eos)
        self._on_release = on_release
        self._spec = [""] * slots  # slot -> its grammar ("" = unconstrained)
        self._ban = [0] * slots  # slot -> tokens it must still generate before it may end
        self._banned: list[list[int]] = [[] for _ in range(slots)]  # EOS and its stop ids
        self._releasable = [False] * slots  # its grammar has the RELEASE capture
        self._replay: list[list[int]] = [[] for _ in range(slots)]
        self._matchers: list[LLMatcher | None] = [None] * slots
        self._compiled: OrderedDict[str, LLMatcher] = OrderedDict()  # grammar -> pristine one
        self._pending = None  # the last step dispatched (its tokens feed the masks)
        self._tokenizer: LLTokenizer | None = None  # built at the first grammar
        self._executor: LLExecutor | None = None  # ... with it
        self._lock = threading.Lock()
        self.syncs = 0  # steps read early because a constrained step needed their tokens
        self.masked_steps = 0  # step parts run with a grammar's mask
        self.masks = 0  # masks computed (rows), for the mask's cost per token
        self.mask_seconds = 0.0
        self.released = 0  # sequences whose grammar was dropped at its RELEASE capture
        self.compiles = 0  # grammars compiled (the others' matchers are copies)

    # ------------------------------------------------------------- sequences
    def begin(self, slot: int, grammar: str, replay: list[int], min_tokens: int = 0,
              stop_ids: list[int] | tuple[int, ...] = ()) -> None:
        """`min_tokens`: tokens before EOS and `stop_ids` may be drawn (0: none)."""
        self._ban[slot] = int(min_tokens)
        self._banned[slot] = [t for t in (*self._eos, *stop_ids) if 0 <= t < self._vocab]
        self._spec[slot] = grammar
        self._releasable[slot] = RELEASE in grammar
        self._replay[slot] = list(replay) if grammar else []
        self._matchers[slot] = None

    def free(self, slot: int) -> None:
        self._ban[slot] = 0
        self._spec[slot] = ""
        self._releasable[slot] = False
        self._replay[slot] = []
        self._matchers[slot] = None

    def consume(self, slot: int, token: int) -> None:
        if self._ban[slot] > 0:
            self._ban[slot] -= 1
        m = self._matchers[slot]
        if m is not None and not m.is_stopped():
            m.consume_token(token)
            self._release_if_done(slot)

    def _release_if_done(self, slot: int) -> bool:
        """Drop `slot`'s grammar when it has reached its RELEASE capture."""
        m = self._matchers[slot]
        if not self._releasable[slot] or m is None or m.get_capture(RELEASE) is None:
            return False
        self.free(slot)
        self.released += 1
        self._on_release(slot)  # it may speculate now
        return True

    @property
    def width(self) -> int:
        return mask_words(self._vocab)  # the programs' (llguidance's n_vocab is the same)

    def tokenizer(self):
        with self._lock:
            return self._tokenizer_locked()

    def _tokenizer_locked(self):
        if self._tokenizer is None:
            import llguidance

            if self._model_tokenizer is None:
                raise ValueError(f"{self.name} has no tokenizer: no structured outputs")
            self._tokenizer = llguidance.LLTokenizer(
                self._model_tokenizer.backend.to_str(), n_vocab=self._vocab,
                eos_token=self._eos)
            self._executor = llguidance.LLExecutor()
        return self._tokenizer

    def first_mask(self, slot: int) -> np.ndarray | None:
        """[W] int32: the mask of `slot`'s first token (its matcher built now), or
        None when it has no grammar."""
        if not self._spec[slot]:
            return self._fill(np.asarray([slot], np.int32))[0] if self._ban[slot] else None
        m = self._matcher(self._spec[slot])
        if self._replay[slot] and not m.consume_tokens(self._replay[slot]):
            log.warning("grammar_replay_failed", slot=slot, error=m.get_error())
        self._matchers[slot] = m
        if self._release_if_done(slot):  # a preempted plain answer, past its release
            return None
        return self._fill(np.asarray([slot], np.int32))[0]

    def _matcher(self, grammar: str):
        """A fresh matcher of `grammar`: a copy of the one compiled at its first use
        (a request's tools or schema usually come again; a copy costs microseconds,
        a compile milliseconds of the engine thread). The last COMPILED_KEPT kept."""
        pristine = self._compiled.get(grammar)
        if pristine is None:
            import llguidance

            pristine = llguidance.LLMatcher(self.tokenizer(), grammar, log_level=0)
            if pristine.is_error():
                raise ValueError(f"the grammar does not compile: {pristine.get_error()}")
            self.compiles += 1
            self._compiled[grammar] = pristine
            if len(self._compiled) > COMPILED_KEPT:
                self._compiled.popitem(last=False)
        else:
            self._compiled.move_to_end(grammar)
        return pristine.deep_copy()

    def _fill(self, rows: np.ndarray) -> np.ndarray:
        """[len(rows), W] int32 masks: all allowed except for constrained rows."""
        from llguidance.numpy import fill_next_token_bitmask_par

        out = np.full((len(rows), self.width), -1, np.int32)
        todo = [(m, i) for i, s in enumerate(rows.tolist())
                if s < len(self._spec) and (m := self._matchers[s]) is not None
                and not m.is_error()]  # fmt: skip
        if todo:
            assert self._executor is not None  # made with the tokenizer every matcher needs
            t0 = time.perf_counter()
            fill_next_token_bitmask_par(self._executor, todo, out)
            self.mask_seconds += time.perf_counter() - t0
            self.masks += len(todo)
            for _, i in todo:  # never a row with nothing allowed (the draw needs one)
                if not out[i].any():
                    out[i] = -1
        for i, s in enumerate(rows.tolist()):
            if s < len(self._ban) and self._ban[s] > 0:
                self._clear(out[i], self._banned[s])
        return out

    @staticmethod
    def _clear(mask: np.ndarray, tokens: list[int]) -> None:
        """Clear `tokens`' bits in one row's mask ([W] int32, bit t of word t // 32),
        unless that would leave nothing allowed."""
        kept = mask.copy()
        for t in tokens:
            kept[t >> 5] &= ~np.int32(np.uint32(1 << (t & 31)).view(np.int32))
        if kept.any():
            mask[:] = kept

    # ----------------------------------------------------------------- steps
    def dispatched(self, pending) -> None:
        self._pending = pending

    def constrained(self, rows: np.ndarray) -> bool:
        slots = len(self._spec)
        return any(s < slots and (self._spec[s] or self._ban[s]) for s in rows.tolist())

    def step_masks(self, rows: np.ndarray, allowed):
        """A mixed step's masks for `rows` ([R] slots; the dummy row's index pads):
        `allowed` (the all-set masks on the device) when no row is constrained, else
        computed here after the step before is read, as `step_program` does. A last
        prompt chunk's row gets its first mask (`first_mask` built its matcher)."""
        if not self.constrained(rows):
            return allowed
        self._read_pending()
        self.masked_steps += 1
        return self._fill(np.asarray(rows))

    def _read_pending(self) -> None:
        """Read the step before (its tokens advance the matchers the masks come from)."""
        if self._pending is not None:
            self._pending.result()
            self._pending = None
            self.syncs += 1

    def step_program(self, run, allowed, rows: np.ndarray):
        """The step to call for `rows` ([parts x B] slots) as (params, state, part,
        tables, live): `run` with `allowed` (the all-set masks) when no row is
        constrained, else with each part's masks computed here."""
        if not self.constrained(rows):
            return lambda params, state, part, tables, live: run(params, state, part, tables,
                                                                 live, allowed)  # fmt: skip
        self._read_pending()

        def masked(params, state, part, tables, live):
            self.masked_steps += 1
            return run(params, state, part, tables, live, self._fill(np.asarray(part)))

        return masked
