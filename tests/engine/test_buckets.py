"""Shape buckets: padding and the grouping plan, checked by brute force."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from engine import buckets as bk

BATCH = (1, 2, 4, 8, 16, 32, 64)
SEQ = (16, 32, 64, 128, 256)


def test_pick_and_parse():
    assert [bk.pick(n, SEQ) for n in (1, 16, 17, 256)] == [16, 16, 32, 256]
    with pytest.raises(bk.BucketError):
        bk.pick(257, SEQ)
    assert bk.parse("64, 1,2,2") == (1, 2, 64) and bk.parse([4, 1]) == (1, 4)
    assert bk.shape_count(BATCH, SEQ) == len(bk.shapes(BATCH, SEQ)) == 35


def test_pad_builds_ids_and_mask():
    ids, mask = bk.pad([[5, 6, 7], [8]], 4, 16, pad_id=0)
    assert ids.shape == mask.shape == (4, 16) and ids.dtype == mask.dtype == np.int32
    assert ids[0, :4].tolist() == [5, 6, 7, 0] and ids[1, :2].tolist() == [8, 0]
    assert mask.sum(1).tolist() == [3, 1, 0, 0]
    with pytest.raises(bk.BucketError):
        bk.pad([[1] * 17], 1, 16)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(1, 256), min_size=1, max_size=150), st.sampled_from([1, 16, 64]))
def test_plan_covers_every_input_once_in_a_fitting_bucket(lengths, max_batch):
    groups = bk.plan(lengths, BATCH, SEQ, max_batch)
    seen = np.concatenate([rows for rows, _, _ in groups])
    assert sorted(seen.tolist()) == list(range(len(lengths)))
    for rows, b, s in groups:
        assert b in BATCH and s in SEQ and len(rows) <= b <= max_batch
        assert max(lengths[r] for r in rows) <= s


def _padded(groups) -> int:
    return sum(b * s for _, b, s in groups)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(1, 256), min_size=1, max_size=7))
def test_plan_is_no_worse_than_any_grouping(lengths):
    """Exhaustive check on small inputs: no partition into contiguous runs of the
    length-sorted inputs pays less (padded work plus the per-call cost)."""
    order = sorted(lengths)
    best = float("inf")
    n = len(order)
    for cuts in itertools.product([0, 1], repeat=n - 1):
        bounds = [0] + [i + 1 for i, c in enumerate(cuts) if c] + [n]
        cost = 0.0
        for i, j in zip(bounds, bounds[1:]):
            cost += bk._cost(bk.pick(j - i, BATCH), bk.pick(order[j - 1], SEQ))
        best = min(best, cost)
    groups = bk.plan(lengths, BATCH, SEQ, 64)
    ours = sum(bk._cost(b, s) for _, b, s in groups)
    assert ours <= best + 1e-9


def test_one_long_input_does_not_pad_the_whole_batch():
    groups = bk.plan([10] * 63 + [250], BATCH, SEQ, 64)
    assert sorted((b, s) for _, b, s in groups) == [(1, 256), (64, 16)]
    assert _padded(groups) < 64 * 256


def test_check_lengths():
    bk.check_lengths([1, 256], 256)
    with pytest.raises(bk.BucketError, match="input 1 has 257"):
        bk.check_lengths([3, 257], 256)
    with pytest.raises(bk.BucketError, match="empty"):
        bk.check_lengths([0], 256)


def test_token_budget_caps_every_group_but_the_smallest_bucket():
    from engine.buckets import plan

    lengths = [120] * 64 + [14] * 64 + [250] * 3
    groups = plan(lengths, (1, 2, 4, 8, 16, 32, 64), (16, 32, 64, 128, 256), 64, token_budget=1024)
    assert sorted(i for idx, _, _ in groups for i in idx.tolist()) == list(range(len(lengths)))
    assert all(b * s <= 1024 or b == 1 for _, b, s in groups)
    assert (64, 16) in {(b, s) for _, b, s in groups}  # short inputs still fill one batch
