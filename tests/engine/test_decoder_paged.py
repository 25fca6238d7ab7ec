"""The paged KV cache, prefix reuse and chunked prefill, against transformers.

Each test drives the engine the way the worker's runner does (admit while the pool
has room, prefill in chunks, make room before each step, re-run a preempted sequence
from its tokens so far) and checks every sequence's greedy tokens against its own
solo `generate` on the same weights, so paging, sharing, eviction and preemption are
all invisible in the output."""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest

from engine.decoder import DecoderEngine
from engine.decoder.static import newest
from shared.messages import Sampling
from tests.support.tiny_models import build, hf_greedy

GREEDY = Sampling(temperature=0.0)
CONTEXT = 96
NEW = 24
SYSTEM = list(range(50, 90))  # 40 shared tokens: two full blocks of 16 and a bit


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    out = tmp_path_factory.mktemp("llama")
    return out, build("llama", out, positions=128)


def engine(path, **kw) -> DecoderEngine:
    kw = {"slots": 6, "max_context": CONTEXT, "prefill_buckets": (16, 32),
          "decode_windows": (32, 64), "kv_block": 16, **kw}
    return DecoderEngine(path, "tiny", **kw)


def drive(eng: DecoderEngine, prompts: list[list[int]], new: int, budget: int = 0,
          arrive: dict[int, int] | None = None) -> list[list[int]]:
    """Serve every prompt for `new` greedy tokens, as the runner would: at most
    `budget` prompt tokens per step (0: no limit); prompt j joins at step arrive[j]."""
    arrive = arrive or {}
    out: list[list[int]] = [[] for _ in prompts]
    waiting = [j for j in range(len(prompts)) if arrive.get(j, 0) == 0]
    running: dict[int, int] = {}  # slot -> job
    prefilling: dict[int, int] = {}
    step = 0
    while waiting or running or prefilling or any(a > step for a in arrive.values()):
        waiting += [j for j, a in arrive.items() if a == step and a > 0]
        while waiting:
            slot = next((s for s in range(eng.slots) if s not in running
                         and s not in prefilling), None)
            tokens = prompts[waiting[0]] + out[waiting[0]]
            if slot is None or not eng.can_admit(tokens):
                break
            eng.begin(slot, tokens, GREEDY, 0)
            prefilling[slot] = waiting.pop(0)
        left = budget or 10**9
        for slot, job in list(prefilling.items()):
            if left <= 0:
                break
            n = min(left, eng.prefilling(slot), eng.runner.chunk)
            left -= n
            first = eng.prefill_step(slot, n)
            if first is not None:
                out[job].append(first)
                running[slot] = prefilling.pop(slot)
        for slot in eng.make_room(newest):  # the newest go back to the queue, front first
            job = running.pop(slot, None)
            job = prefilling.pop(slot) if job is None else job
            waiting.insert(0, job)
        if running:
            got = eng.step()
            for slot, job in list(running.items()):
                out[job].append(int(got[slot]))
                if len(out[job]) == new:
                    eng.free(slot)
                    del running[slot]
        step += 1
    return out


def test_more_slots_than_the_pool_has_rows_for_and_preemption_corrupts_nothing(tiny):
    """6 slots over 12 blocks (192 tokens: two rows of the old layout). Short prompts
    all fit at once; as they grow the pool runs dry and the newest are preempted and
    re-run; every output still equals its solo generate."""
    path, ref = tiny
    eng = engine(path, kv_blocks=13)
    eng.warmup(progress=False)
    prompts = [[5 + i, 17, 30 + i, 42] + list(range(100 + i, 110 + i)) for i in range(8)]
    got = drive(eng, prompts, NEW + 16)
    assert eng.cache_stats().preemptions > 0
    assert eng.table.pool.held == 0
    for p, tokens in zip(prompts, got):
        assert tokens == hf_greedy(ref, p, NEW + 16)


def test_a_long_context_needs_only_the_pool(tiny):
    """One slot's context up to the model's whole window, from a pool a quarter of
    the old per-slot rows."""
    path, ref = tiny
    eng = engine(path, slots=4, max_context=128, decode_windows=(32, 64), kv_blocks=9)
    prompt = list(range(1, 101))
    got = drive(eng, [prompt], 27)
    assert got[0] == hf_greedy(ref, prompt, 27)
    with pytest.raises(ValueError, match="KV cache holds at most"):
        engine(path, kv_blocks=3).check(list(range(1, 60)))


def test_prefix_cache_reuses_blocks_and_changes_no_output(tiny):
    path, ref = tiny
    prompts = [SYSTEM + [7, 8, 9], SYSTEM + [7, 8, 10, 11], SYSTEM[:20] + [3],
               SYSTEM + [7, 8, 9]]
    want = [hf_greedy(ref, p, NEW) for p in prompts]
    on = engine(path, kv_blocks=40)
    off = engine(path, kv_blocks=40, prefix_cache=False)
    for eng in (on, off):
        for p, w in zip(prompts, want):  # one after another: each sees the last's blocks
            got = drive(eng, [p], NEW)
            assert got[0] == w
    s = on.cache_stats()
    assert s.queries == sum(map(len, prompts))
    # Whole blocks, then as far into the next keyed block as the prompt runs along it
    # (blocks.py), always leaving the last token to compute: the second prompt parts
    # from the first's third block after 10 tokens; the third (21 tokens) reuses 16 + 4;
    # the fourth repeats the first and computes only its last token.
    assert s.hits == (32 + 10) + (16 + 4) + (32 + 10)
    assert off.cache_stats().hits == 0


def test_prefix_cache_after_eviction_changes_no_output(tiny):
    """A pool so small that each new prompt evicts the last one's cached blocks."""
    path, ref = tiny
    eng = engine(path, kv_blocks=7)
    prompts = [SYSTEM + [1], list(range(200, 250)), SYSTEM + [2], SYSTEM + [2, 3]]
    for p in prompts:
        got = drive(eng, [p], 8)
        assert got[0] == hf_greedy(ref, p, 8)
    assert eng.cache_stats().hits > 0


def test_chunked_prefill_interleaves_with_decode_and_changes_no_output(tiny):
    """Chunks of 16 tokens: a 70-token prompt arriving while three sequences decode
    is computed over several steps, each of which still runs their decode step."""
    path, ref = tiny
    eng = engine(path, prefill_chunk=16, kv_blocks=40)
    prompts = [[5, 17, 30, 42], list(range(40, 49)), list(range(100, 117)),
               list(range(2, 72))]
    got = drive(eng, prompts, NEW, budget=16, arrive={3: 3})
    for p, tokens in zip(prompts, got):
        assert tokens == hf_greedy(ref, p, NEW)


def _continue(prompt: list[int], answer: list[int], i: int) -> list[int]:
    return prompt + answer + [60 + i, 61, 62 + i]


def test_a_follow_up_reuses_the_previous_answer_and_changes_no_output(tiny):
    """A conversation of four turns, each prompt the last one plus its answer plus a
    question: with the cache on, the answer's full blocks (filled by decode steps) are
    reused; outputs equal transformers' and the engine's with the cache off."""
    path, ref = tiny
    on = engine(path, kv_blocks=40)
    off = engine(path, kv_blocks=40, prefix_cache=False)
    prompt = [5, 17, 30, 42, 7]
    for i in range(4):
        want = hf_greedy(ref, prompt, NEW)
        before = on.cache_stats().hits
        assert drive(on, [prompt], NEW)[0] == want
        assert drive(off, [prompt], NEW)[0] == want
        if i:  # all but the last block holding prompt's final token come from the cache
            assert on.cache_stats().hits - before == (len(prompt) - 1) // 16 * 16
        prompt = _continue(prompt, want, i)
    assert off.cache_stats().hits == 0


def test_generated_blocks_after_eviction_change_no_output(tiny):
    """A pool too small to keep two conversations: each evicts the other's blocks
    (generated ones included), and a partly evicted prefix is recomputed right."""
    path, ref = tiny
    eng = engine(path, kv_blocks=9)  # 8 usable blocks: 128 tokens
    convs = [[5, 17, 30, 42, 7], list(range(100, 130))]
    for i in range(3):
        for c, prompt in enumerate(convs):
            want = hf_greedy(ref, prompt, NEW)
            assert drive(eng, [prompt], NEW)[0] == want, (i, c)
            convs[c] = _continue(prompt, want, i)
            if len(convs[c]) + NEW > CONTEXT:
                convs[c] = convs[c][-40:]
    assert eng.cache_stats().hits > 0
    assert eng.table.pool.held == 0
