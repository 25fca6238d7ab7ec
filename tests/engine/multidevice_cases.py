"""Tensor-parallel engines against the unsharded engine, on three forced CPU devices.

Not collected by the main run (the name does not start with test_): XLA's device
count is fixed when jax is imported, so tests/engine/test_tensor_parallel.py runs
this file in its own pytest process with
`XLA_FLAGS=--xla_force_host_platform_device_count=3`. That is real SPMD partitioning
with real collectives between the three CPU "devices".

The reference is the same engine on one device (TENSOR_PARALLEL=1), itself tested
against sentence-transformers and transformers (test_encoder.py, test_decoder.py).
"""

from __future__ import annotations

import os

import jax
import numpy as np
import pytest

from engine.decoder import DecoderEngine
from engine.decoder.model import prompt_logits
from engine.decoder.static import generate_static
from engine.encoder import EncoderEngine
from engine.sharding import ShardingError
from engine.tokenizer import Tokenizer
from tests.engine.minilm_inputs import mixed_texts, model_dir
from tests.support.tiny_models import build

DEVICES = 3
PROMPTS = [[5, 17, 300, 42], list(range(40, 49)), list(range(100, 117)), list(range(7, 307, 10))]
NEW = 24
# (kind, tensor parallel degree, build options): SmolLM2's split, 9 query heads over
# 3 KV heads (grouped queries, RoPE, gated MLP) on three devices, and GPT-2's fused
# QKV projection and learned positions (test_decoder.py's tiny shape) on two. Each
# case compiles two engines, most of this file's time; a third model repeated what
# these two cover.
DECODERS = {
    "llama-9q3kv": ("llama", 3, dict(heads=9, kv_heads=3, head_dim=32, intermediate=192)),
    "gpt2": ("gpt2", 2, {}),
}


def setup_module():
    assert jax.device_count() == DEVICES, os.environ.get("XLA_FLAGS")


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory):
    """Each tiny model written once: name -> (folder, tensor parallel degree)."""
    made = {}

    def get(name):
        if name not in made:
            kind, tp, opts = DECODERS[name]
            out = tmp_path_factory.mktemp(name)
            build(kind, out, positions=64, **opts)
            made[name] = (out, tp)
        return made[name]

    return get


@pytest.fixture(scope="module", params=sorted(DECODERS))
def model(request, model_dirs):
    return model_dirs(request.param)


@pytest.fixture(scope="module")
def engines():
    """Each (model, degree) engine built once and shared by the tests that read it:
    the split engine a comparison drove is the one whose layout and compiled step the
    KV-cache test inspects. Compiling is most of this file's time."""
    made = {}

    def get(path, tp):
        key = (str(path), tp)
        if key not in made:
            made[key] = _engine(path, tp)
        return made[key]

    yield get
    made.clear()


def _engine(path, tp, quant="none"):
    quant, _, form = quant.partition(":")  # "int8:w8a8": int8 x int8 matmuls
    return DecoderEngine(path, "tiny", slots=4, max_context=64, prefill_buckets=(16, 32),
                         decode_windows=(32, 64), tensor_parallel=tp, quant=quant,
                         quant_form=form or "auto", forms_cache=None)  # fmt: skip


# One jitted function for every engine and prompt: one compile per parameter layout,
# not one per call.
_prompt_logits = jax.jit(prompt_logits, static_argnums=1)


def _logits(engine, prompt):
    padded = np.zeros(32, np.int32)
    padded[: len(prompt)] = prompt
    return np.asarray(_prompt_logits(engine.params, engine.cfg, padded))[: len(prompt)]


def test_decoder_split_equals_one_device(model, engines):
    path, tp = model
    one, split = engines(path, 1), engines(path, tp)
    assert split.devices == [f"cpu:{i}" for i in range(tp)] and one.devices == ["cpu:0"]
    for prompt in PROMPTS:
        np.testing.assert_allclose(_logits(split, prompt), _logits(one, prompt), atol=2e-5, rtol=0)
    # Continuous batching across two attention windows: every token identical.
    assert generate_static(split, PROMPTS, NEW) == generate_static(one, PROMPTS, NEW)
    # The state comes back split as it went in: every step ran one of the programs
    # compiled ahead for its shape (a state placed otherwise would fail there), and
    # nothing was compiled again behind them.
    assert split.programs._generate._cache_size() == 0 and split.programs.step_counts


def test_int8_matmuls_split_as_smollm2_equal_one_device(model_dirs):
    """int8 weights split with their scales, and int8 x int8 matmuls (engine/forms.py
    "w8a8") over SmolLM2's split: each row's int8 scale needs the whole row's amax,
    which XLA reduces across the devices. A partial sum that rounds differently when
    split can move a value across an int8 step, so the logits agree to within steps
    (0.1), not 2e-5; greedy tokens equal."""
    path, tp = model_dirs("llama-9q3kv")
    one, split = _engine(path, 1, "int8:w8a8"), _engine(path, tp, "int8:w8a8")
    assert set(split.forms.compute_forms.values()) == {"w8a8"}
    for prompt in PROMPTS:
        np.testing.assert_allclose(_logits(split, prompt), _logits(one, prompt), atol=0.1, rtol=0)
    assert generate_static(split, PROMPTS, NEW) == generate_static(one, PROMPTS, NEW)


def test_kv_cache_is_split_by_kv_head_and_one_all_reduce_per_projection(model, engines):
    path, tp = model
    engine = engines(path, tp)
    k0 = engine.runner.state.k[0]  # the paged pool: [KV, NUM_BLOCKS, BLOCK, D]
    shard = k0.addressable_shards[0].data.shape
    assert shard == (k0.shape[0] // tp,) + k0.shape[1:]
    # The step program the engine runs with every slot in a 64-token window (the
    # one the comparison above ran; compiled here if that test was not selected).
    hlo = engine.programs.get("step", engine.slots, 64).as_text()
    # Megatron: attention output and MLP down, each one all-reduce, per layer.
    assert hlo.count("all-reduce(") == 2 * engine.cfg.layers
    assert hlo.count("all-gather(") == 0 and hlo.count("all-to-all(") == 0


def test_encoder_split_equals_one_device():
    texts = mixed_texts(12)
    ids = Tokenizer.from_dir(model_dir()).encode_batch(texts)
    kw = dict(batch_buckets=(16,), seq_buckets=(16, 256), max_batch=16)  # one batch
    for quant in ("none", "int8"):
        one = EncoderEngine(model_dir(), quant=quant, **kw)
        split = EncoderEngine(model_dir(), quant=quant, tensor_parallel=2, **kw)
        assert split.devices == ["cpu:0", "cpu:1"]
        np.testing.assert_allclose(split.embed(ids), one.embed(ids), atol=2e-5, rtol=0)


def test_more_devices_than_present_is_a_configuration_error(tmp_path):
    build("gpt2", tmp_path, positions=64)  # 4 heads: a degree of 4 divides them
    with pytest.raises(ShardingError, match="needs 4 devices; 3 visible"):
        _engine(tmp_path, 4)
