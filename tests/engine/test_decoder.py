"""The JAX decoder engine against transformers on the same weights.

Tiny GPT-2 and Llama models are built from a config with random weights (fixed torch
seed, tests/support/tiny_models.py), saved in the Hugging Face layout, and loaded by
our engine; transformers' own
torch forward and `generate` are the reference. The Llama one has grouped-query
attention, a non-default rope_theta and an untied head; the GPT-2 one a tied head.
"""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from engine.decoder import DecoderEngine
from engine.decoder.model import decode_forward, prompt_logits
from engine.decoder.sampling import filter_logits, sample
from engine.decoder.static import generate_static, prefill_insert
from shared.catalog import DEMO_LM, bundled_dir
from shared.messages import Sampling
from tests.support.tiny_models import build as _build
from tests.support.tiny_models import hf_greedy as _hf_greedy

CONTEXT = 64
NEW = 32
GREEDY = Sampling(temperature=0.0)
# Mixed lengths, one of them filling most of the largest bucket.
PROMPTS = [[5, 17, 300, 42], list(range(40, 49)), list(range(100, 117)), list(range(7, 307, 10))]


@pytest.fixture(scope="module", params=["gpt2", "llama"])
def pair(request, tmp_path_factory):
    """(transformers model, our warmed-up engine) on the same saved weights."""
    out = tmp_path_factory.mktemp(request.param)
    ref = _build(request.param, out)
    # Two attention windows, so sequences cross from one step compile to the other.
    engine = DecoderEngine(out, request.param, slots=4, max_context=CONTEXT,
                           prefill_buckets=(16, 32), decode_windows=(32, 64),
                           compile_ahead="all")  # fmt: skip
    assert engine.warmup(progress=False) == len(engine.programs.compiles)
    return ref, engine


def _hf_logits(model, ids: list[int]) -> np.ndarray:
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].float().numpy()  # [T, V]


def test_prompt_logits_match_transformers(pair):
    ref, engine = pair
    fwd = jax.jit(lambda p, t: prompt_logits(p, engine.cfg, t))
    for prompt in PROMPTS:
        padded = np.zeros(32, np.int32)  # one bucket serves every prompt
        padded[: len(prompt)] = prompt
        ours = np.asarray(fwd(engine.params, padded))[: len(prompt)]
        np.testing.assert_allclose(ours, _hf_logits(ref, prompt), atol=1e-4, rtol=0)


def test_prompt_logprobs_match_transformers(pair):
    """`echo` with `logprobs`: each prompt token's log-softmax given the ones before it,
    and the top alternatives there, as transformers' logits say."""
    ref, engine = pair
    for prompt in PROMPTS[:3]:
        got = engine.prompt_logprobs(prompt, 5)
        want = torch.log_softmax(torch.tensor(_hf_logits(ref, prompt)), -1).numpy()
        assert [t for t, _, _, _ in got] == prompt[1:]
        np.testing.assert_allclose([lp for _, lp, _, _ in got],
                                   [want[i, t] for i, t in enumerate(prompt[1:])], atol=1e-4)
        for i, (tok, _, top, rank) in enumerate(got):
            assert [t for t, _ in top] == list(np.argsort(-want[i])[:5])
            np.testing.assert_allclose([v for _, v in top], np.sort(want[i])[::-1][:5], atol=1e-4)
            above = want[i] - want[i, tok]  # vLLM's rank: 1 + the more likely (near ties either)
            assert 1 + np.sum(above > 1e-4) <= rank <= 1 + np.sum(above > -1e-4)
    assert engine.prompt_logprobs([7], 3) == []


def test_decode_logits_match_transformers_for_mixed_lengths(pair):
    """One decode step over slots holding prompts of different lengths."""
    ref, engine = pair
    slots = [0, 2, 3]
    firsts = [prefill_insert(engine, s, p, GREEDY, 0) for s, p in zip(slots, PROMPTS[1:])]
    st, n = engine.runner.state, engine.slots  # the state's last row is the padding rows' dummy
    logits = jax.jit(lambda p, *a: decode_forward(p, engine.cfg, *a)[0])(
        engine.params, st.tokens[:n], st.positions[:n], engine.table.tables[:n], engine.table.active,
        st.k, st.v,
    )
    for s, p, first in zip(slots, PROMPTS[1:], firsts):
        expected = _hf_logits(ref, p + [first])[-1]
        np.testing.assert_allclose(np.asarray(logits)[s], expected, atol=1e-4, rtol=0)
        engine.free(s)


def test_continuous_batching_greedy_matches_generate(pair):
    """Requests join at different steps, into different slots, while others are mid
    decode; a freed slot is reused. Each must equal its own solo `generate`."""
    ref, engine = pair
    jobs = PROMPTS + [list(range(200, 211))]
    # (step at which it is inserted, slot)
    plan = [(0, 1), (3, 0), (7, 3), (8, 2), (33, 1)]
    got: dict[int, list[int]] = {}
    running: dict[int, int] = {}  # slot -> job
    step, pending = 0, list(enumerate(plan))
    while pending or running:
        for job, (at, slot) in [x for x in pending if x[1][0] == step]:
            assert slot not in running
            got[job] = [prefill_insert(engine, slot, jobs[job], GREEDY, 0)]
            running[slot] = job
            pending.remove((job, (at, slot)))
        if running:
            tokens = engine.step()
            for slot, job in list(running.items()):
                got[job].append(int(tokens[slot]))
                if len(got[job]) == NEW:
                    engine.free(slot)
                    del running[slot]
        step += 1
    for job, prompt in enumerate(jobs):
        assert got[job] == _hf_greedy(ref, prompt, NEW), f"request {job}"


def _sampled(engine, slot, sampling, seed, n=16, neighbours=()):
    for other, prompt in neighbours:
        prefill_insert(engine, other, prompt, Sampling(temperature=1.0), other + 100)
    out = [prefill_insert(engine, slot, PROMPTS[1], sampling, seed)]
    out += [int(engine.step()[slot]) for _ in range(n - 1)]
    for s in range(engine.slots):
        engine.free(s)
    return out


def test_seeded_sampling_is_reproducible_and_isolated(pair):
    _, engine = pair
    hot = Sampling(temperature=1.0)
    a = _sampled(engine, 0, hot, 7)
    # Same seed, another slot, other requests sampling beside it: same tokens.
    b = _sampled(engine, 3, hot, 7, neighbours=[(0, PROMPTS[0]), (1, PROMPTS[2])])
    c = _sampled(engine, 0, hot, 8)
    assert a == b
    assert a != c


def test_top_k_one_and_tiny_top_p_are_greedy(pair):
    ref, engine = pair
    greedy = _hf_greedy(ref, PROMPTS[1], 16)
    assert _sampled(engine, 1, Sampling(temperature=1.5, top_k=1), 3) == greedy
    assert _sampled(engine, 2, Sampling(temperature=1.5, top_p=1e-6), 4) == greedy


def test_async_step_overlaps_host_work_with_same_tokens(pair):
    """A slot inserted while a step is in flight joins at the next step."""
    ref, engine = pair
    a = [prefill_insert(engine, 0, PROMPTS[0], GREEDY, 0)]
    pending = engine.step_async()
    b = [prefill_insert(engine, 1, PROMPTS[2], GREEDY, 0)]  # queued behind the step
    a.append(int(pending.result()[0]))
    for _ in range(10):
        tokens = engine.step_async().result()
        a.append(int(tokens[0]))
        b.append(int(tokens[1]))
    engine.free(0)
    engine.free(1)
    assert a == _hf_greedy(ref, PROMPTS[0], 12)
    assert b == _hf_greedy(ref, PROMPTS[2], 11)


def test_prompt_limits(pair):
    _, engine = pair
    with pytest.raises(ValueError, match="at most 63"):
        prefill_insert(engine, 0, [1] * CONTEXT, GREEDY, 0)
    with pytest.raises(ValueError, match="empty"):
        prefill_insert(engine, 0, [], GREEDY, 0)
    assert prefill_insert(engine, 0, [1] * (CONTEXT - 1), GREEDY, 0) >= 0
    assert engine.context_left(0) == 0
    assert 0 < engine.table.kv_usage <= 1
    engine.free(0)
    assert engine.table.kv_usage == 0


# ------------------------------------------------------------------ sampling
def _hf_filtered(logits: np.ndarray, t: float, k: int, p: float) -> np.ndarray:
    from transformers.generation.logits_process import (
        TemperatureLogitsWarper,
        TopKLogitsWarper,
        TopPLogitsWarper,
    )

    x = torch.tensor(logits[None])
    x = TemperatureLogitsWarper(t)(None, x)
    if k > 0:
        x = TopKLogitsWarper(k)(None, x)
    if p < 1.0:
        x = TopPLogitsWarper(p)(None, x)
    return x[0].numpy()


CASES = [(1.0, 0, 1.0), (0.7, 5, 1.0), (1.0, 0, 0.8), (1.3, 20, 0.5), (0.5, 3, 0.95), (2.0, 1, 1.0)]


def test_filter_logits_matches_transformers_warpers():
    rng = np.random.default_rng(0)
    logits = rng.normal(0, 3, size=(len(CASES), 64)).astype(np.float32)
    t, k, p = (np.array(col, dt) for col, dt in zip(zip(*CASES), (np.float32, np.int32, np.float32)))
    ours = np.asarray(jax.jit(filter_logits)(logits, t, k, p))
    for row, case in enumerate(CASES):
        expected = _hf_filtered(logits[row], *case)
        assert np.array_equal(np.isfinite(ours[row]), np.isfinite(expected)), case
        keep = np.isfinite(expected)
        np.testing.assert_allclose(ours[row][keep], expected[keep], rtol=1e-6)


def test_sample_frequencies_follow_filtered_distribution():
    """Draws (one per position, as a sequence makes them) land only on the kept
    tokens, with the reference's renormalised probabilities."""
    logits = np.log(np.array([0.3, 0.25, 0.15, 0.1, 0.08, 0.06, 0.04, 0.02], np.float32))
    n = 6000
    for case in [(0.8, 5, 1.0), (1.0, 0, 0.75), (1.0, 0, 1.0)]:
        expected = _hf_filtered(logits, *case)
        probs = np.exp(expected - expected.max())
        probs /= probs.sum()
        full = lambda v, dt: jnp.full((n,), v, dt)  # noqa: E731
        draws = jax.jit(sample)(
            jnp.tile(jnp.asarray(logits), (n, 1)), jnp.tile(jax.random.PRNGKey(1), (n, 1)),
            jnp.arange(n, dtype=jnp.int32), full(case[0], jnp.float32),
            full(case[1], jnp.int32), full(case[2], jnp.float32),
        )  # fmt: skip
        freq = np.bincount(np.asarray(draws), minlength=len(logits)) / n
        assert set(np.flatnonzero(freq)) == set(np.flatnonzero(probs)), case
        np.testing.assert_allclose(freq, probs, atol=0.025)


# ------------------------------------------------------------ real weights
def test_demo_model_matches_transformers():
    """The bundled model: logits at every prompt position, then greedy text."""
    from transformers import AutoModelForCausalLM

    d = bundled_dir(DEMO_LM)
    ref = AutoModelForCausalLM.from_pretrained(d).eval()
    ref.generation_config.eos_token_id = None
    engine = DecoderEngine(d, DEMO_LM, slots=2, max_context=64, prefill_buckets=(16,))
    ids = engine.tokenizer.encode("This module provides functions for working with files.")
    padded = np.zeros(16, np.int32)
    padded[: len(ids)] = ids
    fwd = jax.jit(lambda p, t: prompt_logits(p, engine.cfg, t))
    ours = np.asarray(fwd(engine.params, padded))[: len(ids)]
    np.testing.assert_allclose(ours, _hf_logits(ref, ids), atol=1e-4, rtol=0)
    [tokens] = generate_static(engine, [ids], 24)
    assert tokens == _hf_greedy(ref, ids, 24)
    assert engine.eos_token_ids == (0,)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_half_precision_tracks_float32_reference(tmp_path, dtype):
    """Prompt logits and one cached decode step in half precision, against the float32
    reference, within what 8 to 11 bits of mantissa allow."""
    ref = _build("llama", tmp_path)
    engine = DecoderEngine(tmp_path, dtype, dtype=dtype, slots=2, max_context=CONTEXT,
                           prefill_buckets=(32,))  # fmt: skip
    prompt = PROMPTS[3]
    padded = np.zeros(32, np.int32)
    padded[: len(prompt)] = prompt
    fwd = jax.jit(lambda p, t: prompt_logits(p, engine.cfg, t))
    ours = np.asarray(fwd(engine.params, padded))[: len(prompt)]
    expected = _hf_logits(ref, prompt)
    scale = np.abs(expected).max()
    assert np.abs(ours - expected).max() < 0.05 * scale
    assert (ours.argmax(-1) == expected.argmax(-1)).mean() >= 0.9
    first = prefill_insert(engine, 1, prompt, GREEDY, 0)
    st, n = engine.runner.state, engine.slots
    assert st.k[0].dtype == jnp.dtype(dtype)
    step = jax.jit(lambda p, *a: decode_forward(p, engine.cfg, *a)[0])
    got = np.asarray(step(engine.params, st.tokens[:n], st.positions[:n], engine.table.tables[:n],
                          engine.table.active, st.k, st.v))[1]
    want = _hf_logits(ref, prompt + [first])[-1]
    assert np.abs(got - want).max() < 0.05 * scale


def test_config_variants_load_as_their_family():
    from engine.decoder.config import LLAMA, from_dict

    mistral = from_dict({
        "model_type": "mistral", "vocab_size": 32000, "hidden_size": 4096,
        "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32,
        "num_key_value_heads": 8, "max_position_embeddings": 32768, "rope_theta": 1e6,
        "sliding_window": 4096,
    })  # fmt: skip
    assert (mistral.family, mistral.groups, mistral.sliding_window) == (LLAMA, 4, 4096)
    assert mistral.rope_theta == 1e6 and not mistral.tie_embeddings
    nested = from_dict({
        "model_type": "llama", "vocab_size": 8, "hidden_size": 8, "intermediate_size": 8,
        "num_hidden_layers": 1, "num_attention_heads": 2,
        "rope_parameters": {"rope_type": "default", "rope_theta": 500.0},
    })  # fmt: skip
    assert nested.rope_theta == 500.0 and nested.kv_heads == 2
