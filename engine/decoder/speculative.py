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

import msgspec
import numpy as np

from engine.decoder.compiled import StepPrograms
from engine.decoder.runner import PendingStep, StepRunner
from engine.decoder.slots import SlotTable
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
    mask depends on its tokens too: a constrained sequence takes the normal step, under its mask)."""
    return (sampling.logprobs < 0 and not sampling.grammar and not sampling.min_tokens
            and not sampling.presence_penalty
            and not sampling.frequency_penalty and sampling.repetition_penalty in (0.0, 1.0)
            and not any(b for _, b in sampling.logit_bias))  # fmt: skip


class Speculation:
    """Prompt-lookup speculation over one engine's slot table and runner."""

    def __init__(self, k: int, table: SlotTable, programs: StepPrograms,
                 runner: StepRunner) -> None:
        self.k = int(k)
        self.table = table
        self.programs = programs
        self.runner = runner
        self.stats = SpecStats()
        slots = table.slots
        self._plain = np.zeros(slots, bool)
        self._plain_released = np.zeros(slots, bool)  # plain once its grammar is dropped
        self._backoff = np.zeros(slots, np.int32)  # steps to skip after the next empty one
        self._skip = np.zeros(slots, np.int32)  # steps left without a draft

    def counts(self) -> SpecStats:
        s = self.stats
        return SpecStats(s.steps, s.drafted, s.accepted)

    def begin(self, slot: int, sampling: Sampling) -> None:
        self._plain[slot] = _plain(sampling)
        self._plain_released[slot] = _plain(msgspec.structs.replace(sampling, grammar=""))
        self._backoff[slot] = self._skip[slot] = 0

    def released(self, slot: int) -> None:
        """`slot`'s grammar was dropped (engine/decoder/grammar.py, RELEASE): it may
        speculate from now on, as a sequence that never had one."""
        self._plain[slot] = self._plain_released[slot]

    def _back_off(self, slot: int) -> None:
        self._backoff[slot] = min(max(2 * self._backoff[slot], 1), BACKOFF_MAX)
        self._skip[slot] = self._backoff[slot]

    def step(self) -> PendingStep | None:
        """The step as a verify pass of a draft, run to its result; None when this
        step is a normal one (see the module docstring)."""
        table = self.table
        live = np.flatnonzero(table.active)
        if not self.k or len(live) != 1 or not self._plain[live[0]]:
            return None
        slot = int(live[0])
        if self._skip[slot] > 0:  # backing off after empty lookups or verifies
            self._skip[slot] -= 1
            return None
        if self.runner.last is not None:
            self.runner.last.result()  # its token is the draft's last context
        tokens, length = table.tokens[slot], int(table.lengths[slot])
        if len(tokens) != length:
            return None
        k = min(self.k, table.max_context - length - 1)
        draft = propose(tokens, k) if k > 0 else []
        if draft:  # as far as the pool has blocks for it: no preemption for a draft
            draft = draft[: table.room(slot, length + len(draft)) * table.block - length]
        if not draft:  # nothing to verify, and the pipelining was given up for it
            self._back_off(slot)
            return None
        size, window = self.programs.choose("verify", self.k + 1,
                                            self.programs.window_for(length + len(draft)))
        fed = np.zeros(size, np.int32)  # a larger compiled pass pads the same draft
        fed[0], fed[1 : 1 + len(draft)] = tokens[-1], draft
        out = np.asarray(self.runner.verify(slot, fed, length - 1, 1 + len(draft), window))
        accepted = int(out[-1])
        got = out[: accepted + 1].tolist()
        table.extend(slot, got)
        if accepted:
            self._backoff[slot] = 0
        else:
            self._back_off(slot)
        stats = self.stats
        stats.steps, stats.drafted, stats.accepted = (
            stats.steps + 1, stats.drafted + len(draft), stats.accepted + accepted)
        done = PendingStep([np.array([[got[0]]], np.int32)], np.array([slot], np.int32),
                           table.slots)  # fmt: skip
        done.more[slot] = got[1:]
        self.runner.last = done
        return done
