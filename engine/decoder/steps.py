"""The engine functions, JetStream's shape over a paged cache. Pure functions; the
driver jits them with the state donated.

- prefill_chunk(params, state, padded_tokens, offset, length, table, slot, sampling,
  seed) -> (state, token)
    one piece of one prompt, padded to a length bucket (static), attending to the
    sequence's blocks through `table` (its length, the context bucket, is static);
    offset, length and slot are traced. Every chunk draws a token and claims the slot
    (tokens, position, key, sampling); only the last chunk's are kept, since a slot
    joins decode steps only once the host marks it live.
- generate(params, state, tables, live) -> (state, tokens)
    one decode step for every slot; positions are per slot and traced; the only
    output that leaves the device is `tokens` [SLOTS] int32, one host copy per step.
    The tables' width (blocks per slot, static) is the attention window.
"""

from __future__ import annotations

import jax.numpy as jnp

from engine.decoder.config import DecoderConfig
from engine.decoder.kvcache import DecodeState, SlotSampling, start_slot
from engine.decoder.model import decode_forward, forward_chunk, last_logits
from engine.decoder.sampling import sample, seed_key


def prefill_chunk(
    params: dict, cfg: DecoderConfig, state: DecodeState, padded_tokens, offset, length,
    table, slot, sampling: SlotSampling, seed,
):  # fmt: skip
    """padded_tokens: [T] int32, offset, length: [] int32, table: [NC] int32,
    seed: [] uint32 -> (state, token: [] int32 drawn after the chunk's last token)"""
    x, k, v = forward_chunk(params, cfg, padded_tokens, offset, length, table, state.k, state.v)
    logits = last_logits(params, cfg, x, length)  # [V]
    key = seed_key(seed)
    end = (offset + length).astype(jnp.int32)  # the drawn token's position
    one = lambda a: jnp.reshape(a, (1,))  # noqa: E731  (sample works on a batch of slots)
    token = sample(
        logits[None], key[None], one(end), one(sampling.temperature),
        one(sampling.top_k), one(sampling.top_p),
    )[0]  # fmt: skip
    state = start_slot(state._replace(k=k, v=v), slot, token, end, key, sampling)
    return state, token


def generate(params: dict, cfg: DecoderConfig, state: DecodeState, tables, live):
    """tables: [SLOTS, NW] int32, live: [SLOTS] bool -> (state, tokens: [SLOTS] int32).
    Slots that are not live compute too (their output is ignored, their writes go to
    the scratch block); their cursor is clamped inside the model's positions."""
    logits, k, v = decode_forward(
        params, cfg, state.tokens, state.positions, tables, live, state.k, state.v
    )
    # The drawn tokens sit one past the ones just fed.
    tokens = sample(
        logits, state.keys, state.positions + 1, state.temperature, state.top_k, state.top_p
    )
    positions = jnp.minimum(state.positions + 1, cfg.max_positions - 1)
    return state._replace(k=k, v=v, tokens=tokens, positions=positions), tokens
