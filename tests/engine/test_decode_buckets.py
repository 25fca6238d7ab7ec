"""The decode step follows the live work: batch buckets, paged attention in place,
and programs compiled when first needed, all against transformers' greedy tokens.

A step with one live sequence runs at batch bucket 1 (counted by the engine, not
timed); sequences joining and leaving move the step between buckets and windows
without changing a token; the Pallas paged-attention kernel (run interpreted on
the CPU) equals the XLA path; an engine that compiled only what a first request
needs serves longer prompts and more streams at once, the same tokens."""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from engine.decoder import DecoderEngine
from engine.decoder.attention import paged_decode, pick
from engine.decoder.static import prefill_insert
from shared.messages import Sampling
from tests.support.tiny_models import build, hf_greedy, serve_plan

GREEDY = Sampling(temperature=0.0)
CONTEXT = 96
PROMPTS = [[5, 17, 300, 42], list(range(40, 49)), list(range(100, 117)),
           list(range(7, 307, 10)), [9] * 3, list(range(60, 80))]  # fmt: skip


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    out = tmp_path_factory.mktemp("llama-buckets")
    return out, build("llama", out, positions=128)


def _engine(path, **kw) -> DecoderEngine:
    # The gather path: its windows and contexts are the shapes these tests move
    # between (the CPU's in-place kernel has neither: tests/engine/test_paged_kernel.py).
    kw = {"slots": 8, "max_context": CONTEXT, "prefill_buckets": (16, 32),
          "decode_windows": (32, 64), "attention": "xla", **kw}  # fmt: skip
    return DecoderEngine(path, "tiny", **kw)


def _serve(engine: DecoderEngine, plan: list[tuple[int, int, int]]) -> dict[int, list[int]]:
    return serve_plan(engine, PROMPTS, plan)


def test_one_stream_steps_at_batch_bucket_one(llama):
    path, ref = llama
    engine = _engine(path)
    engine.warmup(progress=False)
    first = prefill_insert(engine, 3, PROMPTS[1], GREEDY, 0)  # any slot: rows are compacted
    tokens = [first] + [int(engine.step()[3]) for _ in range(11)]
    assert engine.programs.step_counts == {1: 11}
    assert tokens == hf_greedy(ref, PROMPTS[1], 12)


def test_sequences_joining_and_leaving_cross_buckets_and_keep_their_tokens(llama):
    path, ref = llama
    engine = _engine(path)
    engine.warmup(progress=False)
    # 1 stream, then 2, 3 (bucket 4), 6 (bucket 8), then back down as they end.
    plan = [(0, 0, 30), (1, 3, 20), (2, 5, 40), (3, 8, 12), (4, 8, 25), (5, 9, 60)]
    got = _serve(engine, plan)
    assert set(engine.programs.step_counts) == {1, 2, 4, 8}
    for job, _, n in plan:
        assert got[job] == hf_greedy(ref, PROMPTS[job], n), job
    # Its steps waited on the buckets warm-up left out (counted, so the worker keeps
    # those steps' time out of the model's cost), and wait on nothing now.
    stats = engine.stats()
    waiting, waited_s = stats.compiling, stats.compile_waited_s
    assert not waiting and waited_s > 0


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_pallas_paged_kernel_equals_the_xla_path(dtype):
    from types import SimpleNamespace

    cfg = SimpleNamespace(kv_heads=3, groups=3, heads=9, head_dim=64,  # SmolLM2's split
                          scale=64 ** -0.5, attn_softcap=None)
    rng = np.random.default_rng(0)
    kv, blocks, block, d = 3, 40, 16, 64
    k = jnp.asarray(rng.standard_normal((kv, blocks, block, d)), dtype)
    v = jnp.asarray(rng.standard_normal((kv, blocks, block, d)), dtype)
    q = jnp.asarray(rng.standard_normal((4, 9, d)), dtype)
    tables = jnp.asarray(rng.permutation(np.arange(1, blocks))[:32].reshape(4, 8), jnp.int32)
    positions = jnp.asarray([0, 17, 60, 127], jnp.int32)  # first, mid-block, a full window
    cpu = jax.devices()[0].platform == "cpu"  # elsewhere the kernel itself runs
    xla = paged_decode(q, k, v, tables, positions, cfg, "xla")
    pallas = paged_decode(q, k, v, tables, positions, cfg, "pallas", interpret=cpu)
    # A GPU's float32 dots in the kernel run as TF32 (10-bit mantissas).
    tol = 2e-2 if dtype == jnp.bfloat16 else 1e-5 if cpu else 2e-3
    np.testing.assert_allclose(np.asarray(pallas, np.float32), np.asarray(xla, np.float32),
                               atol=tol, rtol=tol)  # fmt: skip
    assert pick("auto", "gpu") == "pallas"  # on a CPU: tests/engine/test_paged_kernel.py
    with pytest.raises(ValueError, match="attention kernel"):
        pick("flash", "cpu")


def test_engine_on_the_pallas_kernel_gives_the_reference_tokens(llama):
    path, ref = llama
    engine = _engine(path, slots=2, attention="pallas", decode_windows=(32,), max_context=64)
    engine.warmup(progress=False)
    got = _serve(engine, [(0, 0, 10), (1, 2, 8)])
    assert got[0] == hf_greedy(ref, PROMPTS[0], 10) and got[1] == hf_greedy(ref, PROMPTS[1], 8)


@pytest.mark.timeout(900)  # a hang bound: the background compiles ~10 programs
def test_first_compiles_serve_at_once_and_the_rest_join_in_the_background(llama):
    path, ref = llama
    # Two windows and two contexts (the plan's longest sequence is 46 tokens) and
    # four slots: a third window or a larger batch would only add background work.
    engine = _engine(path, compile_ahead="first", slots=4, max_context=64)
    first = engine.warmup(progress=False)
    assert first == len(engine.programs.first_compiles()) < len(engine.programs.compiles)
    # Served before the background is done: a prompt longer than the first context's
    # chunk, and three streams at once (batch bucket 4), compile (or borrow) what
    # they need.
    plan = [(j, 0, 16) for j in (0, 3, 5)]
    got = _serve(engine, plan)
    for job, _, n in plan:
        assert got[job] == hf_greedy(ref, PROMPTS[job], n), job
    assert engine.programs.cache.wait_background(timeout=800)
    done, total = engine.programs.progress()
    assert done == total == len(engine.programs.compiles)
    assert engine.programs._generate._cache_size() == 0  # every step ran a compiled program


@pytest.mark.timeout(900)  # a hang bound: the background compiles ~20 programs
def test_while_the_background_compiles_nothing_is_compiled_on_the_serving_path(llama,
                                                                               monkeypatch):
    """With its background compiles held, an engine that compiled its first set
    serves a prompt longer than a compiled chunk (in compiled chunks), a longer
    context and three streams at once (in parts of a one-stream step): no step
    waits on a compile, nothing is compiled on the caller's thread, and the tokens
    are transformers' greedy ones."""
    import threading

    from engine import jaxrt

    path, ref = llama
    engine = _engine(path, compile_ahead="first", slots=4, prefill_buckets=(16, 32, 64))
    hold = threading.Event()
    original = jaxrt.compile_lowered

    def gated(lowered):  # the background's compiles, and those a step wants (held alike)
        if threading.current_thread().name.startswith("compile-"):
            hold.wait(600)
        return original(lowered)

    monkeypatch.setattr(jaxrt, "compile_lowered", gated)
    try:
        engine.warmup(progress=False)
        compiled, waited = engine.programs.cache.compiled, engine.programs.cache.waited_s
        assert engine.programs.cache.compiling and ("prefill", 64, 96, "float") not in \
            engine.programs.cache.keys()
        long = list(range(3, 53))  # 50 tokens: the chunk of 64 is not compiled yet
        PROMPTS.append(long)
        try:
            plan = [(len(PROMPTS) - 1, 0, 20), (3, 1, 16), (5, 2, 12)]
            got = _serve(engine, plan)
        finally:
            PROMPTS.pop()
        assert got[plan[0][0]] == hf_greedy(ref, long, 20)
        assert got[3] == hf_greedy(ref, PROMPTS[3], 16) and got[5] == hf_greedy(ref, PROMPTS[5], 12)
        assert engine.programs.cache.waited_s == waited and not engine.stats().compiling
        assert engine.programs.cache.compiled == compiled  # none compiled on this thread
    finally:
        hold.set()
    assert engine.programs.cache.wait_background(timeout=800)
