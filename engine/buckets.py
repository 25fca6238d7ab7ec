"""Shape buckets: every batch is padded to one of a few fixed (batch, seq) shapes.

A jitted function compiles once per input shape, so padding to buckets bounds the
number of executables at len(batch_buckets) x len(seq_buckets), all compiled at
warm-up, none on the request path.

`plan()` decides how one call's inputs are grouped into padded batches:
  1. sort the inputs by length, so each group holds inputs of similar length;
  2. cut the sorted list into groups of at most `max_batch` so that the padded work
     (batch bucket x seq bucket, plus a fixed cost per forward pass) is smallest;
     a few long inputs then no longer force a whole batch to the longest bucket.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

# A forward pass costs about as much fixed overhead (dispatch, small kernels) as this
# many padded tokens of real work; it keeps `plan` from splitting for a tiny saving.
CALL_OVERHEAD_TOKENS = 48
# Attention adds work quadratic in the sequence: per token, 4*S*D flops against about
# 24*D*D for the dense layers (D=384 gives ~2300); the exact value matters little.
ATTENTION_SEQ_SCALE = 2304


class BucketError(ValueError):
    """An input does not fit the largest bucket."""


def parse(spec: str | Sequence[int]) -> tuple[int, ...]:
    """'1,2,4' or [4, 1, 2] -> (1, 2, 4): sorted, unique, positive."""
    items = spec.split(",") if isinstance(spec, str) else spec
    out = sorted({int(x) for x in items if str(x).strip()})
    if not out or out[0] < 1:
        raise ValueError(f"buckets must be positive integers, got {spec!r}")
    return tuple(out)


def pick(n: int, buckets: Sequence[int]) -> int:
    """The smallest bucket >= n (buckets sorted ascending)."""
    for b in buckets:
        if b >= n:
            return b
    raise BucketError(f"{n} exceeds the largest bucket {buckets[-1]}")


def shapes(batch_buckets: Sequence[int], seq_buckets: Sequence[int]) -> list[tuple[int, int]]:
    """Every (batch, seq) shape a model compiles: the warm-up list, smallest first."""
    return [(b, s) for s in seq_buckets for b in batch_buckets]


def shape_count(batch_buckets: Sequence[int], seq_buckets: Sequence[int]) -> int:
    return len(batch_buckets) * len(seq_buckets)


def pad(
    seqs: Sequence[Sequence[int]], batch: int, seq: int, pad_id: int = 0
) -> tuple[np.ndarray, np.ndarray]:
    """Ragged ids -> (ids, mask), both int32 [batch, seq]; rows past len(seqs) are
    all padding (mask 0) and their outputs are discarded by the caller."""
    if len(seqs) > batch:
        raise BucketError(f"{len(seqs)} inputs exceed batch bucket {batch}")
    ids = np.full((batch, seq), pad_id, dtype=np.int32)  # ids: [B, S]
    mask = np.zeros((batch, seq), dtype=np.int32)  # mask: [B, S]
    for row, s in enumerate(seqs):
        n = len(s)
        if n > seq:
            raise BucketError(f"input of {n} tokens exceeds seq bucket {seq}")
        ids[row, :n] = s
        mask[row, :n] = 1
    return ids, mask


def check_lengths(lengths: Sequence[int], max_tokens: int) -> None:
    """Reject what no bucket can hold, before any work is padded or dispatched."""
    for i, n in enumerate(lengths):
        if n > max_tokens:
            raise BucketError(f"input {i} has {n} tokens, more than the limit {max_tokens}")
        if n == 0:
            raise BucketError(f"input {i} is empty (it needs at least its special tokens)")


def _cost(batch: int, seq: int) -> float:
    return batch * seq * (1.0 + seq / ATTENTION_SEQ_SCALE) + CALL_OVERHEAD_TOKENS


def plan(
    lengths: Sequence[int],
    batch_buckets: Sequence[int],
    seq_buckets: Sequence[int],
    max_batch: int,
    token_budget: int | None = None,
) -> list[tuple[np.ndarray, int, int]]:
    """Group inputs into padded batches: [(indices into lengths, batch, seq), ...].

    `token_budget` caps a group's padded size (batch x seq), except for the smallest
    batch bucket: on a CPU a group whose activations outgrow the cache runs slower
    per token than several smaller ones.

    Dynamic programme over the inputs sorted by length: best[j] is the cheapest way to
    cover the j shortest inputs, and the last group ends at j. The cost of covering
    more inputs never falls, so for each batch bucket b the best last group is the
    longest one that fits, [j - b, j): O(N x len(batch_buckets))."""
    n = len(lengths)
    if n == 0:
        return []
    lens = np.asarray(lengths, dtype=np.int64)
    if lens.max() > seq_buckets[-1]:
        raise BucketError(f"input of {int(lens.max())} tokens exceeds {seq_buckets[-1]}")
    order = np.argsort(lens, kind="stable")
    sorted_lens = lens[order]
    sizes = [b for b in batch_buckets if b <= max_batch] or [batch_buckets[0]]
    best = [0.0] + [float("inf")] * n
    cut = [0] * (n + 1)  # cut[j]: start of the last group covering [0, j)
    for j in range(1, n + 1):
        seq = pick(int(sorted_lens[j - 1]), seq_buckets)
        for b in sizes:
            i = max(0, j - b)
            if token_budget and b > sizes[0] and pick(j - i, sizes) * seq > token_budget:
                break  # larger buckets only grow the group further past the budget
            cost = best[i] + _cost(pick(j - i, sizes), seq)
            if cost < best[j]:
                best[j], cut[j] = cost, i
            if i == 0:
                break
    groups = []
    j = n
    while j > 0:
        i = cut[j]
        seq = pick(int(sorted_lens[j - 1]), seq_buckets)
        groups.append((order[i:j], pick(j - i, sizes), seq))
        j = i
    groups.reverse()
    return groups
