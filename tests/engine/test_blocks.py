"""The KV block pool's bookkeeping alone: allocation, refcounts, prefix keys, LRU
eviction. Pure Python, no model."""

from __future__ import annotations

import pytest

from engine.decoder.blocks import SCRATCH, BlockPool, prefix_keys


def test_scratch_is_never_handed_out_and_blocks_come_back():
    pool = BlockPool(5, 4, prefix_cache=False)
    assert pool.usable == pool.available == 4
    got, reused = pool.acquire([], 4)
    assert reused == 0 and sorted(got) == [1, 2, 3, 4] and SCRATCH not in got
    assert pool.available == 0 and pool.held == 4
    with pytest.raises(RuntimeError):
        pool.take()
    pool.release(got)
    assert pool.available == 4 and pool.held == 0
    with pytest.raises(AssertionError):
        pool.release(got[:1])  # a double free is a bug, caught


def test_prefix_keys_chain_over_everything_before():
    a = prefix_keys([1, 2, 3, 4, 5, 6, 7, 8, 9], 4)
    b = prefix_keys([1, 2, 3, 4, 5, 6, 7, 8], 4)
    c = prefix_keys([0, 2, 3, 4, 5, 6, 7, 8], 4)
    assert len(a) == 2 and a == b  # the partial block has no key
    assert c[1] != a[1]  # same second block, other first block: another prefix


def test_a_registered_prefix_is_shared_with_refcounts():
    pool = BlockPool(9, 4)
    keys = prefix_keys(list(range(8)), 4)
    first, _ = pool.acquire(keys, 3)  # nothing cached yet
    pool.register(first[:2], keys, list(range(8)))
    assert pool.need(keys, 3) == 1  # two reused, held already: one new block
    second, reused = pool.acquire(keys, 3)
    assert reused == 2 and second[:2] == first[:2] and second[2] != first[2]
    assert [pool.refcount(b) for b in first[:2]] == [2, 2]
    pool.release(first)
    assert [pool.refcount(b) for b in second[:2]] == [1, 1]
    assert pool.held == 3  # second's three; first's own third block is free again
    pool.release(second)
    assert pool.held == 0 and pool.cached == 2 and pool.available == 8
    # Still cached after everyone left: a third prompt reuses them.
    assert pool.match(keys) == first[:2]


def test_cached_blocks_are_evicted_least_recently_used_and_tail_first():
    pool = BlockPool(5, 2)  # 4 usable
    ka = prefix_keys([1, 1, 2, 2], 2)
    kb = prefix_keys([3, 3, 4, 4], 2)
    a, _ = pool.acquire(ka, 2)
    pool.register(a, ka, [1, 1, 2, 2])
    pool.release(a)
    b, _ = pool.acquire(kb, 2)
    pool.register(b, kb, [3, 3, 4, 4])
    pool.release(b)
    assert pool.cached == 4 and pool.available == 4
    # Two new blocks: a's (the least recently used), its tail before its head.
    pool.take()
    assert pool.match(ka) == [a[0]] and pool.match(kb) == b
    pool.take()
    assert pool.match(ka) == [] and pool.match(kb) == b
    # Using b again makes it recent; a held block is never evicted.
    pool.acquire(kb, 2)
    assert pool.available == 0
    with pytest.raises(RuntimeError):
        pool.take()


def test_without_the_prefix_cache_nothing_is_matched():
    pool = BlockPool(5, 2, prefix_cache=False)
    keys = prefix_keys([1, 2, 3, 4], 2)
    got, _ = pool.acquire(keys, 2)
    pool.register(got, keys, [1, 2, 3, 4])
    pool.release(got)
    assert pool.match(keys) == [] and pool.cached == 0 and pool.available == 4


def test_a_finished_sequences_generated_blocks_serve_its_continuation():
    """Prompt blocks keyed as computed, the generated ones when the sequence ends: a
    follow-up whose prompt is prompt + answer + more matches all of them."""
    pool = BlockPool(9, 4)
    prompt, answer = [1, 2, 3, 4, 5, 6], [7, 8, 9, 10, 11, 12, 13]
    pkeys = prefix_keys(prompt, 4)
    blocks, _ = pool.acquire(pkeys, 4)  # 13 tokens in context -> 4 blocks
    pool.register(blocks[:1], pkeys, prompt)  # the prompt's one full block
    # Ends with 13 tokens written (the last drawn token is never fed back): 3 full.
    seq = prompt + answer
    pool.register(blocks[:3], prefix_keys(seq[:12], 4), seq)
    pool.release(blocks)
    assert pool.cached == 3 and pool.available == 8
    follow = prefix_keys(seq + [14, 15, 16, 17], 4)
    assert pool.match(follow) == blocks[:3]
    # Another answer to the same prompt shares only the prompt's block.
    assert pool.match(prefix_keys(prompt + [9, 9, 9, 9, 9, 9], 4)) == blocks[:1]


def test_keying_a_prefix_another_block_holds_leaves_this_one_free():
    pool = BlockPool(9, 4)
    keys = prefix_keys(list(range(8)), 4)
    a, _ = pool.acquire([], 2)
    b, _ = pool.acquire([], 2)  # computed the same tokens without reusing a's
    pool.register(a, keys, list(range(8)))
    pool.register(b, keys, list(range(8)))
    pool.release(a)
    pool.release(b)
    assert pool.cached == 2 and pool.match(keys) == a  # b went back to the free list


def test_a_prompt_that_shares_part_of_a_block_finds_the_block_that_goes_furthest():
    """After the shared whole blocks, the keyed block following them whose first
    tokens run furthest along the prompt (its K/V there is the prompt's own)."""
    pool = BlockPool(9, 4)
    one, two = [1, 2, 3, 4, 5, 6, 7, 8], [1, 2, 3, 4, 5, 6, 9, 9]
    a, _ = pool.acquire([], 2)
    pool.register(a, prefix_keys(one, 4), one)
    b, _ = pool.acquire([], 2)
    pool.register(b, prefix_keys(two, 4), two)  # its first block is a's: b[0] stays free
    root = prefix_keys(one, 4)[0]
    assert pool.continuing(root, [5, 6, 7]) == (a[1], 3)
    assert pool.continuing(root, [5, 6, 9, 1]) == (b[1], 3)
    assert pool.continuing(root, [5, 0]) in ((a[1], 1), (b[1], 1))
    assert pool.continuing(root, [0, 6]) is None
    assert pool.continuing(b"", [1, 2, 0]) == (a[0], 2)  # the first block's parent: b""
    # An evicted block is no longer offered.
    pool.release(a)
    pool.release(b)
    while pool.cached:
        pool.take()
    assert pool.continuing(root, [5, 6, 7]) is None and pool.continuing(b"", [1]) is None
