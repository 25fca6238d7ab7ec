"""Packed encoder groups (engine/encoder/packing.py): where each input goes.

The vectors are checked against sentence-transformers in test_encoder.py and
test_encoder_families.py; here, the placement rules a wrong plan would break
silently (an input dropped, two overlapping, a row overflowing) over many random
calls, and the choice of program."""

from __future__ import annotations

import numpy as np
import pytest

from engine.encoder import packing

MINILM = packing.ladder(256, 1024, 64)


def _check_layout(lengths: list[int], groups: list[packing.Group]) -> None:
    placed = [i for g in groups for i in g.index]
    assert sorted(placed) == list(range(len(lengths)))  # each input exactly once
    for g in groups:
        s = g.shape
        assert len(g.index) <= s.slots
        used = np.zeros((s.rows, s.width), dtype=int)
        for i, r, c in zip(g.index, g.row, g.col):
            assert 0 <= r < s.rows and c + lengths[i] <= s.width  # inside its row
            used[r, c : c + lengths[i]] += 1
        assert used.max() <= 1  # no two inputs share a token


def test_the_ladder_is_token_counts_up_to_the_budget():
    assert [(s.rows, s.width, s.slots) for s in MINILM] == [
        (1, 16, 16), (1, 32, 32), (1, 64, 64), (1, 128, 64), (1, 256, 64), (2, 256, 64),
        (4, 256, 64), (16, 64, 64)]  # fmt: skip
    assert [s.name for s in packing.ladder(512, 1024, 64)][-3:] == ["1x512", "2x512", "16x64"]
    assert [s.name for s in packing.ladder(128, None, 8)] == ["1x16", "1x32", "1x64", "1x128"]
    for limit in (128, 256, 384, 512):  # what the encoders people serve declare
        assert len(packing.ladder(limit, 1024, 64)) <= 8


@pytest.mark.parametrize("seed", range(40))
def test_random_calls_place_every_input_once_inside_a_row(seed):
    rng = np.random.default_rng(seed)
    n = int(rng.integers(1, 150))
    lengths = [int(x) for x in rng.integers(1, 257, n)]
    if seed % 3 == 0:  # mostly short, as queries are
        lengths = [int(x) for x in rng.integers(2, 30, n)]
    groups = packing.plan(lengths, MINILM)
    _check_layout(lengths, groups)
    # Only the last group may be a smaller program: the others are full-size ones.
    assert all(g.shape.tokens == 1024 for g in groups[:-1])


def test_a_call_runs_on_the_smallest_program_that_holds_it():
    assert [g.shape.name for g in packing.plan([14], MINILM)] == ["1x16"]
    assert [g.shape.name for g in packing.plan([14, 14], MINILM)] == ["1x32"]
    assert [g.shape.name for g in packing.plan([200, 14], MINILM)] == ["1x256"]
    assert [g.shape.name for g in packing.plan([200, 100], MINILM)] == ["2x256"]
    # 64 queries of 14 tokens: one program of short rows, 4 to a row
    (g,) = packing.plan([14] * 64, MINILM)
    assert g.shape.name == "16x64" and max(np.bincount(g.row)) == 64 // 14
    # long inputs take rows of the limit, and short ones fill what they leave
    (g,) = packing.plan([200] * 4 + [14] * 16, MINILM)
    assert g.shape.name == "4x256" and len(set(g.row)) == 4


def test_a_subset_of_programs_still_serves_every_call():
    """While the rest compile, a call runs on what is compiled (here one row of the
    limit and the smallest), in as many groups as it takes."""
    few = (MINILM[0], MINILM[4])
    lengths = [250, 3, 3, 120, 140, 60]
    groups = packing.plan(lengths, few)
    _check_layout(lengths, groups)
    assert {g.shape for g in groups} <= set(few)


def test_arrays_mark_slots_positions_and_padding():
    (g,) = packing.plan([3, 2], MINILM)
    ids, slot, pos = g.arrays([[7, 8, 9], [5, 6]], pad_id=0)
    assert ids.shape == (1, 16)
    assert ids[0, :5].tolist() == [7, 8, 9, 5, 6] and ids[0, 5:].sum() == 0
    assert slot[0, :6].tolist() == [0, 0, 0, 1, 1, g.shape.slots]
    assert pos[0, :5].tolist() == [0, 1, 2, 0, 1]
    types = g.place([[0, 0, 1], [0, 1]])
    assert types[0, :5].tolist() == [0, 0, 1, 0, 1]


def test_an_input_wider_than_every_program_is_refused():
    with pytest.raises(ValueError, match="300 tokens"):
        packing.plan([300], MINILM)
