"""Today's decoder families in the JAX engine, against transformers on the same weights.

Each family is a tiny model built from its transformers config (random weights, fixed
seed, every norm weight perturbed so a wrong norm formula shows), saved in the Hugging
Face layout and loaded by the engine:

- Qwen3: an RMSNorm of each query and key head before RoPE.
- Phi-3: q/k/v and gate/up stored fused.
- Mistral: a sliding window (8) far shorter than the sequences, served by masking.
- Llama 3.x: its RoPE scaling (llama3 rope type).
- Gemma 2: embeddings scaled, (1 + w) norms around both the attention and the MLP,
  query_pre_attn_scalar, attention and final-logit soft-capping, alternating local
  and global layers.
- Gemma 3 (text): Gemma's layers with q/k norms and no capping, and the local
  layers' own RoPE base.

For each: every position's logits of a prompt longer than the window, and the greedy
tokens of the serving path (chunked prefill, paged decode, crossing windows), equal
transformers'.
"""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import jax
import numpy as np
import pytest
import torch

from engine.decoder import DecoderEngine
from engine.decoder.config import UnsupportedDecoder, from_dict, load_config
from engine.decoder.model import prompt_logits
from engine.decoder.static import generate_static
from tests.support.tiny_models import VOCAB, hf_greedy, write_tokenizer

CONTEXT = 64
NEW = 24
PROMPTS = [list(range(3, 23)), [5, 17, 300, 42, 7, 9, 11, 250, 3, 8, 60, 61, 62]]
COMMON = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=128, bos_token_id=0,
              eos_token_id=0, pad_token_id=0, initializer_range=0.1)


def _config(kind: str):
    import transformers as T

    if kind == "qwen3":
        return T.Qwen3Config(num_hidden_layers=2, head_dim=16, tie_word_embeddings=False,
                             rope_parameters={"rope_type": "default", "rope_theta": 500.0},
                             **COMMON)
    if kind == "phi3":
        return T.Phi3Config(num_hidden_layers=2, **COMMON)
    if kind == "mistral":
        return T.MistralConfig(num_hidden_layers=2, head_dim=16, sliding_window=8, **COMMON)
    if kind == "llama3":
        return T.LlamaConfig(num_hidden_layers=2, rope_parameters={
            "rope_type": "llama3", "rope_theta": 500.0, "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 16}, **COMMON)
    if kind == "gemma2":
        return T.Gemma2Config(num_hidden_layers=4, head_dim=16, sliding_window=8,
                              query_pre_attn_scalar=24, attn_logit_softcapping=2.0,
                              final_logit_softcapping=3.0, attn_implementation="eager",
                              **COMMON)
    return T.Gemma3TextConfig(
        num_hidden_layers=4, head_dim=16, sliding_window=8, query_pre_attn_scalar=24,
        layer_types=["sliding_attention", "full_attention"] * 2,
        rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 100.0},
                         "full_attention": {"rope_type": "default", "rope_theta": 5000.0}},
        attn_implementation="eager", **COMMON)


FAMILIES = ["qwen3", "phi3", "mistral", "llama3", "gemma2", "gemma3"]


@pytest.fixture(scope="module", params=FAMILIES)
def pair(request, tmp_path_factory):
    from transformers import AutoModelForCausalLM

    out = tmp_path_factory.mktemp(request.param)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(_config(request.param))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:  # Gemma's start at 0, the others' at 1: both hide mistakes
                p.copy_(torch.randn_like(p) * 0.3 + (0.0 if "gemma" in request.param else 1.0))
    model.eval()
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    model.save_pretrained(out, safe_serialization=True)
    write_tokenizer(out)
    engine = DecoderEngine(out, request.param, slots=2, max_context=CONTEXT,
                           prefill_buckets=(8,), decode_windows=(64,))
    engine.warmup(progress=False)
    return model, engine


def test_prompt_logits_match_transformers(pair):
    ref, engine = pair
    fwd = jax.jit(lambda p, t: prompt_logits(p, engine.cfg, t))
    for prompt in PROMPTS:
        padded = np.zeros(32, np.int32)
        padded[: len(prompt)] = prompt
        ours = np.asarray(fwd(engine.params, padded))[: len(prompt)]
        with torch.no_grad():
            want = ref(torch.tensor([prompt])).logits[0].float().numpy()
        np.testing.assert_allclose(ours, want, atol=2e-4, rtol=0)


def test_served_greedy_tokens_match_transformers(pair):
    """Prompts longer than the prefill chunk (8) and the window (8), then NEW tokens
    decoded over the paged cache: each equals transformers' generate."""
    ref, engine = pair
    got = generate_static(engine, PROMPTS, NEW)
    for prompt, ours in zip(PROMPTS, got):
        assert ours == hf_greedy(ref, prompt, NEW)


def test_what_each_config_says_is_read():
    gemma2 = from_dict(_config("gemma2").to_dict())
    assert gemma2.gemma and gemma2.attn_softcap == 2.0 and gemma2.final_softcap == 3.0
    assert [gemma2.window(i) for i in range(4)] == [8, None, 8, None]
    assert gemma2.scale == pytest.approx(24 ** -0.5) and gemma2.tie_embeddings
    gemma3 = from_dict(_config("gemma3").to_dict())
    assert gemma3.qk_norm and gemma3.local_rope_theta == 100.0 and gemma3.rope_theta == 5000.0
    qwen3 = from_dict(_config("qwen3").to_dict())
    assert qwen3.qk_norm and qwen3.sliding_window is None
    # Qwen2/3 carry a window they do not use unless use_sliding_window says so.
    assert from_dict({**_config("qwen3").to_dict(), "sliding_window": 4096}).sliding_window is None


@pytest.mark.parametrize("change,needle", [
    ({"model_type": "mamba"}, "model_type 'mamba'"),
    ({"partial_rotary_factor": 0.75}, "partial rotary"),  # Llama's attention rotates all
    ({"rope_scaling": {"rope_type": "proportional", "factor": 4.0}}, "proportional"),
])
def test_what_the_engine_does_not_compute_is_refused_by_name(change, needle):
    cfg = {**_config("llama3").to_dict(), **change}
    cfg.pop("rope_parameters") if "rope_scaling" in change else None
    with pytest.raises(UnsupportedDecoder, match=needle):
        from_dict(cfg)


def test_the_torch_engine_refuses_what_it_does_not_compute(tmp_path):
    from engine.torch_decoder.model import check_served

    torch.manual_seed(0)
    from transformers import AutoModelForCausalLM

    for kind in ("qwen3", "gemma2", "mistral"):
        AutoModelForCausalLM.from_config(_config(kind)).save_pretrained(tmp_path / kind)
        with pytest.raises(UnsupportedDecoder, match="TENSORBUS_ENGINE=jax"):
            check_served(load_config(tmp_path / kind))
    AutoModelForCausalLM.from_config(_config("phi3")).save_pretrained(tmp_path / "phi3")
    check_served(load_config(tmp_path / "phi3"))  # the plain loop: served
