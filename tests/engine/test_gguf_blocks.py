"""A GGUF file's blocks kept as the kernel reads them (engine/gguf_blocks.py): every
block type's integers, scales and minimums give the gguf package's own dequantized
values bit for bit, fused projections of different block types keep every value, and
the kernel's sums over the kept blocks equal numpy's over the package's values.

Blocks are random valid bytes (the gguf package quantizes none of the K-quants); the
super-block scales are set to small float16 numbers, as a real file's are."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from engine import quant
from engine.gguf_blocks import BLOCK_TYPES, kept_blocks

# type -> where its float16 scales sit in a block (d, and Q4_1 / Q5_1 / K's minimum)
_SCALES = {"Q8_0": (0,), "Q4_0": (0,), "Q4_1": (0, 2), "Q5_0": (0,), "Q5_1": (0, 2),
           "Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,)}  # fmt: skip


def random_blocks(rng, rows: int, cols: int, kind: str) -> np.ndarray:
    """[rows, bytes] uint8: `rows` rows of `cols` values of valid `kind` blocks."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    block, size = GGML_QUANT_SIZES[GGMLQuantizationType[kind]]
    b = rng.integers(0, 256, (rows, cols // block, size), dtype=np.uint8)
    for at in _SCALES[kind]:
        d = rng.uniform(1e-4, 3e-3, b.shape[:2]).astype(np.float16)
        b[..., at:at + 2] = d[..., None].view(np.uint8)
    return b.reshape(rows, -1)


def _reference(data: np.ndarray, kind: str) -> np.ndarray:
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    return dequantize(data, GGMLQuantizationType[kind])


def test_every_kept_type_is_a_block_type_the_package_names():
    from gguf import GGMLQuantizationType

    assert set(BLOCK_TYPES) == set(_SCALES)
    assert {k for k in BLOCK_TYPES if k.endswith("_K")} == {"Q4_K", "Q5_K", "Q6_K"}
    assert kept_blocks(np.zeros((2, 110), np.uint8), "Q3_K") is None
    assert all(k in GGMLQuantizationType.__members__ for k in BLOCK_TYPES)


@pytest.mark.parametrize("kind", sorted(_SCALES))
def test_kept_blocks_are_the_packages_values_bit_for_bit(kind):
    rng = np.random.default_rng(sorted(_SCALES).index(kind))
    data = random_blocks(rng, 24, 512, kind)
    w = kept_blocks(data, kind)
    assert w is not None and w.axis == 1 and w.bits == (4 if BLOCK_TYPES[kind][0] == "int4" else 8)
    assert w.group == BLOCK_TYPES[kind][1]
    ours = np.asarray(quant.dequantize(jax.tree.map(jnp.asarray, w), jnp.float32))
    theirs = _reference(data, kind)
    assert ours.shape == theirs.shape == (24, 512)
    assert np.abs(theirs).max() > 0  # the blocks carry values
    assert np.array_equal(ours.view(np.uint32), theirs.view(np.uint32)), kind
    # A quarter of float32's bytes or fewer, whatever the type.
    assert quant.tree_bytes(w) <= theirs.nbytes * 10 / 32


@pytest.mark.parametrize("kind", sorted(_SCALES))
def test_dequantized_tensors_are_the_packages_bit_for_bit(kind):
    """engine/gguf.py's `dequantize` (the float path) reads the same values."""
    from gguf import GGMLQuantizationType

    from engine.gguf import dequantize

    data = random_blocks(np.random.default_rng(9), 16, 512, kind)
    ours, theirs = dequantize(data, GGMLQuantizationType[kind]), _reference(data, kind)
    assert ours.shape == theirs.shape == (16, 512) and ours.dtype == np.float32
    assert np.array_equal(ours.view(np.uint32), theirs.view(np.uint32)), kind


def test_a_fused_weight_of_several_types_keeps_every_value():
    """q_proj Q4_K, k_proj Q5_K, v_proj Q6_K (as a K-quant file mixes them) fused
    into one weight: one kind (int8, groups of 16, with offsets), the same numbers."""
    rng = np.random.default_rng(5)
    parts = {"Q4_K": 64, "Q5_K": 32, "Q6_K": 32}  # output rows of each
    datas = {k: random_blocks(rng, rows, 256, k) for k, rows in parts.items()}
    ws = [quant.transposed(kept_blocks(d, k)) for k, d in datas.items()]  # [in, out] each
    fused = quant.concatenated(ws, axis=1)
    assert (fused.bits, fused.group, fused.offset is not None) == (8, 16, True)
    ours = np.asarray(quant.dequantize(jax.tree.map(jnp.asarray, fused), jnp.float32))
    theirs = np.concatenate([_reference(d, k).T for k, d in datas.items()], axis=1)
    np.testing.assert_array_equal(ours, theirs)


@pytest.fixture(scope="module")
def kernel():
    from engine import kernels

    lib = kernels.load()
    assert lib is not None, kernels.unavailable_reason()
    return lib


@pytest.mark.parametrize("kind", ["Q4_K", "Q5_K", "Q6_K", "Q5_1"])
@pytest.mark.parametrize("axis", [0, 1])
def test_the_kernel_sums_kept_blocks_as_numpy_does(kernel, kind, axis):
    """A dense weight (axis 0, the layers') and a head (axis 1, [V, E]) read by the
    kernel from the kept blocks, 1 and 5 rows, against float64 numpy over the
    package's values."""
    rng = np.random.default_rng(11)
    data = random_blocks(rng, 48, 512, kind)  # [out, in]
    w = kept_blocks(data, kind)
    assert w is not None
    if axis == 0:
        w = quant.transposed(w)  # [in, out], as the model multiplies by it
    packed = quant.with_compute({"w": jax.tree.map(jnp.asarray, w)}, "kernel")["w"]
    ref_w = _reference(data, kind).astype(np.float64)  # [out, in]
    for rows in (1, 5):
        x = rng.standard_normal((rows, 512)).astype(np.float32)
        f = (lambda x, w: quant.matmul(x, w)) if axis == 0 else (lambda x, w: quant.unembed(x, w))
        got = np.asarray(jax.jit(f)(x, packed))
        ref = x.astype(np.float64) @ ref_w.T
        bound = np.abs(x).astype(np.float64) @ np.abs(ref_w).T
        assert got.shape == ref.shape == (rows, 48)
        assert np.max(np.abs(got - ref) / bound) < 2e-6
