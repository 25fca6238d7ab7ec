"""Penalties, logit_bias and min_p on the device, against independent references:
transformers' RepetitionPenaltyLogitsProcessor and MinPLogitsWarper, OpenAI's
documented formula for presence and frequency penalties (logit -= presence *
(count > 0) + frequency * count), and transformers' own forward pass for whole
greedy sequences under those controls."""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import jax
import numpy as np
import pytest
import torch

from engine.decoder import DecoderEngine
from engine.decoder.sampling import filter_logits, penalize
from engine.decoder.static import prefill_insert
from shared.messages import Sampling
from tests.support.sampling_refs import hf_repetition as _hf_repetition
from tests.support.sampling_refs import openai_penalties as _openai
from tests.support.sampling_refs import reference_greedy as _reference_greedy
from tests.support.tiny_models import build

V = 64
PROMPT = list(range(40, 49))
NEW = 16


def _ours(logits, prompt, generated, presence=0.0, frequency=0.0, repetition=1.0, bias=()):
    counts = np.bincount(generated, minlength=V).astype(np.int32)[None]
    seen = np.zeros((1, V), bool)
    seen[0, prompt] = True
    ids, vals = np.zeros((1, 8), np.int32), np.zeros((1, 8), np.float32)
    for i, (t, b) in enumerate(bias):
        ids[0, i], vals[0, i] = t, b
    f32 = lambda x: np.array([x], np.float32)  # noqa: E731
    out = jax.jit(penalize)(logits[None], counts, seen, f32(presence), f32(frequency),
                            f32(repetition), ids, vals)
    return np.asarray(out)[0]


@pytest.fixture
def case():
    rng = np.random.default_rng(0)
    logits = rng.normal(0, 3, size=V).astype(np.float32)
    prompt = [3, 7, 7, 20]
    generated = [7, 11, 11, 11, 40, 3]
    return logits, prompt, generated


@pytest.mark.parametrize("penalty", [1.3, 0.7])
def test_repetition_penalty_changes_what_transformers_changes(case, penalty):
    logits, prompt, generated = case
    expected = _hf_repetition(logits, prompt + generated, penalty)
    ours = _ours(logits, prompt, generated, repetition=penalty)
    np.testing.assert_allclose(ours, expected, rtol=1e-6)
    assert set(np.flatnonzero(ours != logits)) == set(np.flatnonzero(expected != logits))


@pytest.mark.parametrize("presence,frequency", [(0.5, 0.0), (0.0, 0.3), (1.5, -0.4), (-2.0, 1.5)])
def test_presence_and_frequency_follow_openai_formula(case, presence, frequency):
    logits, prompt, generated = case
    expected = _openai(logits, generated, presence, frequency)
    ours = _ours(logits, prompt, generated, presence=presence, frequency=frequency)
    np.testing.assert_allclose(ours, expected, rtol=1e-6)
    # The prompt's tokens are not penalised (OpenAI counts sampled tokens only).
    assert set(np.flatnonzero(ours != logits)) == set(generated)


def test_logit_bias_adds_to_exactly_its_tokens(case):
    logits, prompt, generated = case
    bias = [(5, 100.0), (9, -100.0), (33, 2.5)]
    ours = _ours(logits, prompt, generated, bias=bias)
    expected = logits.copy()
    for t, b in bias:
        expected[t] += b
    np.testing.assert_allclose(ours, expected, rtol=1e-6)


def test_min_p_matches_transformers_warper():
    from transformers.generation.logits_process import MinPLogitsWarper, TemperatureLogitsWarper

    rng = np.random.default_rng(1)
    logits = rng.normal(0, 3, size=(4, V)).astype(np.float32)
    cases = [(1.0, 0.05), (0.7, 0.2), (1.5, 0.5), (1.0, 0.9)]
    t, m = (np.array(col, np.float32) for col in zip(*cases))
    off_k, off_p = np.zeros(4, np.int32), np.ones(4, np.float32)
    ours = np.asarray(jax.jit(filter_logits)(logits, t, off_k, off_p, m))
    for row, (temp, min_p) in enumerate(cases):
        x = TemperatureLogitsWarper(temp)(None, torch.tensor(logits[row][None]))
        expected = MinPLogitsWarper(min_p)(None, x)[0].numpy()
        assert np.array_equal(np.isfinite(ours[row]), np.isfinite(expected)), (temp, min_p)
        keep = np.isfinite(expected)
        np.testing.assert_allclose(ours[row][keep], expected[keep], rtol=1e-6)


# ---------------------------------------------------------- whole sequences
@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    out = tmp_path_factory.mktemp("controls")
    ref = build("llama", out)
    engine = DecoderEngine(out, "controls", slots=4, max_context=64, prefill_buckets=(16,),
                           decode_windows=(64,))  # fmt: skip
    engine.warmup(progress=False)
    return ref, engine


def _run(engine, slot, sampling, seed, neighbours=()):
    for other, (prompt, s) in neighbours:
        prefill_insert(engine, other, prompt, s, other + 100)
    out = [prefill_insert(engine, slot, PROMPT, sampling, seed)]
    out += [int(engine.step()[slot]) for _ in range(NEW - 1)]
    for s in range(engine.slots):
        engine.free(s)
    return out


CONTROLS = [
    Sampling(temperature=0.0, repetition_penalty=1.5),
    Sampling(temperature=0.0, frequency_penalty=1.0, presence_penalty=0.5),
    Sampling(temperature=0.0, logit_bias=[(PROMPT[0], 5.0), (7, -100.0)], presence_penalty=2.0),
]


@pytest.mark.parametrize("sampling", CONTROLS, ids=["repetition", "frequency+presence", "bias"])
def test_greedy_under_controls_matches_reference(pair, sampling):
    ref, engine = pair
    expected = _reference_greedy(ref, PROMPT, NEW, sampling)
    assert expected != _reference_greedy(ref, PROMPT, NEW, Sampling(temperature=0.0))
    # Alone, then beside sequences without controls and with others.
    assert _run(engine, 0, sampling, 0) == expected
    plain = Sampling(temperature=0.0)
    assert _run(engine, 2, sampling, 0, neighbours=[
        (0, ([5, 17, 300, 42], plain)), (1, (list(range(9, 20)), CONTROLS[1])),
        (3, ([1, 2, 3], Sampling(temperature=1.0)))]) == expected


def test_seed_reproduces_alone_and_in_a_full_batch(pair):
    _, engine = pair
    hot = Sampling(temperature=1.0, top_p=0.9, min_p=0.05, frequency_penalty=0.5,
                   repetition_penalty=1.2, logit_bias=[(3, 2.0)])
    alone = _run(engine, 1, hot, 11)
    full = _run(engine, 3, hot, 11, neighbours=[
        (0, (PROMPT, Sampling(temperature=1.0))), (1, ([4, 5, 6], CONTROLS[0])),
        (2, (list(range(20, 30)), Sampling(temperature=0.7, presence_penalty=1.0)))])
    assert alone == full
    assert alone != _run(engine, 1, hot, 12)


# ------------------------------------------------------------- logprobs
def _hf_logprobs(model, ids: list[int]) -> np.ndarray:
    with torch.no_grad():
        return torch.log_softmax(model(torch.tensor([ids])).logits[0, -1].float(), -1).numpy()


@pytest.mark.parametrize("sampling", [
    Sampling(temperature=0.0, logprobs=5),
    # The model's own distribution, whatever the controls did to the draw.
    Sampling(temperature=0.8, repetition_penalty=1.5, logit_bias=[(7, 3.0)], logprobs=20),
    Sampling(temperature=0.0, logprobs=0),
], ids=["greedy", "controls", "token-only"])
def test_logprobs_are_transformers_log_softmax(pair, sampling):
    ref, engine = pair
    prefill_insert(engine, 1, [5, 17, 300, 42], Sampling(temperature=1.0), 1)  # asks for none
    got = [(prefill_insert(engine, 0, PROMPT, sampling, 5), engine.token_logprobs(0))]
    assert engine.token_logprobs(1) is None
    for _ in range(NEW - 1):
        tokens = engine.step()
        got.append((int(tokens[0]), engine.token_logprobs(0)))
        assert engine.token_logprobs(1) is None
    for s in range(engine.slots):
        engine.free(s)
    ids = list(PROMPT)
    for token, (lp, top) in got:
        expected = _hf_logprobs(ref, ids)
        assert abs(lp - expected[token]) < 1e-3
        assert len(top) == sampling.logprobs
        best = np.argsort(-expected)[: len(top)]
        np.testing.assert_allclose([v for _, v in top], expected[best], atol=1e-3)
        assert [i for i, _ in top] == best.tolist() or np.allclose(  # ties may swap
            expected[[i for i, _ in top]], expected[best], atol=1e-5)
        ids.append(token)
