"""The shapes a decoder compiles for, fixed when it is built: prefill length buckets,
decode batch buckets and attention windows (whole KV blocks)."""

from __future__ import annotations

import jax
import numpy as np


def i32(*shape: int) -> jax.ShapeDtypeStruct:
    """An int32 argument of `shape`, for lowering."""
    return jax.ShapeDtypeStruct(shape, np.int32)


def round_up(n: int, block: int) -> int:
    return -(-n // block) * block


def decode_windows(requested: tuple[int, ...] | None, max_context: int,
                   block: int) -> tuple[int, ...]:
    """Attention windows of the decode step (whole blocks): powers of two from 128,
    and the context."""
    if requested is None:
        requested = tuple(2**i for i in range(7, 16))
    top = round_up(max_context, block)
    return tuple(sorted({round_up(w, block) for w in requested if 0 < w < max_context} | {top}))


def decode_batches(slots: int) -> tuple[int, ...]:
    """Decode batch buckets: powers of two below the slot count, and the slot count."""
    return tuple(sorted({2**i for i in range(16) if 2**i < slots} | {slots}))


def prefill_buckets(requested: tuple[int, ...], chunk: int) -> tuple[int, ...]:
    """Prefill lengths up to the chunk, and always the chunk (the longest piece)."""
    return tuple(sorted({b for b in requested if 0 < b < chunk} | {chunk}))


def spec(tree):
    """Shapes, dtypes and placements of a pytree: what lowering needs, without
    holding (or reading) buffers a step may have donated meanwhile."""
    return jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=a.sharding),
                        tree)  # fmt: skip
