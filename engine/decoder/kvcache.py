"""The decode state: a preallocated KV cache of fixed slots plus each slot's cursor,
sampling parameters and PRNG key. Allocated once; every step writes it in place
(the state is donated to each jitted call).

One array per layer rather than one [L, ...] array: a layer reads its own buffer
whole, where slicing a layer out of a stacked cache can cost a copy of it per step.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from engine.decoder.config import DecoderConfig


class DecodeState(NamedTuple):
    k: tuple  # L x [SLOTS, KV, MAX_LEN, D]
    v: tuple  # L x [SLOTS, KV, MAX_LEN, D]
    tokens: jax.Array  # [SLOTS] int32: the token each slot feeds at its next step
    positions: jax.Array  # [SLOTS] int32: where that token's K/V will be written
    keys: jax.Array  # [SLOTS, 2] uint32: per-slot PRNG key (fixed for a sequence)
    temperature: jax.Array  # [SLOTS] float32 (0 = greedy)
    top_k: jax.Array  # [SLOTS] int32 (<= 0 = off)
    top_p: jax.Array  # [SLOTS] float32 (1 = off)


class Prefix(NamedTuple):
    """What `prefill` hands to `insert`: one prompt's K/V and its first token."""

    k: tuple  # L x [KV, T, D], T = the prompt's length bucket
    v: tuple
    token: jax.Array  # [] int32: the first generated token
    length: jax.Array  # [] int32: true prompt length = the first token's position
    key: jax.Array  # [2] uint32: the request's PRNG key, from its seed
    temperature: jax.Array  # [] float32
    top_k: jax.Array  # [] int32
    top_p: jax.Array  # [] float32


class SlotSampling(NamedTuple):
    """Sampling parameters of one request, as device scalars."""

    temperature: jax.Array  # [] float32
    top_k: jax.Array  # [] int32
    top_p: jax.Array  # [] float32


def init_decode_state(cfg: DecoderConfig, slots: int, max_len: int, dtype) -> DecodeState:
    shape = (slots, cfg.kv_heads, max_len, cfg.head_dim)
    zeros = lambda: tuple(jnp.zeros(shape, dtype) for _ in range(cfg.layers))  # noqa: E731
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


def insert(prefix: Prefix, state: DecodeState, slot) -> DecodeState:
    """Copy a prefilled prompt into `slot` (traced: one compile serves every slot).

    The prefix overwrites positions [0, T); older entries past that stay behind but
    are never attended to (attention masks everything past the slot's position).
    """
    at = (slot, 0, 0, 0)
    k = tuple(jax.lax.dynamic_update_slice(c, p[None], at) for c, p in zip(state.k, prefix.k))
    v = tuple(jax.lax.dynamic_update_slice(c, p[None], at) for c, p in zip(state.v, prefix.v))
    return DecodeState(
        k=k,
        v=v,
        tokens=state.tokens.at[slot].set(prefix.token),
        positions=state.positions.at[slot].set(prefix.length),
        keys=state.keys.at[slot].set(prefix.key),
        temperature=state.temperature.at[slot].set(prefix.temperature),
        top_k=state.top_k.at[slot].set(prefix.top_k),
        top_p=state.top_p.at[slot].set(prefix.top_p),
    )


def cache_bytes(state: DecodeState) -> int:
    return int(sum(a.size * a.dtype.itemsize for a in state.k + state.v))
