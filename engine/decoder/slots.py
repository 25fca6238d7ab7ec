"""The JAX decoder's slot and block bookkeeping, all on the host: which blocks of
the KV pool each slot holds (its table), where each prompt's prefill stands, which
sequence began when (the newest is preempted first), and which full blocks stay
keyed for the next prompt that shares them. `DecoderEngine` (engine/decoder/engine.py)
adds the device work: the prefill chunks and the decode steps that read these tables.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import jax
import numpy as np

from engine.decoder.blocks import SCRATCH, BlockPool, prefix_keys
from engine.decoder.grammar import SlotGrammars
from engine.decoder.host import DecoderHost
from engine.decoder.kvcache import MAX_BIAS, SlotSampling
from engine.decoder.sampling import MAX_LOGPROBS
from engine.interface import CacheStats
from shared.messages import Sampling


@dataclass
class _Prefill:
    """A sequence between `begin` and its last prefill chunk."""

    prompt: list[int]
    done: int  # prompt tokens whose K/V is in its blocks (a reused prefix counts)
    sampling: SlotSampling
    seed: np.uint32
    keys: list[bytes]  # prefix keys of the prompt's full blocks


class PendingStep:
    """A dispatched decode step; its tokens leave the device on `result()`."""

    def __init__(self, tokens: list[jax.Array], rows: np.ndarray, slots: int,
                 preempted: list[int],
                 on_result: Callable[[np.ndarray, np.ndarray], None] | None = None) -> None:
        # parts x [B, 2 + 2K] int32, on device: row i is slot rows[i]'s token, then its
        # logprobs (engine.decoder.steps.pack)
        self._tokens = tokens
        self._rows = rows  # [parts x B] int32 (padding rows name the dummy row, index SLOTS)
        self._slots = slots
        self._host: np.ndarray | None = None
        self._on_result = on_result
        self.preempted = preempted  # slots freed to make room before it (not in it)
        self.batch = len(rows) // len(tokens)  # the batch bucket it ran at
        # Slot -> its tokens after its entry in `result()`: a speculative step's
        # accepted drafts emit several (engine/decoder/speculative.py).
        self.more: dict[int, list[int]] = {}

    def result(self) -> np.ndarray:
        """[SLOTS] int32: each slot's token (slots not in the step: ignore)."""
        if self._host is None:
            # The step's one host copy (one per part when it ran in parts).
            packed = np.concatenate([np.asarray(t) for t in self._tokens])
            out = np.zeros((self._slots + 1, packed.shape[1]), np.int32)
            out[self._rows] = packed
            self._host = np.ascontiguousarray(out[: self._slots, 0])
            if self._on_result is not None:
                self._on_result(self._host, out[: self._slots, 1:])
        return self._host


def slot_sampling(sampling: Sampling, vocab: int, prompt: list[int]) -> SlotSampling:
    """A request's sampling parameters as the prefill takes them; `seen` marks the
    prompt's tokens only when a repetition penalty will read them."""
    bias = [(t, b) for t, b in sampling.logit_bias if 0 <= t < vocab][:MAX_BIAS]
    ids, vals = np.zeros(MAX_BIAS, np.int32), np.zeros(MAX_BIAS, np.float32)
    if bias:
        ids[: len(bias)], vals[: len(bias)] = zip(*bias)
    seen = np.zeros(vocab, np.bool_)
    if sampling.repetition_penalty != 1.0:
        seen[np.asarray(prompt, np.int64)] = True
    return SlotSampling(
        temperature=np.float32(max(0.0, sampling.temperature)),
        top_k=np.int32(sampling.top_k if sampling.top_k > 0 else 0),
        top_p=np.float32(sampling.top_p if 0.0 < sampling.top_p < 1.0 else 1.0),
        min_p=np.float32(min(max(sampling.min_p, 0.0), 1.0)),
        presence=np.float32(sampling.presence_penalty),
        frequency=np.float32(sampling.frequency_penalty),
        repetition=np.float32(sampling.repetition_penalty if sampling.repetition_penalty > 0
                              else 1.0),
        bias_ids=ids, bias_vals=vals, seen=seen,
        logprobs=np.int32(min(sampling.logprobs, MAX_LOGPROBS)),
    )


class PagedSlots(DecoderHost):
    """Slots over a pool of KV blocks; the subclass sets `block` (tokens per block) and
    `_max_blocks` (a table's width: a full context), then calls `_init_slots`."""

    block: int
    _max_blocks: int

    def _copy_block(self, src: int, dst: int) -> None:
        """Copy block `src`'s K/V into block `dst`, every layer (the engine's device work)."""
        raise NotImplementedError

    def _init_slots(self, blocks: int, prefix_cache: bool) -> None:
        self.pool = BlockPool(blocks, self.block, prefix_cache)
        # One table per slot, plus the dummy row's (all scratch) for padding rows.
        self._tables = np.full((self._slots + 1, self._max_blocks), SCRATCH, np.int32)
        self._held: list[list[int]] = [[] for _ in range(self._slots)]  # slot -> blocks
        self._jobs: dict[int, _Prefill] = {}  # slots between begin and their last chunk
        self._order = np.zeros(self._slots, np.int64)  # when each slot began (preemption)
        self._began = 0
        # Each sequence's tokens (prompt, then generated as the caller reads them), to
        # key its full blocks when it ends.
        self._tokens: list[list[int]] = [[] for _ in range(self._slots)]
        self._top = np.full(self._slots, -1, np.int64)  # top logprobs wanted (-1: none)
        # Each slot's last token's logprobs ([1 + 2K] int32 as steps.pack packs them),
        # kept only for sequences that asked for them.
        self._logprobs: list[np.ndarray | None] = [None] * self._slots
        self.grammar = SlotGrammars(self)  # structured outputs' matchers, per slot

    # ------------------------------------------------------------- the pool
    @property
    def kv_usage(self) -> float:
        """Fraction of the pool's blocks held by sequences (cached-only ones are free)."""
        return self.pool.held / self.pool.usable

    def cache_stats(self) -> CacheStats:
        p = self.pool
        return CacheStats(p.usable, p.held, p.cached, p.stats.queries, p.stats.hits,
                          p.stats.preemptions)

    @property
    def prefix_block(self) -> int:
        """Tokens per prefix key; 0 with the prefix cache off (nothing to route by)."""
        return self.block if self.pool.prefix_cache else 0

    def held_prefixes(self, limit: int) -> list[int]:
        """Short keys (shared.prefix) of the prompt prefixes cached here, at most `limit`."""
        return self.pool.summary(limit)

    # -------------------------------------------------------------- requests
    def check_prompt(self, prompt: list[int]) -> None:
        super().check_prompt(prompt)
        need = self.pool.blocks_for(len(prompt) + 1)
        if need > self.pool.usable:
            raise ValueError(
                f"prompt has {len(prompt)} tokens; {self.name}'s KV cache holds at most "
                f"{self.pool.usable * self.block - 1} for one sequence"
            )

    def _reuse_keys(self, prompt: list[int]) -> list[bytes]:
        """Prefix keys of the blocks a prompt may reuse: full blocks, leaving at least
        one token to compute (its logits draw the first token)."""
        return prefix_keys(prompt[: (len(prompt) - 1) // self.block * self.block], self.block)

    def can_admit(self, prompt: list[int]) -> bool:
        """Whether `begin` would get its blocks now, leaving one block of headroom per
        sequence already running (each may cross into a new block next step)."""
        need = self.pool.need(self._reuse_keys(prompt), self.pool.blocks_for(len(prompt) + 1))
        return need + int(self._active.sum()) + len(self._jobs) <= self.pool.available

    def begin(self, slot: int, prompt: list[int], sampling: Sampling, seed: int,
              generated: int = 0) -> None:
        """Give `slot` its blocks (reusing a cached prefix); `prefill_step` computes it.
        `generated`: how many of the prompt's last tokens the sequence generated
        before it was preempted (its grammar's matcher is fed them again)."""
        self.check_slot(slot)
        self.check_prompt(prompt)
        if self._held[slot]:
            raise ValueError(f"slot {slot} is in use")
        keys = self._reuse_keys(prompt)
        total = self.pool.blocks_for(len(prompt) + 1)
        if self.pool.need(keys, total) > self.pool.available:
            raise RuntimeError(f"the KV pool has no room for {len(prompt)} tokens now")
        blocks, reused = self.pool.acquire(keys, total)
        done = reused * self.block  # a keyed block may go on along the prompt (blocks.py)
        part = self.pool.continuing(keys[reused - 1] if reused else b"",
                                    prompt[done : min(len(prompt) - 1, done + self.block)])
        if part is not None:  # still keyed, so unwritten; the copy is dispatched first
            self._copy_block(part[0], blocks[reused])
            done += part[1]
        self.pool.stats.queries += len(prompt)
        self.pool.stats.hits += done
        self._held[slot] = blocks
        self._tables[slot, :] = SCRATCH
        self._tables[slot, : len(blocks)] = blocks
        self._began += 1
        self._order[slot] = self._began
        self._tokens[slot] = list(prompt)
        self._top[slot] = min(sampling.logprobs, MAX_LOGPROBS)
        self._logprobs[slot] = None
        self.grammar.begin(slot, sampling.grammar, prompt[len(prompt) - generated:])
        self._jobs[slot] = _Prefill(list(prompt), done,
                                    slot_sampling(sampling, self.cfg.vocab_size, prompt),
                                    np.uint32(seed % 2**32), prefix_keys(prompt, self.block))

    def prefilling(self, slot: int) -> int:
        """Prompt tokens `slot` has still to compute (0: none, or not prefilling)."""
        job = self._jobs.get(slot)
        return len(job.prompt) - job.done if job is not None else 0

    def _prefilled(self, slot: int, end: int, packed) -> int | None:
        """The prompt of `slot` is computed up to `end`: key its full blocks; after the
        last chunk the slot is live with the first drawn token (`packed` [2 + 2K]: the
        token, then its logprobs), which is returned."""
        job = self._jobs[slot]
        job.done = end
        full = end // self.block
        self.pool.register(self._held[slot][:full], job.keys[:full], job.prompt)
        if end < len(job.prompt):
            return None
        del self._jobs[slot]
        packed = np.asarray(packed)
        token = int(packed[0])
        self._start(slot, len(job.prompt))
        self._tokens[slot].append(token)
        self.grammar.consume(slot, token)
        self._logprobs[slot] = packed[1:] if self._top[slot] >= 0 else None
        return token

    # ------------------------------------------------------------------ decode
    def make_room(self) -> list[int]:
        """Give every live slot the block its next step writes into. When the pool is
        dry, preempt the sequence that began last (live or prefilling), as often as
        needed; return the preempted slots (already freed: the caller re-runs them)."""
        preempted: list[int] = []
        for slot in np.flatnonzero(self._active)[np.argsort(self._order[self._active])]:
            if not self._active[slot]:
                continue  # preempted below for an older one
            while self.pool.blocks_for(int(self._lengths[slot])) > len(self._held[slot]):
                if self.pool.available:
                    b = self.pool.take()
                    self._tables[slot, len(self._held[slot])] = b
                    self._held[slot].append(b)
                    continue
                victim = max((s for s in range(self._slots) if self._held[s]),
                             key=lambda s: self._order[s])
                self.free(victim)
                self.pool.stats.preemptions += 1
                preempted.append(int(victim))
                if victim == slot:
                    break
        return preempted

    def _note(self, live: np.ndarray, began: np.ndarray, host: np.ndarray,
              logprobs: np.ndarray) -> None:
        """A step's tokens reached the host: each goes on its sequence's record, unless
        that sequence has ended (or another began in its slot) since the dispatch;
        its logprobs, when it asked for them, wait for `token_logprobs`."""
        for slot, order in zip(live.tolist(), began.tolist()):
            if self._held[slot] and self._order[slot] == order:
                self._tokens[slot].append(int(host[slot]))
                self.grammar.consume(slot, int(host[slot]))
                if self._top[slot] >= 0:
                    self._logprobs[slot] = logprobs[slot]

    def token_logprobs(self, slot: int) -> tuple[float, list[tuple[int, float]]] | None:
        """The logprob of the token `slot` got last (from its last prefill chunk or
        the last step read) and its request's top logprobs, as (logprob, [(token id,
        logprob)]), best first; None when its request asked for none."""
        row = self._logprobs[slot]
        if row is None or self._top[slot] < 0:
            return None
        k = MAX_LOGPROBS
        lp = row[: 1 + 2 * k].view(np.float32)  # float32 bits
        ids, top = row[1 : 1 + k], lp[1 + k : 1 + 2 * k]
        n = int(self._top[slot])
        return float(lp[0]), [(int(i), float(v)) for i, v in zip(ids[:n], top[:n])]

    def _keep(self, slot: int) -> None:
        """Key the full blocks of the sequence in `slot` before it lets them go: its
        prompt's are keyed already (as computed); this adds those its decode steps
        filled. Only positions whose K/V has been written and whose token the host
        has seen count: `lengths - 1` (the last drawn token is never fed back)."""
        if not self.pool.prefix_cache or slot in self._jobs or not self._held[slot]:
            return
        tokens = self._tokens[slot]
        full = min(int(self._lengths[slot]) - 1, len(tokens)) // self.block
        if full > 0:
            self.pool.register(self._held[slot][:full],
                               prefix_keys(tokens[: full * self.block], self.block), tokens)

    def grammar_released(self, slot: int) -> None:
        """`slot`'s grammar was dropped mid-sequence (engine/decoder/grammar.py);
        nothing to do here (speculation, engine/decoder/speculative.py, may start)."""

    def free(self, slot: int) -> None:
        """End the sequence in `slot` (idempotent): its blocks go back to the pool, its
        full ones keyed, so a prompt that continues it reuses them."""
        self._keep(slot)
        self.pool.release(self._held[slot])
        self._tokens[slot] = []
        self._held[slot] = []
        self._tables[slot, :] = SCRATCH
        self._jobs.pop(slot, None)
        self.grammar.free(slot)
        self._clear(slot)
