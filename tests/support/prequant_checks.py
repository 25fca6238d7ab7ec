"""The checks every pre-quantized checkpoint format meets (FP8 in
tests/engine/test_prequantized.py, AWQ and GPTQ in tests/engine/test_packed_ints.py):
the engine's logits equal transformers' on the dequantized weights, and so do the
served greedy tokens."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from tests.support.tiny_models import hf_greedy

CONTEXT = 64
PROMPTS = [[5, 17, 300, 42], list(range(40, 61))]


def hf_logits(model, ids: list[int]) -> np.ndarray:
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].float().numpy()


def assert_logits_equal(d: Path, ref, float_model, atol: float = 1e-4) -> None:
    """The engine's prompt logits from checkpoint `d` equal `ref`'s (transformers on
    its dequantized weights), and the quantization moved them past `atol` from
    `float_model`'s: the match is to the stored values, not to the float model."""
    import jax
    import jax.numpy as jnp

    from engine.decoder.config import load_config
    from engine.decoder.model import load_params, prompt_logits

    cfg = load_config(d)
    params = load_params(d, cfg, jnp.float32)
    fwd = jax.jit(lambda p, t: prompt_logits(p, cfg, t))
    for prompt in PROMPTS:
        padded = np.zeros(32, np.int32)
        padded[: len(prompt)] = prompt
        ours = np.asarray(fwd(params, padded))[: len(prompt)]
        want = hf_logits(ref, prompt)
        np.testing.assert_allclose(ours, want, atol=atol, rtol=0)
        assert np.abs(want - hf_logits(float_model, prompt)).max() > 1e-3


def assert_served_greedy_equal(d: Path, name: str, ref) -> None:
    """The serving path (chunked prefill, paged decode) on checkpoint `d` gives
    `ref`'s greedy tokens."""
    from engine.decoder import DecoderEngine
    from engine.decoder.static import generate_static

    engine = DecoderEngine(d, name, slots=2, max_context=CONTEXT,
                           prefill_buckets=(16,), decode_windows=(64,))  # fmt: skip
    engine.warmup(progress=False)
    for prompt, ours in zip(PROMPTS, generate_static(engine, PROMPTS, 16)):
        assert ours == hf_greedy(ref, prompt, 16)
