"""The decode state: a paged KV cache (one pool of fixed-size blocks per layer) plus
each slot's cursor, sampling parameters and PRNG key. Allocated once; every step
writes it in place (the state is donated to each jitted call).

Which blocks belong to which slot is the host's business (engine.decoder.blocks):
each call takes the block tables it needs as an argument, so a table change costs no
device call. One pool per layer rather than one [L, ...] array: a layer reads its
own buffer, where slicing a layer out of a stacked cache can cost a copy per step.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from engine.decoder.config import DecoderConfig
from engine.decoder.sampling import MAX_LOGPROBS
from shared.messages import Sampling


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
    min_p: jax.Array  # [SLOTS + 1] float32 (0 = off)
    presence: jax.Array  # [SLOTS + 1] float32 (0 = off)
    frequency: jax.Array  # [SLOTS + 1] float32 (0 = off)
    repetition: jax.Array  # [SLOTS + 1] float32 (1 = off)
    bias_ids: jax.Array  # [SLOTS + 1, MAX_BIAS] int32: logit_bias tokens ...
    bias_vals: jax.Array  # [SLOTS + 1, MAX_BIAS] float32: ... and values (0 = unused)
    # The penalties' memory: exact counts, not a window of recent tokens, because
    # OpenAI's frequency penalty counts every generated token; at SmolLM2's 49k
    # vocabulary and 64 slots that is 13 MB, a few KV blocks' worth. Only a step
    # where some slot uses a penalty reads them (sampling.controlled).
    counts: jax.Array  # [SLOTS + 1, V] int32: times each token was generated
    seen: jax.Array  # [SLOTS + 1, V] bool: tokens of the prompt (repetition penalty)
    logprobs: jax.Array  # [SLOTS + 1] int32: top logprobs wanted (-1 = none, 0 = the token's)


MAX_BIAS = 300  # logit_bias entries per request (OpenAI's limit)


class SlotSampling(NamedTuple):
    """Sampling parameters of one request: numpy values as `slot_sampling` makes them,
    device values inside the jitted prefill."""

    temperature: jax.Array | np.number  # [] float32
    top_k: jax.Array | np.number  # [] int32
    top_p: jax.Array | np.number  # [] float32
    min_p: jax.Array | np.number  # [] float32
    presence: jax.Array | np.number  # [] float32
    frequency: jax.Array | np.number  # [] float32
    repetition: jax.Array | np.number  # [] float32
    bias_ids: jax.Array | np.ndarray  # [MAX_BIAS] int32
    bias_vals: jax.Array | np.ndarray  # [MAX_BIAS] float32
    # [V] bool: the prompt's tokens (all False without a repetition penalty)
    seen: jax.Array | np.ndarray
    logprobs: jax.Array | np.number  # [] int32


def init_decode_state(
    cfg: DecoderConfig, slots: int, num_blocks: int, block: int, dtype
) -> DecodeState:
    """The empty state, made by one compiled program: built array by array, each of
    its 2 x layers + 15 arrays compiled a fill program of its own (0.9 s of a cold
    start for SmolLM2's 30 layers)."""
    return jax.jit(functools.partial(_empty_state, cfg, slots, num_blocks, block, dtype))()


def _empty_state(cfg: DecoderConfig, slots: int, num_blocks: int, block: int,
                 dtype) -> DecodeState:
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
        min_p=jnp.zeros((slots,), jnp.float32),
        presence=jnp.zeros((slots,), jnp.float32),
        frequency=jnp.zeros((slots,), jnp.float32),
        repetition=jnp.ones((slots,), jnp.float32),
        bias_ids=jnp.zeros((slots, MAX_BIAS), jnp.int32),
        bias_vals=jnp.zeros((slots, MAX_BIAS), jnp.float32),
        counts=jnp.zeros((slots, cfg.vocab_size), jnp.int32),
        seen=jnp.zeros((slots, cfg.vocab_size), jnp.bool_),
        logprobs=jnp.full((slots,), -1, jnp.int32),
    )


def start_slot(state: DecodeState, slot, token, position, key, sampling: SlotSampling):
    """A prefilled sequence takes `slot` (traced: one compile serves every slot); its
    first token is its first generated one."""
    first = jnp.zeros_like(state.counts[slot]).at[token].set(1)  # [V]
    state = claim_slot(state, slot, key, sampling)
    return state._replace(
        tokens=state.tokens.at[slot].set(token),
        positions=state.positions.at[slot].set(position),
        counts=state.counts.at[slot].set(first),
    )


def claim_slot(state: DecodeState, slot, key, sampling: SlotSampling):
    """`slot`'s sampling state set for a new sequence, nothing generated yet: what a
    mixed step's last prompt chunk draws its first token with (steps.mixed)."""
    return state._replace(
        keys=state.keys.at[slot].set(key),
        temperature=state.temperature.at[slot].set(sampling.temperature),
        top_k=state.top_k.at[slot].set(sampling.top_k),
        top_p=state.top_p.at[slot].set(sampling.top_p),
        min_p=state.min_p.at[slot].set(sampling.min_p),
        presence=state.presence.at[slot].set(sampling.presence),
        frequency=state.frequency.at[slot].set(sampling.frequency),
        repetition=state.repetition.at[slot].set(sampling.repetition),
        bias_ids=state.bias_ids.at[slot].set(sampling.bias_ids),
        bias_vals=state.bias_vals.at[slot].set(sampling.bias_vals),
        counts=state.counts.at[slot].set(jnp.zeros_like(state.counts[slot])),
        seen=state.seen.at[slot].set(sampling.seen),
        logprobs=state.logprobs.at[slot].set(sampling.logprobs),
    )


def cache_bytes(state: DecodeState) -> int:
    return int(sum(a.size * a.dtype.itemsize for a in state.k + state.v))


def block_bytes(cfg: DecoderConfig, block: int, dtype) -> int:
    """Bytes one block takes over all layers, keys and values."""
    return 2 * cfg.layers * cfg.kv_heads * block * cfg.head_dim * jnp.dtype(dtype).itemsize


def slot_sampling(sampling: Sampling, vocab: int, prompt: list[int]) -> SlotSampling:
    """A request's sampling parameters as the prefill takes them; `seen` marks the
    prompt's tokens only when a repetition penalty will read them."""
    bias = [(t, b) for t, b in sampling.logit_bias if 0 <= t < vocab][:MAX_BIAS]
    ids, vals = np.zeros(MAX_BIAS, np.int32), np.zeros(MAX_BIAS, np.float32)
    if bias:
        ids[: len(bias)], vals[: len(bias)] = zip(*bias)
    seen = np.zeros(vocab, np.bool_)
    if sampling.repetition_penalty != 1.0:
        seen[np.asarray(prompt, np.int64)] = True
    return SlotSampling(
        temperature=np.float32(max(0.0, sampling.temperature)),
        top_k=np.int32(sampling.top_k if sampling.top_k > 0 else 0),
        top_p=np.float32(sampling.top_p if 0.0 < sampling.top_p < 1.0 else 1.0),
        min_p=np.float32(min(max(sampling.min_p, 0.0), 1.0)),
        presence=np.float32(sampling.presence_penalty),
        frequency=np.float32(sampling.frequency_penalty),
        repetition=np.float32(sampling.repetition_penalty if sampling.repetition_penalty > 0
                              else 1.0),
        bias_ids=ids, bias_vals=vals, seen=seen,
        logprobs=np.int32(min(sampling.logprobs, MAX_LOGPROBS)),
    )
