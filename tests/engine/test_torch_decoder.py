"""The torch decoder engine against transformers and against the JAX engine.

The same tiny GPT-2 (tied head) and Llama (grouped-query attention, rope_theta 500,
untied head) as tests/engine/test_decoder.py, built from a config with random
weights and saved in the Hugging Face layout (tests/support/tiny_models.py).
References: transformers' own forward and `generate` for the math, the JAX
`DecoderEngine` on the same directory for the greedy tokens the worker streams.
"""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import numpy as np
import pytest
import torch

from engine.decoder import DecoderEngine
from engine.decoder.static import generate_static, prefill_insert
from engine.interface import Decoder
from engine.torch_decoder import TorchDecoder
from engine.torch_decoder import model as M
from engine.torch_decoder.sampling import filter_logits, sample
from shared.catalog import DEMO_LM, bundled_dir
from shared.messages import Sampling
from tests.support.tiny_models import hf_greedy, serve_tiny

CONTEXT = 64
NEW = 32
GREEDY = Sampling(temperature=0.0)
PROMPTS = [[5, 17, 300, 42], list(range(40, 49)), list(range(100, 117)), list(range(7, 307, 10))]


@pytest.fixture(scope="module", params=["gpt2", "llama"])
def trio(request, tmp_path_factory, jax_cache_dir):
    """(transformers model, warmed JAX engine, torch engine) on the same saved weights."""
    out = tmp_path_factory.mktemp(request.param)
    ref, jax_engine = serve_tiny(request.param, out, request.param, CONTEXT)
    engine = TorchDecoder(out, request.param, slots=4, max_context=CONTEXT)
    assert engine.warmup(progress=False) == 0
    return ref, jax_engine, engine


def _hf_logits(model, ids: list[int]) -> np.ndarray:
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].float().numpy()  # [T, V]


@torch.inference_mode()
def _prompt_logits(engine: TorchDecoder, prompt: list[int], slot: int = 0) -> np.ndarray:
    x = M.prompt_forward(engine.params, engine.cfg, torch.tensor(prompt), engine._k,
                         engine._v, slot)  # fmt: skip
    return M.head(engine.params, engine.cfg, x).numpy()  # [T, V]


def test_prompt_logits_match_transformers(trio):
    ref, _, engine = trio
    for prompt in PROMPTS:
        np.testing.assert_allclose(_prompt_logits(engine, prompt), _hf_logits(ref, prompt),
                                   atol=1e-4, rtol=0)  # fmt: skip


def test_decode_logits_match_transformers_for_mixed_lengths(trio):
    """One decode step over slots holding prompts of different lengths, with a free
    slot among them."""
    ref, _, engine = trio
    slots = [0, 2, 3]
    firsts = [prefill_insert(engine, s, p, GREEDY, 0) for s, p in zip(slots, PROMPTS[1:])]
    positions = np.zeros(4, np.int64)  # the free slot 1 computes at position 0
    positions[slots] = [len(p) for p in PROMPTS[1:]]
    tokens = torch.from_numpy(engine._tokens.copy())
    with torch.inference_mode():
        logits = M.decode_forward(engine.params, engine.cfg, tokens, torch.from_numpy(positions),
                                  engine._k, engine._v, int(positions.max()) + 1).numpy()
    for s, p, first in zip(slots, PROMPTS[1:], firsts):
        np.testing.assert_allclose(logits[s], _hf_logits(ref, p + [first])[-1], atol=1e-4, rtol=0)
        engine.free(s)


def _continuous_batch(engine, jobs: list[list[int]]) -> dict[int, list[int]]:
    """Requests join at different steps, into different slots, while others are mid
    decode; slot 1 is freed and reused; slot 2 sits free while slot 3 decodes."""
    plan = [(0, 1), (3, 0), (7, 3), (8, 2), (33, 1)]  # (step it is inserted at, slot)
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
    return got


def test_continuous_batching_greedy_equals_the_jax_engine(trio):
    ref, jax_engine, engine = trio
    jobs = PROMPTS + [list(range(200, 211))]
    ours, theirs = _continuous_batch(engine, jobs), _continuous_batch(jax_engine, jobs)
    for job, prompt in enumerate(jobs):
        assert len(ours[job]) == NEW
        assert ours[job] == theirs[job], f"request {job}"
        assert ours[job] == hf_greedy(ref, prompt, NEW), f"request {job}"
    assert engine.stats().active == 0 and engine.stats().cache.held / engine.stats().cache.blocks == 0


def test_async_step_then_insert_joins_the_next_step(trio):
    ref, _, engine = trio
    a = [prefill_insert(engine, 0, PROMPTS[0], GREEDY, 0)]
    pending = engine.step_async()
    b = [prefill_insert(engine, 1, PROMPTS[2], GREEDY, 0)]
    a.append(int(pending.result()[0]))
    for _ in range(10):
        tokens = engine.step_async().result()
        a.append(int(tokens[0]))
        b.append(int(tokens[1]))
    engine.free(0)
    engine.free(1)
    assert a == hf_greedy(ref, PROMPTS[0], 12)
    assert b == hf_greedy(ref, PROMPTS[2], 11)


def _sampled(engine, slot, sampling, seed, n=16, neighbours=()):
    for other, prompt in neighbours:
        prefill_insert(engine, other, prompt, Sampling(temperature=1.0), other + 100)
    out = [prefill_insert(engine, slot, PROMPTS[1], sampling, seed)]
    out += [int(engine.step()[slot]) for _ in range(n - 1)]
    for s in range(engine.slots):
        engine.free(s)
    return out


def test_seeded_sampling_is_reproducible_and_isolated(trio):
    _, _, engine = trio
    hot = Sampling(temperature=1.0)
    a = _sampled(engine, 0, hot, 7)
    # Same seed, another slot, other requests sampling beside it: same tokens.
    b = _sampled(engine, 3, hot, 7, neighbours=[(0, PROMPTS[0]), (1, PROMPTS[2])])
    c = _sampled(engine, 0, hot, 8)
    assert a == b
    assert a != c


def test_top_k_one_and_tiny_top_p_are_greedy(trio):
    ref, _, engine = trio
    greedy = hf_greedy(ref, PROMPTS[1], 16)
    assert _sampled(engine, 1, Sampling(temperature=1.5, top_k=1), 3) == greedy
    assert _sampled(engine, 2, Sampling(temperature=1.5, top_p=1e-6), 4) == greedy


def test_prompt_limits(trio):
    _, _, engine = trio
    with pytest.raises(ValueError, match="at most 63"):
        prefill_insert(engine, 0, [1] * CONTEXT, GREEDY, 0)
    with pytest.raises(ValueError, match="empty"):
        prefill_insert(engine, 0, [], GREEDY, 0)
    with pytest.raises(ValueError, match="vocabulary"):
        prefill_insert(engine, 0, [1, engine.info.vocab_size], GREEDY, 0)
    assert prefill_insert(engine, 0, [1] * (CONTEXT - 1), GREEDY, 0) >= 0
    assert engine.context_left(0) == 0
    assert 0 < engine.stats().cache.held / engine.stats().cache.blocks <= 1
    engine.step()  # a full context decodes in place without leaving the cache
    engine.free(0)
    assert engine.stats().cache.held / engine.stats().cache.blocks == 0


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
    t, k, p = (torch.tensor(col, dtype=dt)
               for col, dt in zip(zip(*CASES), (torch.float32, torch.int64, torch.float32)))
    ours = filter_logits(torch.from_numpy(logits), t, k, p).numpy()
    for row, case in enumerate(CASES):
        expected = _hf_filtered(logits[row], *case)
        assert np.array_equal(np.isfinite(ours[row]), np.isfinite(expected)), case
        keep = np.isfinite(expected)
        np.testing.assert_allclose(ours[row][keep], expected[keep], rtol=1e-6)


def test_sample_frequencies_follow_filtered_distribution():
    """One sequence's successive draws land only on the kept tokens, with the
    reference's renormalised probabilities."""
    logits = np.log(np.array([0.3, 0.25, 0.15, 0.1, 0.08, 0.06, 0.04, 0.02], np.float32))
    n = 4000
    for case in [(0.8, 5, 1.0), (1.0, 0, 0.75), (1.0, 0, 1.0)]:
        expected = _hf_filtered(logits, *case)
        probs = np.exp(expected - expected.max())
        probs /= probs.sum()
        gen = torch.Generator().manual_seed(1)
        row = torch.from_numpy(logits)[None]
        params = (torch.tensor([case[0]]), torch.tensor([case[1]]), torch.tensor([case[2]]))
        draws = [int(sample(row, *params, [gen])[0]) for _ in range(n)]
        freq = np.bincount(draws, minlength=len(logits)) / n
        assert set(np.flatnonzero(freq)) == set(np.flatnonzero(probs)), case
        np.testing.assert_allclose(freq, probs, atol=0.025)


# ------------------------------------------------------------ real weights
def test_demo_model_matches_transformers_and_the_jax_engine(jax_cache_dir):
    from transformers import AutoModelForCausalLM

    d = bundled_dir(DEMO_LM)
    ref = AutoModelForCausalLM.from_pretrained(d).eval()
    ref.generation_config.eos_token_id = None
    engine = TorchDecoder(d, DEMO_LM, slots=2, max_context=64)
    ids = engine.tokenizer.encode("This module provides functions for working with files.")
    np.testing.assert_allclose(_prompt_logits(engine, ids), _hf_logits(ref, ids),
                               atol=1e-4, rtol=0)  # fmt: skip
    prompts = [ids, engine.tokenizer.encode("Return the")]
    ours = generate_static(engine, prompts, 24)
    jax_engine = DecoderEngine(d, DEMO_LM, slots=2, max_context=64, prefill_buckets=(16,))
    assert ours == generate_static(jax_engine, prompts, 24)
    assert ours[0] == hf_greedy(ref, ids, 24)
    assert engine.info.eos_token_ids == jax_engine.info.eos_token_ids == (0,)


def test_qwen2_attention_biases_and_tied_head(tmp_path, jax_cache_dir):
    """A Qwen2-style model (q/k/v biases, tied embeddings, config as transformers
    writes it) loads through the same path: logits and greedy tokens."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from tests.support.tiny_models import VOCAB, write_tokenizer

    torch.manual_seed(1)
    ref = Qwen2ForCausalLM(Qwen2Config(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=CONTEXT,
        rope_theta=1000.0, tie_word_embeddings=True, initializer_range=0.1,
        bos_token_id=0, eos_token_id=0)).eval()  # fmt: skip
    with torch.no_grad():  # visible biases (they start at zero)
        for layer in ref.model.layers:
            for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                proj.bias.normal_(0, 0.5)
    ref.generation_config.eos_token_id = None
    ref.generation_config.pad_token_id = 0
    ref.save_pretrained(tmp_path, safe_serialization=True)
    write_tokenizer(tmp_path)
    engine = TorchDecoder(tmp_path, "qwen2", slots=2, max_context=CONTEXT)
    assert engine.cfg.attn_bias and engine.cfg.tie_embeddings
    for prompt in PROMPTS[:3]:
        np.testing.assert_allclose(_prompt_logits(engine, prompt), _hf_logits(ref, prompt),
                                   atol=1e-4, rtol=0)  # fmt: skip
    jax_engine = DecoderEngine(tmp_path, "qwen2", slots=2, max_context=CONTEXT,
                               prefill_buckets=(16,))  # fmt: skip
    ours = generate_static(engine, PROMPTS[:2], NEW)
    assert ours == generate_static(jax_engine, PROMPTS[:2], NEW)
    assert ours[1] == hf_greedy(ref, PROMPTS[1], NEW)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_half_precision_tracks_float32_reference(tmp_path, dtype):
    """Prompt logits and one cached decode step in half precision, against the float32
    reference, within what 8 to 11 bits of mantissa allow."""
    from tests.support.tiny_models import build

    ref = build("llama", tmp_path)
    engine = TorchDecoder(tmp_path, dtype, dtype=dtype, slots=2, max_context=CONTEXT)
    prompt = PROMPTS[3]
    ours = _prompt_logits(engine, prompt, slot=1)
    expected = _hf_logits(ref, prompt)
    scale = np.abs(expected).max()
    assert ours.dtype == np.float32 and engine._k[0].dtype == getattr(torch, dtype)
    assert np.abs(ours - expected).max() < 0.05 * scale
    assert (ours.argmax(-1) == expected.argmax(-1)).mean() >= 0.9
    first = prefill_insert(engine, 1, prompt, GREEDY, 0)
    positions = torch.tensor([0, len(prompt)])
    tokens = torch.from_numpy(engine._tokens.copy())
    with torch.inference_mode():
        got = M.decode_forward(engine.params, engine.cfg, tokens, positions, engine._k,
                               engine._v, len(prompt) + 1)[1].numpy()  # fmt: skip
    want = _hf_logits(ref, prompt + [first])[-1]
    assert np.abs(got - want).max() < 0.05 * scale


# ---------------------------------------------------------------- interface
def _members(protocol) -> set[str]:
    own = set(vars(protocol)) | set(getattr(protocol, "__annotations__", {}))
    return {m for m in own if not m.startswith("_")}


def test_both_engines_have_every_decoder_member(trio):
    _, jax_engine, engine = trio
    members = _members(Decoder)
    assert {"begin", "prefill_step", "step_async", "info", "stats"} <= members
    assert not {"prefill_insert", "generate_static"} & members  # tests' and bench's only
    for e in (jax_engine, engine):
        missing = [m for m in members if not hasattr(e, m)]
        assert not missing, f"{type(e).__name__} lacks {missing}"
    for m in ("slots", "max_context", "vocab_size", "dtype", "eos_token_ids"):
        assert getattr(engine.info, m) == getattr(jax_engine.info, m), m
