"""The slot table alone: blocks per sequence, prefill progress, growth, preemption
counts and prefix keeping, as the engine's step runner and the worker's policy see
them. Host only: no model, no compile."""

from __future__ import annotations

import numpy as np
import pytest

from engine.decoder.blocks import SCRATCH
from engine.decoder.slots import SlotTable

BLOCK = 4


def _table(blocks: int = 9, slots: int = 3, prefix_cache: bool = True) -> SlotTable:
    return SlotTable(slots, BLOCK, max_blocks=8, max_context=32, blocks=blocks,
                     prefix_cache=prefix_cache)  # fmt: skip


def _prefill(table: SlotTable, slot: int, prompt: list[int], first: int = 99) -> int | None:
    """Compute the prompt in one chunk as the runner would; return the first token."""
    table.begin(slot, prompt, None, 0, top=-1)
    job, end = table.next_chunk(slot, 64)
    return table.prefilled(slot, end, np.array([first, 0], np.int32))


def test_a_prompt_gets_blocks_for_itself_and_its_first_token():
    table = _table()
    table.begin(0, list(range(1, 9)), None, 0, top=-1)  # 8 tokens + 1: three blocks
    assert len(table.held[0]) == 3 and table.prefilling(0) == 8
    assert list(table.tables[0, :3]) == table.held[0] and table.tables[0, 3] == SCRATCH
    assert table.tables[table.slots].tolist() == [SCRATCH] * 8  # the dummy row's
    job, end = table.next_chunk(0, 5)
    assert (job.done, end) == (0, 5)
    assert table.prefilled(0, end, np.array([7, 0], np.int32)) is None  # not the last chunk
    assert table.prefilling(0) == 3 and not table.active[0]
    assert table.prefilled(0, 8, np.array([7, 0], np.int32)) == 7
    assert table.active[0] and table.lengths[0] == 9 and table.context_left(0) == 23
    assert table.tokens[0] == list(range(1, 9)) + [7]


def test_a_second_prompt_reuses_the_first_ones_full_blocks():
    table = _table()
    _prefill(table, 0, list(range(1, 10)))  # two full blocks keyed as computed
    table.free(0)
    assert table.pool.cached == 2
    table.begin(1, list(range(1, 10)) + [50, 51], None, 0, top=-1)
    assert table.prefilling(1) == 3  # 8 of 11 tokens' K/V reused
    stats = table.cache_stats()
    assert (stats.queries, stats.hits) == (9 + 11, 8)


def test_grow_gives_live_slots_their_next_block_and_names_those_still_short():
    table = _table(blocks=5)  # 4 usable blocks
    _prefill(table, 0, [1, 2, 3])  # 4 tokens: one block, full
    _prefill(table, 1, [4, 5, 6])
    table.advance()  # each has a fifth token to write: a second block each
    assert table.grow() == [] and [len(h) for h in table.held[:2]] == [2, 2]
    for _ in range(4):
        table.advance()  # 9 tokens each: a third block each, and none is free
    assert table.grow() == [0, 1]  # oldest first; nothing was preempted here
    assert table.holders() == [0, 1]
    table.free(1, preempted=True)  # the caller's policy chose the newest
    assert table.grow() == [] and len(table.held[0]) == 3
    assert table.cache_stats().preemptions == 1


def test_a_token_read_after_its_sequence_ended_is_not_noted():
    table = _table()
    _prefill(table, 0, [1, 2, 3])
    live, began = np.array([0]), table.order[[0]].copy()
    table.free(0)
    _prefill(table, 0, [7, 8, 9])  # another sequence in the same slot
    host = np.array([42, 0, 0], np.int32)
    assert table.note(live, began, host, np.zeros((3, 1), np.int32)) == []
    assert table.tokens[0] == [7, 8, 9, 99]


def test_begin_refuses_a_slot_in_use_and_a_pool_without_room():
    table = _table(blocks=3)  # 2 usable blocks
    table.begin(0, [1, 2, 3], None, 0, top=-1)
    with pytest.raises(ValueError, match="in use"):
        table.begin(0, [1, 2, 3], None, 0, top=-1)
    assert not table.can_admit(list(range(1, 8)))
    with pytest.raises(RuntimeError, match="no room"):
        table.begin(1, list(range(1, 9)), None, 0, top=-1)
    with pytest.raises(ValueError, match="holds at most 7"):
        table.check_prompt(list(range(1, 9)), "tiny")
