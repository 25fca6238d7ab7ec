"""Paged attention read in place on the CPU (engine/kernels/paged_attention.cc).

The kernel equals the XLA gather path (the reference the rest of the suite holds to
transformers) for decode rows, prefill chunks, sliding windows, soft-capping and
half-precision caches; a query's result does not depend on which queries share its
call; a decoder on it compiles one decode program per batch bucket and one prefill
program per length bucket, and answers transformers' greedy tokens for streams
that join and leave, a chunked prompt and a prefix-cache hit."""

from __future__ import annotations

import os
from types import SimpleNamespace

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from engine import kernels
from engine.decoder import DecoderEngine
from engine.decoder.attention import chunk_attention, gather, paged_decode, pick
from engine.decoder.layers import context_attention
from tests.support.tiny_models import build, hf_greedy, serve_plan

KV, BLOCKS, BLOCK, D = 3, 60, 16, 64
CFG = SimpleNamespace(kv_heads=3, groups=3, heads=9, head_dim=D, scale=D**-0.5,
                      attn_softcap=None)  # SmolLM2's split  # fmt: skip


@pytest.fixture(scope="module", autouse=True)
def _kernel():
    assert kernels.load() is not None, kernels.unavailable_reason()


def _pool(dtype, seed=0):
    rng = np.random.default_rng(seed)
    k = jnp.asarray(rng.standard_normal((KV, BLOCKS, BLOCK, D)), dtype)
    v = jnp.asarray(rng.standard_normal((KV, BLOCKS, BLOCK, D)), dtype)
    return rng, k, v


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.float16])
@pytest.mark.parametrize("window,softcap", [(None, None), (20, None), (None, 30.0)])
def test_decode_rows_equal_the_gather_path(dtype, window, softcap):
    rng, k, v = _pool(dtype)
    cfg = SimpleNamespace(**{**vars(CFG), "attn_softcap": softcap})
    q = jnp.asarray(rng.standard_normal((5, 9, D)), dtype)
    tables = jnp.asarray(rng.permutation(np.arange(1, BLOCKS))[:40].reshape(5, 8), jnp.int32)
    positions = jnp.asarray([0, 15, 16, 77, 127], jnp.int32)  # first, block ends, a full table
    xla = paged_decode(q, k, v, tables, positions, cfg, "xla", window=window)
    cpu = paged_decode(q, k, v, tables, positions, cfg, "cpu", window=window)
    tol = 1e-5 if dtype == jnp.float32 else 2e-2
    np.testing.assert_allclose(np.asarray(cpu, np.float32), np.asarray(xla, np.float32),
                               atol=tol, rtol=tol)  # fmt: skip


@pytest.mark.parametrize("offset,length", [(0, 23), (40, 16), (100, 7)])
def test_a_prefill_chunk_equals_the_gather_path(offset, length):
    rng, k, v = _pool(jnp.float32, seed=1)
    table = jnp.asarray(rng.permutation(np.arange(1, BLOCKS))[:8], jnp.int32)  # 128 positions
    q = jnp.asarray(rng.standard_normal((32, 9, D)), jnp.float32)  # a bucket of 32, padded
    positions = offset + jnp.arange(32, dtype=jnp.int32)
    for window in (None, 9):
        ref = context_attention(q, gather(k, table), gather(v, table), positions, CFG, window)
        got = chunk_attention(q, k, v, table, positions, CFG, window)
        np.testing.assert_allclose(np.asarray(got)[:length], np.asarray(ref)[:length],
                                   atol=1e-5, rtol=1e-5)  # fmt: skip


def test_a_query_is_the_same_alone_or_among_others():
    """Bit for bit: a row alone, among 7 others, and as a query of a prefill chunk."""
    rng, k, v = _pool(jnp.float32, seed=2)
    q = jnp.asarray(rng.standard_normal((8, 9, D)), jnp.float32)
    tables = jnp.asarray(rng.integers(1, BLOCKS, (8, 8)), jnp.int32)
    positions = jnp.asarray(rng.integers(0, 128, 8), jnp.int32)
    together = np.asarray(kernels.paged_attention(q, k, v, tables, jnp.arange(8), positions,
                                                  CFG.scale))  # fmt: skip
    for i in (0, 5):
        alone = kernels.paged_attention(q[i:i + 1], k, v, tables, jnp.asarray([i]),
                                        positions[i:i + 1], CFG.scale)  # fmt: skip
        assert np.array_equal(np.asarray(alone)[0], together[i])
    rows = jnp.full((8,), 3, jnp.int32)  # eight queries of row 3, one tile
    chunk = np.asarray(kernels.paged_attention(q, k, v, tables, rows, positions, CFG.scale))
    alone = kernels.paged_attention(q[6:7], k, v, tables, jnp.asarray([3]), positions[6:7],
                                    CFG.scale)  # fmt: skip
    assert np.array_equal(np.asarray(alone)[0], chunk[6])


def test_a_row_naming_no_table_is_an_error_not_a_crash():
    _, k, v = _pool(jnp.float32)
    q = jnp.zeros((2, 9, D), jnp.float32)
    tables = jnp.ones((2, 4), jnp.int32)
    with pytest.raises(Exception, match="names no table"):
        jax.block_until_ready(kernels.paged_attention(q, k, v, tables, jnp.asarray([0, 5]),
                                                      jnp.asarray([1, 2]), CFG.scale))  # fmt: skip
    # A block id outside the pool is read as block 0, never out of bounds.
    wild = jnp.asarray([[10**6, -3, 2, 2]] * 2, jnp.int32)
    out = kernels.paged_attention(q, k, v, wild, jnp.asarray([0, 1]), jnp.asarray([30, 40]),
                                  CFG.scale)  # fmt: skip
    assert np.isfinite(np.asarray(out)).all()


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    out = tmp_path_factory.mktemp("llama-paged-cpu")
    return out, build("llama", out, positions=256, heads=6, kv_heads=2)


def test_the_default_on_a_cpu_reads_in_place_with_no_window_or_context_axis(llama):
    path, ref = llama
    assert pick("auto", "cpu") == "cpu"
    engine = DecoderEngine(path, "tiny", slots=8, max_context=256, prefill_buckets=(16, 32))
    programs = engine.programs
    assert programs.attention == "cpu"
    assert programs.windows == (256,) and programs.contexts == (256,)
    kinds = [k for k, _, _ in programs.compiles]
    # One program per batch bucket (1, 2, 4, 8) and per length bucket (16, 32).
    assert kinds.count("step") == 4 and kinds.count("prefill") == 2
    engine.warmup(progress=False)
    system = list(range(30, 90))  # 60 tokens: two chunks of 32, then shared by the next
    prompts = [[5, 17, 300, 42], system + [7, 8, 9], list(range(100, 117)), system + [11, 12]]
    plan = [(0, 0, 12), (1, 1, 20), (2, 3, 8), (3, 5, 10)]  # (job, start step, tokens)
    got = serve_plan(engine, prompts, plan)
    for job, _, n in plan:
        assert got[job] == hf_greedy(ref, prompts[job], n), job
    assert engine.stats().cache.hits >= 48  # the last prompt reused the system prompt's blocks
