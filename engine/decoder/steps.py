"""The engine functions, JetStream's shape: `prefill` and `generate` (with
`init_decode_state` and `insert` in kvcache). Pure functions; the driver jits them.

- prefill(params, padded_tokens, true_length, sampling, seed) -> Prefix
    one prompt, padded to a length bucket (static), true length traced; samples the
    first token with the request's own freshly seeded key.
- insert(prefix, state, slot) -> state           (kvcache.insert)
- generate(params, state, window) -> (state, tokens)
    one decode step for every slot; positions are per slot and traced; the only
    output that leaves the device is `tokens` [SLOTS] int32, one host copy per step.
    `window` is a static attention-length bucket (one compile per window).
- prefill_insert: prefill then insert, fused so each bucket is one compile and one
    dispatch.
"""

from __future__ import annotations

import jax.numpy as jnp

from engine.decoder.config import DecoderConfig
from engine.decoder.kvcache import DecodeState, Prefix, SlotSampling, insert
from engine.decoder.model import decode_forward, forward_prompt, last_logits
from engine.decoder.sampling import sample, seed_key


def prefill(
    params: dict, cfg: DecoderConfig, padded_tokens, true_length, sampling: SlotSampling, seed
) -> Prefix:
    """padded_tokens: [T] int32, true_length: [] int32, seed: [] uint32 -> Prefix"""
    x, k, v = forward_prompt(params, cfg, padded_tokens)
    logits = last_logits(params, cfg, x, true_length)  # [V]
    key = seed_key(seed)
    one = lambda a: jnp.reshape(a, (1,))  # noqa: E731  (sample works on a batch of slots)
    # The first token sits at position true_length.
    token = sample(
        logits[None], key[None], one(true_length), one(sampling.temperature),
        one(sampling.top_k), one(sampling.top_p),
    )  # fmt: skip
    return Prefix(
        k=k, v=v, token=token[0], length=true_length.astype(jnp.int32), key=key,
        temperature=sampling.temperature, top_k=sampling.top_k, top_p=sampling.top_p,
    )  # fmt: skip


def generate(params: dict, cfg: DecoderConfig, state: DecodeState, window: int | None = None):
    """-> (state, tokens: [SLOTS] int32). Free slots compute too (their output is
    ignored); their cursor is clamped so it never leaves the cache. `window` (static):
    attend to the first `window` positions only (see decode_forward)."""
    max_len = state.k[0].shape[2]
    logits, k, v = decode_forward(
        params, cfg, state.tokens, state.positions, state.k, state.v, window
    )
    # The drawn tokens sit one past the ones just fed.
    tokens = sample(
        logits, state.keys, state.positions + 1, state.temperature, state.top_k, state.top_p
    )
    positions = jnp.minimum(state.positions + 1, max_len - 1)
    return state._replace(k=k, v=v, tokens=tokens, positions=positions), tokens


def prefill_insert(
    params: dict, cfg: DecoderConfig, state: DecodeState, padded_tokens, true_length,
    slot, sampling: SlotSampling, seed,
):  # fmt: skip
    """-> (state, first token: [] int32)"""
    prefix = prefill(params, cfg, padded_tokens, true_length, sampling, seed)
    return insert(prefix, state, slot), prefix.token
