"""The slot table: which KV blocks each slot holds and where each sequence stands.
Host only (numpy, no JAX): the step runner reads its tables, the engine drives it.

  1. `begin(slot, prompt, ...)`: the sequence gets blocks for its prompt and first
     token; full blocks whose prefix is cached are reused, the rest are fresh; a
     cached block that goes on along the prompt is named for a copy into the first
     fresh one (returned: the runner dispatches it), up to where they part.
  2. `next_chunk` / `prefilled`: where the prompt's computing stands; the last chunk
     makes the slot live with its first token (read at once, or with the mixed step
     that drew it).
  3. `grow()` gives each live slot the block its next step writes into, as far as
     the pool has free ones, and names the slots still short. Which sequence gives
     its blocks back then is not decided here: the caller's policy picks one, and
     `free` lets it go (the step scheduler owns preemption, as it owns admission).
  4. `advance` (a step was dispatched), `note` (its tokens reached the host), and
     `free`: its full blocks stay keyed (LRU) for the next prompt that shares them,
     generated tokens included, so a conversation's next turn reuses its answer.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from engine.decoder.blocks import SCRATCH, BlockPool, prefix_keys
from engine.decoder.sampling import MAX_LOGPROBS
from engine.interface import CacheStats


@dataclass
class Prefill:
    """A sequence between `begin` and its last prefill chunk."""

    prompt: list[int]
    done: int  # prompt tokens whose K/V is in its blocks (a reused prefix counts)
    sampling: object  # kvcache.SlotSampling: what the last chunk draws with
    seed: np.uint32
    keys: list[bytes]  # prefix keys of the prompt's full blocks


class SlotTable:
    """Slots over a pool of KV blocks; see the module docstring."""

    def __init__(self, slots: int, block: int, max_blocks: int, max_context: int,
                 blocks: int, prefix_cache: bool) -> None:
        self.slots = int(slots)
        self.block = int(block)
        self.max_context = int(max_context)
        self.pool = BlockPool(blocks, self.block, prefix_cache)
        # One table per slot, plus the dummy row's (all scratch) for padding rows.
        self.tables = np.full((self.slots + 1, max_blocks), SCRATCH, np.int32)
        self.held: list[list[int]] = [[] for _ in range(self.slots)]  # slot -> blocks
        self.jobs: dict[int, Prefill] = {}  # slots between begin and their last chunk
        self.order = np.zeros(self.slots, np.int64)  # when each slot began
        self._began = 0
        self.lengths = np.zeros(self.slots, np.int64)  # tokens in context per slot
        self.active = np.zeros(self.slots, bool)  # live: part of decode steps
        # Each sequence's tokens (prompt, then generated as the host reads them), to
        # key its full blocks when it ends.
        self.tokens: list[list[int]] = [[] for _ in range(self.slots)]
        self._top = np.full(self.slots, -1, np.int64)  # top logprobs wanted (-1: none)
        # Each slot's last token's logprobs ([1 + 2K] int32 as steps.pack packs them),
        # kept only for sequences that asked for them.
        self._logprobs: list[np.ndarray | None] = [None] * self.slots

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

    def check_prompt(self, prompt: list[int], name: str) -> None:
        if self.pool.blocks_for(len(prompt) + 1) > self.pool.usable:
            raise ValueError(
                f"prompt has {len(prompt)} tokens; {name}'s KV cache holds at most "
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
        return need + int(self.active.sum()) + len(self.jobs) <= self.pool.available

    # ------------------------------------------------------------- sequences
    def begin(self, slot: int, prompt: list[int], sampling, seed: int,
              top: int) -> tuple[int, int] | None:
        """Give `slot` its blocks (reusing a cached prefix) -> (src, dst): a cached
        block whose start the prompt shares, to copy into its first fresh block
        before the prompt's next chunk is computed; None when there is none.
        `sampling`: what the last chunk draws with; `top`: logprobs wanted (-1: none)."""
        if self.held[slot]:
            raise ValueError(f"slot {slot} is in use")
        keys = self._reuse_keys(prompt)
        total = self.pool.blocks_for(len(prompt) + 1)
        if self.pool.need(keys, total) > self.pool.available:
            raise RuntimeError(f"the KV pool has no room for {len(prompt)} tokens now")
        blocks, reused = self.pool.acquire(keys, total)
        done = reused * self.block  # a keyed block may go on along the prompt (blocks.py)
        part = self.pool.continuing(keys[reused - 1] if reused else b"",
                                    prompt[done : min(len(prompt) - 1, done + self.block)])
        copy = None
        if part is not None:  # still keyed, so unwritten; the copy is dispatched first
            copy = (part[0], blocks[reused])
            done += part[1]
        self.pool.stats.queries += len(prompt)
        self.pool.stats.hits += done
        self.held[slot] = blocks
        self.tables[slot, :] = SCRATCH
        self.tables[slot, : len(blocks)] = blocks
        self._began += 1
        self.order[slot] = self._began
        self.tokens[slot] = list(prompt)
        self._top[slot] = min(top, MAX_LOGPROBS)
        self._logprobs[slot] = None
        self.jobs[slot] = Prefill(list(prompt), done, sampling, np.uint32(seed % 2**32),
                                  prefix_keys(prompt, self.block))
        return copy

    def prefilling(self, slot: int) -> int:
        """Prompt tokens `slot` has still to compute (0: none, or not prefilling)."""
        job = self.jobs.get(slot)
        return len(job.prompt) - job.done if job is not None else 0

    def next_chunk(self, slot: int, most: int) -> tuple[Prefill, int]:
        """(its prefill, where the next chunk of at most `most` tokens ends)."""
        job = self.jobs[slot]
        return job, min(len(job.prompt), job.done + most)

    def prefilled(self, slot: int, end: int, packed=None) -> int | None:
        """The prompt of `slot` is computed up to `end`: key its full blocks; after the
        last chunk the slot is live with the first drawn token (`packed` [2 + 2K]: the
        token, then its logprobs), which is returned. `packed` None: that token is
        still on the device (a mixed step drew it); the slot is live from the next
        step all the same, and `note` records the token when the step is read."""
        job = self.jobs[slot]
        job.done = end
        full = end // self.block
        self.pool.register(self.held[slot][:full], job.keys[:full], job.prompt)
        if end < len(job.prompt):
            return None
        del self.jobs[slot]
        if packed is None:
            self.active[slot] = True
            self.lengths[slot] = len(job.prompt) + 1
            return None
        packed = np.asarray(packed)
        token = int(packed[0])
        self.active[slot] = True
        self.lengths[slot] = len(job.prompt) + 1
        self.tokens[slot].append(token)
        self._logprobs[slot] = packed[1:] if self._top[slot] >= 0 else None
        return token

    def context_left(self, slot: int) -> int:
        """Tokens `slot` can still generate before its context is full."""
        return int(self.max_context - self.lengths[slot])

    # ------------------------------------------------------------------ decode
    def grow(self) -> list[int]:
        """Give every live slot the block its next step writes into, oldest sequence
        first, as far as the pool has free ones -> the live slots still short."""
        held = np.fromiter((len(h) for h in self.held), np.int64, self.slots)
        growing = np.flatnonzero(self.active & (-(-self.lengths // self.block) > held))
        short = []  # usually none grows: each step crosses into a new block once per block
        for slot in growing[np.argsort(self.order[growing])].tolist():
            if self.pool.blocks_for(int(self.lengths[slot])) > self.room(slot,
                                                                         int(self.lengths[slot])):
                short.append(slot)
        return short

    def room(self, slot: int, tokens: int) -> int:
        """Blocks for `tokens` tokens of `slot`, as far as the pool has free ones ->
        blocks it holds now."""
        while self.pool.blocks_for(tokens) > len(self.held[slot]) and self.pool.available:
            b = self.pool.take()
            self.tables[slot, len(self.held[slot])] = b
            self.held[slot].append(b)
        return len(self.held[slot])

    def holders(self) -> list[int]:
        """Slots whose sequence holds blocks (live or prefilling), oldest first."""
        held = [s for s in range(self.slots) if self.held[s]]
        return sorted(held, key=lambda s: self.order[s])

    def advance(self) -> None:
        """A decode step was dispatched: every live slot holds one more token."""
        self.lengths[self.active] = np.minimum(self.lengths[self.active] + 1, self.max_context)

    def window_need(self) -> int:
        """Positions the longest live sequence's next step attends to."""
        return int(self.lengths[self.active].max()) if self.active.any() else 1

    def note(self, live: np.ndarray, began: np.ndarray, host: np.ndarray,
             logprobs: np.ndarray) -> list[tuple[int, int]]:
        """A step's tokens reached the host -> (slot, token) of those that went on
        their sequence's record: not a sequence that ended (or another that began in
        its slot) since the dispatch. Its logprobs, when it asked for them, wait for
        `token_logprobs`."""
        kept = []
        for slot, order in zip(live.tolist(), began.tolist()):
            if self.held[slot] and self.order[slot] == order:
                self.tokens[slot].append(int(host[slot]))
                kept.append((slot, int(host[slot])))
                if self._top[slot] >= 0:
                    self._logprobs[slot] = logprobs[slot]
        return kept

    def extend(self, slot: int, tokens: list[int]) -> None:
        """Several tokens at once (a speculative step's)."""
        self.lengths[slot] = min(int(self.lengths[slot]) + len(tokens), self.max_context)
        self.tokens[slot].extend(tokens)

    def token_logprobs(self, slot: int) -> tuple[float, list[tuple[int, float]]] | None:
        """The logprob of the token `slot` got last and its request's top logprobs, as
        (logprob, [(token id, logprob)]), best first; None when it asked for none."""
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
        if not self.pool.prefix_cache or slot in self.jobs or not self.held[slot]:
            return
        tokens = self.tokens[slot]
        full = min(int(self.lengths[slot]) - 1, len(tokens)) // self.block
        if full > 0:
            self.pool.register(self.held[slot][:full],
                               prefix_keys(tokens[: full * self.block], self.block), tokens)

    def free(self, slot: int, preempted: bool = False) -> None:
        """End the sequence in `slot` (idempotent): its blocks go back to the pool, its
        full ones keyed, so a prompt that continues it reuses them."""
        if preempted and self.held[slot]:
            self.pool.stats.preemptions += 1
        self._keep(slot)
        self.pool.release(self.held[slot])
        self.tokens[slot] = []
        self.held[slot] = []
        self.tables[slot, :] = SCRATCH
        self.jobs.pop(slot, None)
        self.active[slot] = False
        self.lengths[slot] = 0
