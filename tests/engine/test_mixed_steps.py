"""Mixed steps: decode rows and prompt chunks of several sequences in one pass
(engine/decoder/steps.py `mixed`, docs/decisions/0087), against transformers.

The driver serves the way the worker's loop does with a mixed-capable engine:
whenever prompt work is waiting, it rides in the decode step's pass; new prompts
arrive while other sequences decode. Every sequence's greedy tokens must equal its
own solo `generate` on the same weights, and sampled tokens must equal those of the
same requests served with separate prefill and decode programs."""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import numpy as np
import pytest

from engine.decoder import DecoderEngine
from engine.decoder.static import newest
from shared.messages import Sampling
from tests.support.tiny_models import build, hf_greedy

GREEDY = Sampling(temperature=0.0)
CONTEXT = 128
NEW = 20


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    out = tmp_path_factory.mktemp("llama")
    return out, build("llama", out, positions=CONTEXT)


def engine(path, **kw) -> DecoderEngine:
    kw = {"slots": 8, "max_context": CONTEXT, "prefill_buckets": (16, 32), "kv_block": 16,
          "attention": "cpu", **kw}
    eng = DecoderEngine(path, "tiny", **kw)
    assert eng.programs.mixed_shapes == [(32, 8)]  # the chunk's tokens, a table row per slot
    eng.programs.get("mixed", 32, 8)  # compiled here, as the background would
    eng.runner.claim_dummy()
    assert eng.mixes()
    return eng


def drive(eng: DecoderEngine, prompts: list[list[int]], new: int, mixed: bool = True,
          arrive: dict[int, int] | None = None, sampling: Sampling | None = None,
          rows: list[int] | None = None, choose=None) -> list[list[int]]:
    """Serve every prompt for `new` tokens (or to EOS when `choose` is given: job ->
    its sampling); prompt j is admitted at step arrive[j]. `mixed`: prompt chunks
    may ride in the decode step's pass (else each runs on its own, then the step).
    `rows`: filled with the decode rows of each step that also carried prompt tokens."""
    arrive = arrive or {}
    eos = set(eng.eos_token_ids) if choose else set()
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
            j = waiting.pop(0)
            eng.begin(slot, tokens, choose(j) if choose else (sampling or GREEDY), 7 + j)
            prefilling[slot] = j
        for slot, job in list(prefilling.items()):
            first = eng.prefill_step(slot, mix=mixed)
            if first is not None:  # computed apart: in the step dispatched next
                out[job].append(first)
                running[slot] = prefilling.pop(slot)
        for slot in eng.make_room(newest):  # the newest go back to the queue, front first
            job = running.pop(slot, None)
            job = prefilling.pop(slot) if job is None else job
            waiting.insert(0, job)
        live = len(running)
        pending = eng.step_async()
        for slot in [s for s in prefilling if not eng.prefilling(s)]:
            running[slot] = prefilling.pop(slot)  # its last chunk rode in this step
        if pending is None:
            step += 1
            continue
        if rows is not None and pending.prompt_tokens and live:
            rows.append(live)
        got = pending.result()
        for slot, job in list(running.items()):
            if not (out[job] and out[job][-1] in eos):
                out[job].append(int(got[slot]))
            if len(out[job]) >= new or out[job][-1] in eos:
                eng.free(slot)
                del running[slot]
        step += 1
    return [o[:new] for o in out]


PROMPTS = [[5, 17, 30, 42], list(range(40, 49)), list(range(100, 117)), list(range(2, 72)),
           list(range(150, 161)), [9] * 33, list(range(60, 90))]


def test_prompts_arriving_while_streams_decode_equal_transformers(tiny):
    """Seven prompts, four of them arriving while others decode; the 70-token one
    spans three passes of 32 tokens, shared with the decode rows."""
    path, ref = tiny
    eng = engine(path)
    rows: list[int] = []
    got = drive(eng, PROMPTS, NEW, arrive={3: 2, 4: 3, 5: 5, 6: 9}, rows=rows)
    assert max(rows) >= 3  # prompt tokens rode in passes with several decode rows
    for p, tokens in zip(PROMPTS, got):
        assert tokens == hf_greedy(ref, p, NEW)
    assert eng.table.pool.held == 0


def test_sampled_tokens_equal_the_separate_programs(tiny):
    """Seeded sampling draws the same tokens in a mixed pass as from a prefill
    program and a decode step: the same key at the same position."""
    path, _ = tiny
    hot = Sampling(temperature=0.9, top_p=0.95, seed=3, frequency_penalty=0.4)
    arrive = {2: 1, 3: 4, 4: 6}
    mixed = drive(engine(path), PROMPTS[:5], NEW, arrive=arrive, sampling=hot)
    apart = drive(engine(path), PROMPTS[:5], NEW, mixed=False, arrive=arrive, sampling=hot)
    assert mixed == apart


def test_a_cached_prefix_and_preemption_change_no_output(tiny):
    """A pool of 11 blocks: prompts share a start (reused blocks) and the newest are
    preempted and re-run as the rest grow."""
    path, ref = tiny
    eng = engine(path, kv_blocks=11)
    system = list(range(10, 50))
    prompts = [system + [1 + i, 2, 3] for i in range(5)]
    got = drive(eng, prompts, NEW + 10, arrive={3: 2, 4: 3})
    assert eng.cache_stats().hits > 0
    assert eng.cache_stats().preemptions > 0
    for p, tokens in zip(prompts, got):
        assert tokens == hf_greedy(ref, p, NEW + 10)


def test_a_grammar_that_does_not_compile_fails_its_chunk_only(tiny):
    """It raises where the chunk is handed over, never inside the shared step."""
    path, ref = tiny
    eng = engine(path)
    eng.begin(0, PROMPTS[0], GREEDY, 0)
    while eng.prefill_step(0) is None:
        pass
    bad = Sampling(temperature=0.0, grammar='{"grammars": [{"lark_grammar": "start: ("}]}')
    eng.begin(1, PROMPTS[1], bad, 0)
    eng.begin(2, PROMPTS[2], GREEDY, 0)
    with pytest.raises(ValueError, match="does not compile"):
        eng.prefill_step(1, mix=True)
    assert eng.prefill_step(2, mix=True) is None  # rides
    got = eng.step_async().result()
    assert eng.prefilling(2) == 0 and eng.prefilling(1) == len(PROMPTS[1])
    assert int(got[2]) == hf_greedy(ref, PROMPTS[2], 1)[0]
    assert int(got[0]) == hf_greedy(ref, PROMPTS[0], 2)[1]


def test_a_chunk_freed_before_its_result_is_read_is_forgotten(tiny):
    """A request cancelled while its last chunk runs: its slot is freed before the
    step is read, and the step's result neither revives it nor fails."""
    path, _ = tiny
    eng = engine(path)
    eng.begin(0, PROMPTS[0], GREEDY, 0)
    assert eng.prefill_step(0, mix=True) is not None  # nothing live: a lone prompt runs apart
    eng.begin(1, PROMPTS[1], GREEDY, 0)
    assert eng.prefill_step(1, mix=True) is None
    pending = eng.step_async()
    assert eng.table.active.tolist()[:2] == [True, True]
    eng.free(1)
    pending.result()
    assert eng.table.active.tolist()[:2] == [True, False] and eng.table.tokens[1] == []
    assert np.all(eng.table.tables[1] == eng.table.tables[eng.slots])  # scratch only


def test_structured_outputs_in_mixed_steps_equal_the_separate_programs(tiny):
    """Constrained and plain sequences side by side: a last chunk draws under its
    grammar's first mask inside the mixed pass, a constrained decode row under its
    matcher's; the tokens equal those of separate programs and the JSON parses."""
    import json

    from services.gateway.structured import grammar_for
    from shared.api import JsonSchemaFormat, ResponseFormat

    path, _ = tiny
    schema = {"type": "object", "properties": {
        "name": {"type": "string", "maxLength": 6},
        "age": {"type": "integer", "minimum": 0, "maximum": 120}},
        "required": ["name", "age"], "additionalProperties": False}  # fmt: skip
    grammar = grammar_for(ResponseFormat(type="json_schema", json_schema=JsonSchemaFormat(
        name="t", schema=schema)))
    constrained = Sampling(temperature=1.0, seed=5, grammar=grammar)
    plain = Sampling(temperature=1.0, seed=9)
    arrive = {1: 1, 2: 3, 3: 4}
    prompts = PROMPTS[:4]
    runs = []
    for mixed in (True, False):
        eng = engine(path)
        got = drive(eng, prompts, 80, mixed, arrive,
                    choose=lambda j: constrained if j % 2 == 0 else plain)  # fmt: skip
        runs.append((eng, got))
    (eng, mixed_out), (_, apart_out) = runs
    assert mixed_out == apart_out
    assert sum(eng.programs.mixed_counts.values()) > 0
    eos = set(eng.eos_token_ids)
    for j in (0, 2):  # the constrained ones
        tokens = [t for t in mixed_out[j] if t not in eos]
        assert set(json.loads(eng.tokenizer.decode(tokens))) == {"name", "age"}

def test_a_mixed_step_takes_the_fewest_rows_that_hold_its_work(tiny):
    """The lm head runs on every table row, so rows come in buckets (16 and 32 for
    32 slots): a step takes the smallest compiled one that holds its rows, the
    largest compiled one when none does, and none while none holds the live rows."""
    path, _ = tiny
    eng = DecoderEngine(path, "tiny", slots=32, max_context=CONTEXT, prefill_buckets=(16, 32),
                        attention="cpu")  # fmt: skip
    programs = eng.programs
    assert programs.mixed_shapes == [(32, 16), (32, 32)]
    assert programs.mixed_shape(3, 5) is None  # nothing compiled: apart
    programs.get("mixed", 32, 16)
    assert programs.mixed_shape(3, 5) == (32, 16)
    assert programs.mixed_shape(14, 20) == (32, 16)  # the live rows and two chunks fit
    assert programs.mixed_shape(16, 18) is None  # not one chunk fits beside them
    programs.get("mixed", 32, 32)
    assert programs.mixed_shape(16, 18) == (32, 32)
    assert programs.mixed_shape(3, 5) == (32, 16)
