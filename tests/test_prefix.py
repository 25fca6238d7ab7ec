"""Prefix-aware routing's choice alone: longest cached prefix first, load when the
holder is too busy or nobody holds anything. Pure Python."""

from __future__ import annotations

from engine.decoder.blocks import BlockPool
from shared.prefix import choose, matched, prefix_keys, short

SYSTEM = list(range(100, 164))  # four blocks of 16
TURN1 = SYSTEM + list(range(500, 520))
TURN2 = TURN1 + list(range(600, 640))  # the conversation so far, one more exchange


def _keys(tokens):
    return [short(k) for k in prefix_keys(tokens, 16)]


def _pick(workers, tokens, imbalance=4):
    """workers: name -> (held short keys, requests held)"""
    return choose(list(workers), _keys(tokens), lambda w: workers[w][0],
                  lambda w: (workers[w][1], w), imbalance)


def test_the_follow_up_goes_where_the_whole_conversation_is():
    a, b = frozenset(_keys(SYSTEM)), frozenset(_keys(TURN1))
    assert matched(_keys(TURN2), a) == 4 and matched(_keys(TURN2), b) == 5
    # Both hold the system prompt; only b the first exchange too: b, though busier.
    assert _pick({"a": (a, 0), "b": (b, 3)}, TURN2) == "b"


def test_load_wins_past_the_imbalance_and_without_a_match():
    b = frozenset(_keys(TURN1))
    assert _pick({"a": (frozenset(), 0), "b": (b, 5)}, TURN2) == "a"  # 5 > 0 + 4
    assert _pick({"a": (frozenset(), 1), "b": (frozenset(), 0)}, TURN2) == "b"
    assert _pick({"a": (frozenset(), 0), "b": (b, 5)}, list(range(9))) == "a"  # < a block


def test_a_prefix_nobody_holds_goes_to_the_emptier_cache_among_the_least_loaded():
    held = {"a": frozenset(_keys(SYSTEM)), "b": frozenset()}
    workers = {"a": 0, "b": 0, "c": 1}
    other = list(range(700, 764))  # another system prompt: no match anywhere
    pick = lambda load: choose(list(load), _keys(other), lambda w: held.get(w, frozenset()),
                               lambda w: (load[w], w), 4, lambda w: len(held.get(w, ())))
    assert pick(workers) == "b"  # a caches four blocks already, b none
    assert pick({"a": 0, "b": 1}) == "a"  # load first: the emptier cache is busier
    assert pick({"a": 0, "b": 0, "c": 0}) in ("b", "c")


def test_a_pool_summarises_its_cached_prefixes_most_useful_first():
    pool = BlockPool(20, 16)
    keys = prefix_keys(TURN1, 16)
    blocks, _ = pool.acquire([], 6)
    pool.register(blocks[:5], keys, TURN1)
    assert set(pool.summary(256)) == {short(k) for k in keys}
    assert len(pool.summary(3)) == 3
    pool.release(blocks)
    assert pool.summary(2) == [short(keys[0]), short(keys[1])]  # head evicted last


def test_a_prompt_sent_to_a_worker_counts_as_held_until_heartbeats_can_say():
    """Between dispatch and the worker's next heartbeat after the request ends, the
    scheduler's own record says where the prompt went; then only heartbeats."""
    from services.scheduler.routed import Routed

    r = Routed(grace_s=2.0)
    keys = _keys(TURN1)
    r.sent("a", keys)
    nothing = frozenset()
    assert matched(_keys(TURN2), r.held("a", nothing, now=100.0)) == 5  # running
    assert matched(_keys(TURN2), r.held("b", nothing, now=100.0)) == 0
    r.finished("a", keys, now=100.0)
    assert matched(_keys(TURN2), r.held("a", nothing, now=101.9)) == 5
    assert matched(_keys(TURN2), r.held("a", nothing, now=102.0)) == 0  # grace over
    # Announced keys count whatever the record says; a lost worker is forgotten.
    assert matched(_keys(TURN2), r.held("a", frozenset(keys[:2]), now=200.0)) == 2
    r.sent("a", keys)
    r.forget("a")
    assert matched(_keys(TURN2), r.held("a", nothing, now=0.0)) == 0


def test_the_record_is_bounded_per_worker():
    from services.scheduler.routed import Routed

    r = Routed(grace_s=1.0, limit=3)
    r.sent("a", [1, 2, 3, 4, 5])
    held = r.held("a", frozenset(), now=0.0)
    assert [k in held for k in (1, 2, 3, 4, 5)] == [False, False, True, True, True]
