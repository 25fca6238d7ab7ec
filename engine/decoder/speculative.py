"""Speculative decoding without a second model: prompt-lookup (n-gram) drafts,
verified in one pass (engine/decoder/verify.py). Host side.

  1. `parse("ngram:K")` -> K draft tokens per step (0: off).
  2. Before a decode step with exactly one live sequence whose output depends only
     on its logits and its seed (no penalties, logit bias or logprobs), `propose`
     looks for the latest earlier occurrence of the sequence's last 3 tokens (then
     2, then 1) in its own tokens, prompt and generated, and proposes the (at most)
     K tokens that followed it.
  3. The verify pass feeds the last token and the draft at once; the host reads how
     many drafts were accepted, and the sequence grows by those plus the bonus token
     (`PendingStep.more` holds the tokens after the first).

Looking for a draft waits for the step before (it needs that token), which gives up
the pipelining of host and device work, and a verify pass that accepts nothing costs
more than the step it replaced. So a sequence whose lookups keep finding nothing, or
whose drafts keep failing (free text), looks again only after a back-off that doubles
with each such step (1, 2, 4 ... BACKOFF_MAX steps, pipelined) and ends at the first
accepted draft; repetitive text rarely meets it. The tokens are the same either way.

Such a step is synchronous (the draft needs the tokens of the step before it, and
the next step's length needs this one's result), which is why a step without a
draft, or with several live sequences, stays the normal pipelined one. Several
sequences each speculating would need a batched verify; one stream is where the
lookup pays on a memory-bound step.
"""

from __future__ import annotations

import jax
import msgspec
import numpy as np

from engine.decoder.shapes import i32
from engine.decoder.slots import PagedSlots, PendingStep
from engine.decoder.verify import verify
from engine.interface import SpecStats
from shared.messages import Sampling

NGRAM_LONGEST, NGRAM_SHORTEST = 3, 1
BACKOFF_MAX = 16  # steps without a lookup after repeated empty lookups or verifies, at most


def parse(text: str) -> int:
    """`TENSORBUS_SPECULATIVE`'s value -> draft tokens per step (0: off); ValueError
    with what is accepted otherwise."""
    text = (text or "").strip().lower()
    if text in ("", "off", "none", "0"):
        return 0
    method, _, k = text.partition(":")
    if method == "ngram" and k.isdigit() and 1 <= int(k) <= 16:
        return int(k)
    raise ValueError(f"speculative {text!r}: use off or ngram:K (K draft tokens, 1 to 16)")


def propose(tokens: list[int], k: int, longest: int = NGRAM_LONGEST,
            shortest: int = NGRAM_SHORTEST) -> list[int]:
    """At most `k` tokens that followed the latest earlier occurrence of the last
    n tokens (n from `longest` down to `shortest`); [] when none occurs."""
    arr = np.asarray(tokens, np.int64)
    for n in range(longest, shortest - 1, -1):
        if len(arr) <= n:
            continue
        # Windows that start before the tail's own occurrence and leave a token after.
        windows = np.lib.stride_tricks.sliding_window_view(arr[:-1], n)
        hits = np.flatnonzero((windows == arr[-n:]).all(axis=1))
        if len(hits):
            start = int(hits[-1]) + n
            return arr[start : start + k].tolist()
    return []


def _plain(sampling: Sampling) -> bool:
    """Whether a sequence's tokens depend only on its logits and its seed (a grammar's
    mask depends on its tokens too: a constrained sequence takes the masked step)."""
    return (sampling.logprobs < 0 and not sampling.grammar and not sampling.presence_penalty
            and not sampling.frequency_penalty and sampling.repetition_penalty in (0.0, 1.0)
            and not any(b for _, b in sampling.logit_bias))  # fmt: skip


class SpeculativeSlots(PagedSlots):
    """`PagedSlots` with the speculative step; `DecoderEngine` calls `_init_speculation`
    after its state exists and `_speculate` first in `step_async`."""

    spec_k = 0

    def _init_speculation(self, k: int, jit_kw: dict) -> None:
        self.spec_k = int(k)
        self.spec_stats = SpecStats()
        self._plain = np.zeros(self._slots, bool)
        self._plain_released = np.zeros(self._slots, bool)  # plain once its grammar is dropped
        self._backoff = np.zeros(self._slots, np.int32)  # steps to skip after the next empty one
        self._skip = np.zeros(self._slots, np.int32)  # steps left without a draft
        self._last_step: PendingStep | None = None
        cfg, kernel = self.cfg, self.attention
        interpret = jax.devices()[0].platform == "cpu"  # as the decode step runs it
        self._verify = jax.jit(
            lambda params, state, *args: verify(params, cfg, state, *args, kernel, interpret),
            donate_argnums=1, **jit_kw)  # fmt: skip

    def speculation(self) -> SpecStats:
        s = self.spec_stats
        return SpecStats(s.steps, s.drafted, s.accepted)

    def begin(self, slot: int, prompt: list[int], sampling: Sampling, seed: int,
              generated: int = 0) -> None:
        super().begin(slot, prompt, sampling, seed, generated)
        self._plain[slot] = _plain(sampling)
        self._plain_released[slot] = _plain(msgspec.structs.replace(sampling, grammar=""))
        self._backoff[slot] = self._skip[slot] = 0

    def grammar_released(self, slot: int) -> None:
        """`slot`'s grammar was dropped (engine/decoder/grammar.py, RELEASE): it may
        speculate from now on, as a sequence that never had one."""
        self._plain[slot] = self._plain_released[slot]

    @staticmethod
    def _form_bucket(kind: str, size: int) -> str:
        """The bucket whose compute form a program runs: a verify pass is one stream's
        step."""
        return "step 1" if kind == "verify" else f"{kind} {size}"

    def _verify_compiles(self) -> list[tuple[str, int, int]]:
        return [("verify", self.spec_k + 1, w) for w in self.windows] if self.spec_k else []

    def _verify_lowering(self, params: dict, size: int, window: int):
        args = (i32(size), i32(), i32(), i32(window // self.block), i32())
        return lambda: self._verify.lower(params, self._state_spec, *args)

    def _run_verify(self, slot: int, fed, offset: int, length: int, window: int):
        fed = np.asarray(fed, np.int32)  # [T]
        table = np.array(self._tables[slot, : window // self.block])  # [NW]
        run = self._program("verify", len(fed), window)
        self._state, out = run(self._params_for("step 1"), self._state, fed, np.int32(offset),
                               np.int32(length), table, np.int32(slot))  # fmt: skip
        return out

    def _room(self, slot: int, tokens: int) -> int:
        """Blocks for `tokens` tokens of `slot`, as far as the pool has free ones (no
        preemption for a draft) -> tokens its blocks hold."""
        while self.pool.blocks_for(tokens) > len(self._held[slot]) and self.pool.available:
            b = self.pool.take()
            self._tables[slot, len(self._held[slot])] = b
            self._held[slot].append(b)
        return len(self._held[slot]) * self.block

    def _back_off(self, slot: int) -> None:
        self._backoff[slot] = min(max(2 * self._backoff[slot], 1), BACKOFF_MAX)
        self._skip[slot] = self._backoff[slot]

    def _speculate(self, preempted: list[int]) -> PendingStep | None:
        """The step as a verify pass of a draft, run to its result; None when this
        step is a normal one (see the module docstring)."""
        live = np.flatnonzero(self._active)
        if not self.spec_k or len(live) != 1 or not self._plain[live[0]]:
            return None
        slot = int(live[0])
        if self._skip[slot] > 0:  # backing off after empty lookups or verifies
            self._skip[slot] -= 1
            return None
        if self._last_step is not None:
            self._last_step.result()  # its token is the draft's last context
        tokens, length = self._tokens[slot], int(self._lengths[slot])
        if len(tokens) != length:
            return None
        k = min(self.spec_k, self._max_context - length - 1)
        draft = propose(tokens, k) if k > 0 else []
        if draft:
            draft = draft[: self._room(slot, length + len(draft)) - length]
        if not draft:  # nothing to verify, and the pipelining was given up for it
            self._back_off(slot)
            return None
        need = length + len(draft)
        size, window = self._choose("verify", self.spec_k + 1,
                                    next(w for w in self.windows if w >= need))
        fed = np.zeros(size, np.int32)  # a larger compiled pass pads the same draft
        fed[0], fed[1 : 1 + len(draft)] = tokens[-1], draft
        out = np.asarray(self._run_verify(slot, fed, length - 1, 1 + len(draft), window))
        accepted = int(out[-1])
        got = out[: accepted + 1].tolist()
        self._lengths[slot] = min(length + len(got), self._max_context)
        self._tokens[slot].extend(got)
        if accepted:
            self._backoff[slot] = 0
        else:
            self._back_off(slot)
        stats = self.spec_stats
        stats.steps, stats.drafted, stats.accepted = (
            stats.steps + 1, stats.drafted + len(draft), stats.accepted + accepted)
        done = PendingStep([np.array([[got[0]]], np.int32)], np.array([slot], np.int32),
                           self._slots, preempted)  # fmt: skip
        done.more[slot] = got[1:]
        self._last_step = done
        return done
