"""The KV block pool's bookkeeping, on the host: which block holds what, who uses it.

Pure Python, no arrays: the device pool ([KV, NUM_BLOCKS, BLOCK, D] per layer) is
only ever indexed through block ids handed out here.

- Block 0 is never handed out: it is the scratch block that padding and free slots
  write into, so a write nobody reads can never land in a block somebody owns.
- A block is *free* (on the free list, content meaningless), *held* (refcount > 0:
  one or more sequences' block tables name it) or *cached* (refcount 0 but keyed by
  its prefix hash, kept in LRU order until its space is needed).
- Prefix keys chain: a full block's key hashes its tokens and the key of the block
  before it, so one key names the whole prefix up to that block's end. Only full
  blocks are keyed: a partial block still changes as a sequence grows.
- A keyed block also serves a prompt that shares only the start of it: `continuing`
  finds, among the keyed blocks that follow a prefix, the one whose first tokens run
  furthest along the prompt; the caller copies it into a block of its own (a copy,
  since the new sequence writes the rest of that block) and computes from there. A
  repeated prompt then computes one token whatever its length, as llama.cpp's
  per-slot prompt cache does, where whole blocks alone would leave up to a block.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import numpy as np

from shared.prefix import prefix_keys, short

__all__ = ["SCRATCH", "BlockPool", "PoolStats", "prefix_keys"]
SCRATCH = 0


@dataclass
class PoolStats:
    queries: int = 0  # prompt tokens looked up in the prefix cache
    hits: int = 0  # of those, tokens found (their K/V reused, not computed)
    preemptions: int = 0  # sequences whose blocks were taken back mid-decode


class BlockPool:
    def __init__(self, num_blocks: int, block: int, prefix_cache: bool = True) -> None:
        if num_blocks < 2:
            raise ValueError("the KV pool needs at least 2 blocks (one is scratch)")
        self.num_blocks = num_blocks
        self.block = block
        self.prefix_cache = prefix_cache
        self._free: list[int] = list(range(num_blocks - 1, SCRATCH, -1))  # pop() -> 1 first
        self._refs = np.zeros(num_blocks, np.int32)
        self._key_of: dict[int, bytes] = {}  # block -> its prefix key
        self._by_key: dict[bytes, int] = {}  # prefix key -> block
        self._after: dict[bytes, dict[int, tuple[int, ...]]] = {}  # parent key -> its tokens
        self._parent_of: dict[int, bytes] = {}  # keyed block -> the key of the one before
        self._lru: OrderedDict[int, None] = OrderedDict()  # cached, refcount 0, oldest first
        self.stats = PoolStats()

    # ------------------------------------------------------------- capacity
    @property
    def usable(self) -> int:
        """Blocks sequences can hold (all but the scratch block)."""
        return self.num_blocks - 1

    @property
    def available(self) -> int:
        """Blocks an allocation can take now: free, or cached and evictable."""
        return len(self._free) + len(self._lru)

    @property
    def held(self) -> int:
        return self.usable - self.available

    @property
    def cached(self) -> int:
        return len(self._by_key)

    def blocks_for(self, tokens: int) -> int:
        return -(-tokens // self.block)

    # --------------------------------------------------------------- prefix
    def match(self, keys: list[bytes]) -> list[int]:
        """Blocks holding the longest cached prefix among `keys` (not yet held)."""
        if not self.prefix_cache:
            return []
        out = []
        for key in keys:
            b = self._by_key.get(key)
            if b is None:
                break
            out.append(b)
        return out

    def need(self, keys: list[bytes], blocks: int) -> int:
        """Blocks an allocation of `blocks` would take from `available`, given that the
        ones matching `keys` are reused (reusing a cached one takes it off the LRU)."""
        hit = self.match(keys)
        return blocks - len(hit) + sum(1 for b in hit if self._refs[b] == 0)

    def acquire(self, keys: list[bytes], blocks: int) -> tuple[list[int], int]:
        """`blocks` blocks for a new sequence, the first ones reused from the cache when
        `keys` match -> (block ids, how many were reused). Caller checked `need`."""
        hit = self.match(keys)
        for b in hit:
            self._hold(b)
        out = hit + [self._take() for _ in range(blocks - len(hit))]
        return out, len(hit)

    def continuing(self, parent: bytes, tokens: list[int]) -> tuple[int, int] | None:
        """The keyed block after the prefix `parent` (b"": the first block) whose first
        tokens match the most of `tokens` -> (block, tokens matched), None if none does."""
        if not tokens or not self.prefix_cache:
            return None
        best, most = None, 0
        want = tuple(tokens)
        for b, held in self._after.get(parent, {}).items():
            n = next((i for i, (x, y) in enumerate(zip(held, want)) if x != y),
                     min(len(held), len(want)))
            if n > most:
                best, most = b, n
        return None if best is None else (best, most)

    def register(self, blocks: list[int], keys: list[bytes], tokens: list[int]) -> None:
        """These held blocks now hold computed K/V for `keys` (full blocks: `tokens`
        are theirs, from the sequence's first)."""
        if not self.prefix_cache:
            return
        for i, (b, key) in enumerate(zip(blocks, keys)):
            if key in self._by_key or b in self._key_of:
                continue  # another block already answers for this prefix
            self._by_key[key] = b
            self._key_of[b] = key
            parent = keys[i - 1] if i else b""
            self._parent_of[b] = parent
            self._after.setdefault(parent, {})[b] = tuple(
                tokens[i * self.block : (i + 1) * self.block])

    # ----------------------------------------------------------- allocation
    def take(self) -> int:
        """One more block for a growing sequence. Caller checked `available`."""
        return self._take()

    def release(self, blocks: list[int]) -> None:
        """A sequence let go of its blocks (last block first, so a prefix's tail is
        evicted before its head)."""
        for b in reversed(blocks):
            self._refs[b] -= 1
            assert self._refs[b] >= 0, f"block {b} released twice"
            if self._refs[b] == 0:
                if b in self._key_of:
                    self._lru[b] = None
                else:
                    self._free.append(b)

    def _hold(self, b: int) -> None:
        if self._refs[b] == 0:
            self._lru.pop(b, None)
        self._refs[b] += 1

    def _take(self) -> int:
        if self._free:
            b = self._free.pop()
        elif self._lru:
            b, _ = self._lru.popitem(last=False)  # least recently used
            del self._by_key[self._key_of.pop(b)]
            parent = self._parent_of.pop(b)
            del self._after[parent][b]
            if not self._after[parent]:
                del self._after[parent]
        else:
            raise RuntimeError("KV pool exhausted")  # callers check `available` first
        self._refs[b] = 1
        return b

    def summary(self, limit: int) -> list[int]:
        """Short keys of cached prefixes, at most `limit`: those in use first, then
        the evictable ones, most recently used first (the likeliest to last)."""
        held = [k for b, k in self._key_of.items() if self._refs[b] > 0]
        idle = [self._key_of[b] for b in reversed(self._lru)]
        return [short(k) for k in (held + idle)[:limit]]

    def refcount(self, b: int) -> int:
        return int(self._refs[b])
