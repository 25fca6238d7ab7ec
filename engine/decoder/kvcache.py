"""The decode state: a paged KV cache (one pool of fixed-size blocks per layer) plus
each slot's cursor, sampling parameters and PRNG key. Allocated once; every step
writes it in place (the state is donated to each jitted call).

Which blocks belong to which slot is the host's business (engine.decoder.blocks):
each call takes the block tables it needs as an argument, so a table change costs no
device call. One pool per layer rather than one [L, ...] array: a layer reads its
own buffer, where slicing a layer out of a stacked cache can cost a copy per step.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from engine.decoder.config import DecoderConfig


class DecodeState(NamedTuple):
    k: tuple  # L x [KV, NUM_BLOCKS, BLOCK, D] (a head's pages contiguous: kernels read them so)
    v: tuple  # L x [KV, NUM_BLOCKS, BLOCK, D]
    # Per slot, plus one dummy row (index SLOTS) that a step's padding rows name.
    tokens: jax.Array  # [SLOTS + 1] int32: the token each slot feeds at its next step
    positions: jax.Array  # [SLOTS + 1] int32: where that token's K/V will be written
    keys: jax.Array  # [SLOTS + 1, 2] uint32: per-slot PRNG key (fixed for a sequence)
    temperature: jax.Array  # [SLOTS + 1] float32 (0 = greedy)
    top_k: jax.Array  # [SLOTS + 1] int32 (<= 0 = off)
    top_p: jax.Array  # [SLOTS + 1] float32 (1 = off)


class SlotSampling(NamedTuple):
    """Sampling parameters of one request, as device scalars."""

    temperature: jax.Array  # [] float32
    top_k: jax.Array  # [] int32
    top_p: jax.Array  # [] float32


def init_decode_state(
    cfg: DecoderConfig, slots: int, num_blocks: int, block: int, dtype
) -> DecodeState:
    shape = (cfg.kv_heads, num_blocks, block, cfg.head_dim)
    zeros = lambda: tuple(jnp.zeros(shape, dtype) for _ in range(cfg.layers))  # noqa: E731
    slots += 1  # the dummy row
    return DecodeState(
        k=zeros(),
        v=zeros(),
        tokens=jnp.zeros((slots,), jnp.int32),
        positions=jnp.zeros((slots,), jnp.int32),
        keys=jnp.zeros((slots, 2), jnp.uint32),
        temperature=jnp.zeros((slots,), jnp.float32),
        top_k=jnp.zeros((slots,), jnp.int32),
        top_p=jnp.ones((slots,), jnp.float32),
    )


def start_slot(state: DecodeState, slot, token, position, key, sampling: SlotSampling):
    """A prefilled sequence takes `slot` (traced: one compile serves every slot)."""
    return state._replace(
        tokens=state.tokens.at[slot].set(token),
        positions=state.positions.at[slot].set(position),
        keys=state.keys.at[slot].set(key),
        temperature=state.temperature.at[slot].set(sampling.temperature),
        top_k=state.top_k.at[slot].set(sampling.top_k),
        top_p=state.top_p.at[slot].set(sampling.top_p),
    )


def cache_bytes(state: DecodeState) -> int:
    return int(sum(a.size * a.dtype.itemsize for a in state.k + state.v))


def block_bytes(cfg: DecoderConfig, block: int, dtype) -> int:
    """Bytes one block takes over all layers, keys and values."""
    return 2 * cfg.layers * cfg.kv_heads * block * cfg.head_dim * jnp.dtype(dtype).itemsize
