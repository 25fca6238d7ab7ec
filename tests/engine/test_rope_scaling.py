"""RoPE scalings for long context, and partial rotary, against transformers on the
same weights (tiny models built from each family's transformers config, random
weights, a pre-training length of 32 and sequences past it):

- YaRN (Qwen2.5's form: factor and original length), and DeepSeek's form on Llama
  (mscale / mscale_all_dim, beta_fast / beta_slow, truncate false).
- longrope (Phi-3.5 / Phi-3-128k) on Phi-3 with partial rotary 0.75 (Phi-4-mini):
  a prompt past the original length takes the long factors, a sequence within it
  the short ones.
- dynamic NTK: transformers rescales only past max_position_embeddings, which no
  served sequence reaches (the context is capped there): the default RoPE, checked
  up to that length.

For each: every position's logits of the prompts, and the greedy tokens of the
serving path (chunked prefill, paged decode), equal transformers'.
"""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import jax
import numpy as np
import pytest
import torch

from engine.decoder import DecoderEngine
from engine.decoder.config import UnsupportedDecoder, from_dict
from engine.decoder.host import capped_context
from engine.decoder.model import prompt_logits
from engine.decoder.static import generate_static
from tests.support.tiny_models import VOCAB, hf_greedy, write_tokenizer

ORIGINAL = 32  # the pre-training length the scalings extend
NEW = 8
LONG = [(7 * i + 3) % 250 + 3 for i in range(48)]  # past ORIGINAL
SHORT = [5, 17, 300, 42, 7, 9, 11, 250, 3, 8, 60, 61]  # with NEW tokens, within it
COMMON = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_attention_heads=4,
              num_key_value_heads=2, num_hidden_layers=2, bos_token_id=0, eos_token_id=0,
              pad_token_id=0, initializer_range=0.1)
LONGROPE = {"rope_type": "longrope", "rope_theta": 500.0, "partial_rotary_factor": 0.75,
            "short_factor": [1.0, 1.1, 1.3, 1.6, 2.0, 2.5],
            "long_factor": [1.0, 1.5, 2.5, 4.0, 6.0, 9.0]}


def _config(kind: str):
    import transformers as T

    if kind == "yarn":  # Qwen2.5's long-context form
        return T.Qwen2Config(max_position_embeddings=128, rope_parameters={
            "rope_type": "yarn", "rope_theta": 500.0, "factor": 4.0,
            "original_max_position_embeddings": ORIGINAL}, **COMMON)
    if kind == "yarn-mscale":  # DeepSeek's fields
        return T.LlamaConfig(max_position_embeddings=128, rope_parameters={
            "rope_type": "yarn", "rope_theta": 500.0, "factor": 4.0, "beta_fast": 16.0,
            "beta_slow": 2.0, "mscale": 1.0, "mscale_all_dim": 0.5, "truncate": False,
            "original_max_position_embeddings": ORIGINAL}, **COMMON)
    if kind == "longrope":  # Phi-3.5's factors, Phi-4-mini's partial rotary
        return T.Phi3Config(max_position_embeddings=128, original_max_position_embeddings=ORIGINAL,
                            rope_parameters=dict(LONGROPE), **COMMON)
    return T.LlamaConfig(max_position_embeddings=64, rope_parameters={
        "rope_type": "dynamic", "rope_theta": 500.0, "factor": 2.0}, **COMMON)


KINDS = ["yarn", "yarn-mscale", "longrope", "dynamic"]


@pytest.fixture(scope="module", params=KINDS)
def pair(request, tmp_path_factory):
    from transformers import AutoModelForCausalLM

    out = tmp_path_factory.mktemp(request.param)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(_config(request.param))
    model.eval()
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    model.save_pretrained(out, safe_serialization=True)
    write_tokenizer(out)
    # longrope picks its factors by the length of the forward that computes the keys:
    # a prompt past ORIGINAL is prefilled in one chunk, as transformers computes it.
    chunk = 64 if request.param == "longrope" else 16
    engine = DecoderEngine(out, request.param, slots=2, max_context=64,
                           prefill_buckets=(chunk,), decode_windows=(64,))
    engine.warmup(progress=False)
    return model, engine


def test_prompt_logits_match_transformers(pair):
    ref, engine = pair
    fwd = jax.jit(lambda p, t, n: prompt_logits(p, engine.cfg, t, n))
    for prompt in (LONG, SHORT):
        padded = np.zeros(64, np.int32)
        padded[: len(prompt)] = prompt
        ours = np.asarray(fwd(engine.params, padded, np.int32(len(prompt))))[: len(prompt)]
        with torch.no_grad():
            want = ref(torch.tensor([prompt])).logits[0].float().numpy()
        np.testing.assert_allclose(ours, want, atol=2e-4, rtol=0)


def test_served_greedy_tokens_match_transformers(pair):
    """LONG (48 tokens, past ORIGINAL) and SHORT (within it, NEW tokens included):
    prefilled, NEW tokens decoded over the paged cache, each equal to transformers'
    generate."""
    ref, engine = pair
    got = generate_static(engine, [LONG, SHORT], NEW)
    for prompt, ours in zip((LONG, SHORT), got):
        assert ours == hf_greedy(ref, prompt, NEW)


def test_what_each_scaling_reads():
    yarn = from_dict(_config("yarn").to_dict())
    assert yarn.rope_scaling[:3] == ("yarn", 4.0, ORIGINAL)
    assert yarn.rope_scaling[5] == pytest.approx(0.1 * np.log(4.0) + 1)  # the paper's mscale
    deep = from_dict(_config("yarn-mscale").to_dict())
    assert deep.rope_scaling[3:] == (16.0, 2.0, pytest.approx(
        (0.1 * np.log(4.0) + 1) / (0.05 * np.log(4.0) + 1)), False)
    phi = from_dict(_config("longrope").to_dict())
    assert (phi.rotary_dim, phi.rope_scaling[3]) == (12, ORIGINAL)
    assert phi.rope_scaling[4] == pytest.approx(np.sqrt(1 + np.log(4.0) / np.log(ORIGINAL)))
    dynamic = from_dict(_config("dynamic").to_dict())
    # Served no longer than max_position_embeddings, where dynamic NTK is the default.
    assert dynamic.rope_scaling == ("dynamic", 2.0) and capped_context(dynamic, 4096) == 64


@pytest.mark.parametrize("kind,change,needle", [
    ("longrope", {"rope_parameters": {**LONGROPE, "short_factor": [1.0] * 8}}, "factors"),
    ("longrope", {"rope_parameters": {**LONGROPE, "partial_rotary_factor": 0.7}}, "even"),
    ("yarn", {"partial_rotary_factor": 0.5}, "partial rotary"),  # Qwen2 rotates every dim
])
def test_what_is_not_computed_is_refused(kind, change, needle):
    with pytest.raises(UnsupportedDecoder, match=needle):
        from_dict({**_config(kind).to_dict(), **change})
