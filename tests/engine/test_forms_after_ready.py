"""A quantized decoder's compute forms with a cold choice file (engine/decoder/
formchoice.py): the engine is ready, and serves, before any form is measured; the
measuring then runs between steps, each bucket switches to its measured form without
changing greedy tokens, and the choice is stored for the next start, which measures
nothing. Counted (measurements, programs, switches), never timed."""

from __future__ import annotations

import json

import pytest

from engine import forms
from engine.decoder import DecoderEngine
from engine.decoder.formchoice import form_bucket
from engine.decoder.static import GREEDY, generate_static, prefill_insert
from shared.catalog import DEMO_LM, bundled_dir

_DEMO = dict(slots=2, max_context=64, prefill_buckets=(16, 32), decode_windows=(64,))
_PROMPTS = [list(range(30, 42)), list(range(50, 55))]
BUCKETS = ["step 1", "step 2", "prefill 16", "prefill 32"]
ROOM = 10**9  # a weight budget with room for the float copy: every form competes


def _demo(**kw) -> DecoderEngine:
    return DecoderEngine(bundled_dir(DEMO_LM), DEMO_LM, **{**_DEMO, **kw})


@pytest.fixture(scope="module")
def float32_tokens():
    """The demo model's greedy tokens in float32. Its int8 weights give the same
    tokens through the float and dequant forms (test_quant.py checks it)."""
    return generate_static(_demo(forms_cache=None), _PROMPTS, 12)


def _settle(engine: DecoderEngine, rounds: int = 20) -> None:
    """What the worker's runner does when idle: measure what is compiled, after the
    background compiles (which the measured choices add to) join."""
    for _ in range(rounds):
        if engine.forms.settled:
            return
        assert engine.programs.cache.wait_background(timeout=600)
        engine.tune(limit=100)
    raise AssertionError(f"not settled: {(engine.forms.measurements, engine.forms.units)}")


def test_a_cold_choice_file_is_measured_after_ready_and_read_by_the_next_start(
        tmp_path, monkeypatch, float32_tokens):  # fmt: skip
    path = tmp_path / "jax-cache" / forms.CACHE_NAME
    first = _demo(quant="int8", weight_budget=ROOM, forms_cache=path, compile_ahead="first")
    assert first.forms.candidates == ("float", "dequant", "w8a8")
    first.warmup(progress=False)
    # Ready: nothing measured, every bucket in the first candidate, nothing stored.
    assert (first.forms.measurements, first.forms.units) == (0, 12) and first.forms.measurements == 0
    assert set(first.forms.compute_forms.values()) == {"float"} and not path.exists()
    # The first request is served meanwhile, in float.
    assert generate_static(first, _PROMPTS, 12) == float32_tokens
    _settle(first)
    assert (first.forms.measurements, first.forms.units) == (12, 12) and first.forms.measured
    for bucket in BUCKETS:
        ms = first.forms.form_ms[bucket]
        assert set(ms) == {"float", "dequant", "w8a8"} and min(ms.values()) > 0
        assert first.forms.compute_forms[bucket] == min(ms, key=ms.get)
    chosen = set(first.forms.compute_forms.values())
    assert set(first.forms.held) == chosen  # the rest dropped, with their programs
    assert all(form == first.forms.compute_forms[form_bucket(kind, size)]
               for kind, size, _, form in first.programs.cache.keys())  # fmt: skip
    (entry,) = json.loads(path.read_text()).values()
    assert entry["choices"] == first.forms.compute_forms and entry["ms"] == first.forms.form_ms
    tokens = generate_static(first, _PROMPTS, 12)
    if "w8a8" not in chosen:  # float and dequant compute the same function
        assert tokens == float32_tokens

    def no_timing(*args, **kwargs):
        raise AssertionError("measured again")

    monkeypatch.setattr(forms, "timed", no_timing)
    second = _demo(quant="int8", weight_budget=ROOM, forms_cache=path, compile_ahead="first")
    second.warmup(progress=False)
    assert (second.forms.measurements, second.forms.units) == (0, 0) and not second.stats().tune_due
    assert second.forms.compute_forms == first.forms.compute_forms and second.forms.settled
    assert set(second.forms.held) == chosen
    assert generate_static(second, _PROMPTS, 12) == tokens


def test_a_bucket_switches_between_steps_without_changing_greedy_tokens(float32_tokens,
                                                                          monkeypatch):
    """Two sequences decode in float; their bucket's measured form (dequant, ranked
    first by a stand-in timer that still runs each program) takes over between two
    steps, and the tokens are float32's all the same."""
    eng = _demo(quant="int8", weight_budget=ROOM, forms_cache=None)
    eng.warmup(progress=False)
    rank = {"dequant": 1.0, "float": 2.0, "w8a8": 3.0}
    ran: list[tuple[str, str]] = []

    run_form = eng.runner.run_form

    def run(bucket: str, form: str):
        ran.append((bucket, form))
        return run_form(bucket, form)  # its program compiles and runs on the dummy row

    eng.runner.run_form = run
    monkeypatch.setattr(forms, "timed", lambda once, repeats: (once(), rank[ran[-1][1]])[1])
    seqs = [[prefill_insert(eng, i, p, GREEDY, 0)] for i, p in enumerate(_PROMPTS)]
    for _ in range(5):
        for seq, tok in zip(seqs, eng.step()):
            seq.append(int(tok))
    assert set(eng.forms.compute_forms.values()) == {"float"} and eng.programs.step_counts == {2: 5}
    assert eng.tune(limit=100) == 12 and len(ran) == 12 and eng.forms.settled
    assert set(eng.forms.compute_forms.values()) == {"dequant"} and list(eng.forms.held) == ["dequant"]
    for _ in range(6):
        for seq, tok in zip(seqs, eng.step()):
            seq.append(int(tok))
    assert ("step", 2, 64, "dequant") in eng.programs.cache.keys() and eng.programs.step_counts == {2: 11}
    assert seqs == float32_tokens


def test_a_cold_start_serves_with_the_models_last_stored_choice(tmp_path):
    """The file holds a choice for the demo model at other shapes: a start with no
    entry of its own runs those buckets in that choice while it measures, the
    others in the first candidate."""
    path = tmp_path / forms.CACHE_NAME
    forms.store(path, "other-shapes", {"model": DEMO_LM, "batches": [1, 2, 4]},
                {"step 1": "w8a8", "step 4": "w8a8", "prefill 16": "dequant"}, {})
    forms.store(path, "another-model", {"model": "another"}, {"step 2": "dequant"}, {})
    eng = _demo(quant="int8", weight_budget=ROOM, forms_cache=path)
    eng.warmup(progress=False)
    assert eng.forms.compute_forms == {"step 1": "w8a8", "step 2": "float", "prefill 16": "dequant",
                                 "prefill 32": "float"}  # fmt: skip
    assert (eng.forms.measurements, eng.forms.units) == (0, 12)
