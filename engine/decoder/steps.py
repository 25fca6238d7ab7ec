"""The engine functions, JetStream's shape over a paged cache. Pure functions; the
driver jits them with the state donated.

- prefill_chunk(params, state, padded_tokens, offset, length, table, slot, sampling,
  seed, mask) -> (state, packed)
    one piece of one prompt, padded to a length bucket (static), attending to the
    sequence's blocks through `table` (its length, the context bucket, is static);
    offset, length and slot are traced. Every chunk draws a token and claims the slot
    (tokens, position, key, sampling, token counts); only the last chunk's are kept,
    since a slot joins decode steps only once the host marks it live.
- copy_block(state, src, dst) -> state
    one block's K/V copied into another, for a prompt that shares its start.
- generate(params, state, rows, tables, live, mask) -> (state, packed)
    one decode step for the slots `rows` names (a batch bucket, static: the live
    sequences compacted, padded with the dummy row); positions are per row and
    traced; the only output that leaves the device is `packed` [B, 2 + 2K] int32
    (each row's token, then its logprobs when some row asked for them), one host
    copy per step. The tables' width (blocks per row, static) is the attention
    window, so a step costs its batch bucket x its window, not the slot count.
    Each drawn token is counted in its slot's row of `counts` (the penalties').

- mixed(params, state, tokens, rows, positions, lengths, decoding, tables, slots,
  last, commit, mask) -> (state, packed)
    decode rows and prompt chunks of several sequences in one pass of a fixed
    number of tokens T (static), through R table rows (static): vLLM v1's unified
    step, on the CPU kernel (docs/decisions/0087). A decode row's token and position
    are the state's (the step before may not have reached the host yet); a
    chunk's come from the host. Every row draws from its last token's logits; only
    rows that `commit` (decode rows, last chunks) keep theirs. A last chunk's slot
    was claimed (kvcache.claim_slot) just before, so it draws as prefill_chunk does.
- claim(state, slot, seed, sampling) -> state: that claim.

All take each row's token mask (structured outputs, engine/decoder/grammar.py) as
an argument: [W] / [B, W] int32 bits, all set for a row with no grammar. It is
applied after the penalties and before temperature, top-k, top-p, min-p and the
draw (so a filter never leaves a row with nothing allowed). One program serves
constrained and unconstrained rows alike, so structured outputs compile nothing of
their own (docs/decisions/0072).
"""

from __future__ import annotations

import jax.numpy as jnp

from engine.decoder.config import DecoderConfig
from engine.decoder.kvcache import DecodeState, SlotSampling, claim_slot, start_slot
from engine.decoder.model import (decode_forward, family, forward_chunk, forward_packed,
                                  last_logits)
from engine.decoder.sampling import apply_mask, controlled, sample, seed_key, token_logprobs


def prefill_chunk(
    params: dict, cfg: DecoderConfig, state: DecodeState, padded_tokens, offset, length,
    table, slot, sampling: SlotSampling, seed, mask, kernel: str = "xla",
):  # fmt: skip
    """padded_tokens: [T] int32, offset, length: [] int32, table: [NC] int32,
    seed: [] uint32, kernel: the attention's ("cpu" reads the blocks in place)
    -> (state, packed: [2 + 2K] int32, the token drawn after the chunk's last token
    and its logprobs)"""
    x, k, v = forward_chunk(params, cfg, padded_tokens, offset, length, table, state.k, state.v,
                            kernel)  # fmt: skip
    raw = last_logits(params, cfg, x, length)[None]  # [1, V]
    key = seed_key(seed)
    end = (offset + length).astype(jnp.int32)  # the drawn token's position
    one = lambda a: a[None]  # noqa: E731  (sample works on a batch of slots)
    # Nothing generated yet: only the bias and the prompt's repetition penalty apply.
    logits = controlled(
        raw, lambda: (jnp.zeros(raw.shape, jnp.int32), sampling.seen[None]),
        one(sampling.presence), one(sampling.frequency), one(sampling.repetition),
        one(sampling.bias_ids), one(sampling.bias_vals),
    )  # fmt: skip
    logits = apply_mask(logits, mask[None])  # structured outputs (engine/decoder/grammar.py)
    token = sample(
        logits, key[None], one(end), one(sampling.temperature),
        one(sampling.top_k), one(sampling.top_p), one(sampling.min_p),
    )[0]  # fmt: skip
    state = start_slot(state._replace(k=k, v=v), slot, token, end, key, sampling)
    return state, pack(raw, token[None], one(sampling.logprobs))[0]


def copy_block(state: DecodeState, src, dst) -> DecodeState:
    """src, dst: [] int32 block ids -> the state with block dst's K/V (every layer)
    a copy of block src's: a prompt that shares the start of a cached block computes
    from where they part, in a block of its own (engine/decoder/blocks.py)."""
    return state._replace(k=tuple(a.at[:, dst].set(a[:, src]) for a in state.k),
                          v=tuple(a.at[:, dst].set(a[:, src]) for a in state.v))


def pack(raw, tokens, want):
    """raw: [B, V] float32 logits, tokens: [B] int32, want: [B] int32 -> [B, 2 + 2K]
    int32: each row's token, then its logprobs (sampling.token_logprobs). One array,
    so a step's results leave the device in one copy."""
    return jnp.concatenate([tokens[:, None], token_logprobs(raw, tokens, want)], axis=-1)


def generate(params: dict, cfg: DecoderConfig, state: DecodeState, rows, tables, live, mask,
             kernel: str = "xla", interpret: bool = False):
    """rows: [B] int32 (slots; padding names the dummy row), tables: [B, NW] int32,
    live: [B] bool, mask: [B, W] int32 -> (state, packed: [B, 2 + 2K] int32, row i's token and logprobs
    for slot rows[i]).
    Padding rows compute too (their output is ignored, their writes go to the
    scratch block and to the dummy row); cursors are clamped inside the positions."""
    fed, at = state.tokens[rows], state.positions[rows]  # [B]
    raw, k, v = decode_forward(params, cfg, fed, at, tables, live, state.k, state.v, kernel,
                               interpret)
    logits = controlled(
        raw, lambda: (state.counts[rows], state.seen[rows]), state.presence[rows],
        state.frequency[rows], state.repetition[rows], state.bias_ids[rows],
        state.bias_vals[rows],
    )  # fmt: skip
    logits = apply_mask(logits, mask)  # [B, W] int32 bits (engine/decoder/grammar.py)
    # The drawn tokens sit one past the ones just fed.
    tokens = sample(
        logits, state.keys[rows], at + 1, state.temperature[rows], state.top_k[rows],
        state.top_p[rows], state.min_p[rows],
    )  # fmt: skip
    positions = jnp.minimum(at + 1, cfg.max_positions - 1)
    state = state._replace(k=k, v=v, tokens=state.tokens.at[rows].set(tokens),
                           positions=state.positions.at[rows].set(positions),
                           counts=state.counts.at[rows, tokens].add(1))  # fmt: skip
    return state, pack(raw, tokens, state.logprobs[rows])


def mixed(params: dict, cfg: DecoderConfig, state: DecodeState, tokens, rows, positions,
          lengths, decoding, tables, slots, last, commit, mask):
    """tokens, rows, positions, lengths: [T] int32 (a chunk token's own; padding at
    position -1), decoding: [T] bool (a live slot's next token: token, position and
    length read from the state), tables: [R, NW] int32, slots: [R] int32 (each
    row's slot; padding names the dummy row), last: [R] int32 (the index in T of
    each row's last token), commit: [R] bool, mask: [R, W] int32
    -> (state, packed: [R, 2 + 2K] int32, row r's token and logprobs)."""
    dummy = state.tokens.shape[0] - 1
    own = slots[rows]  # [T]: each token's slot
    fed = jnp.where(decoding, state.tokens[own], tokens)
    at = jnp.where(decoding, state.positions[own], positions)
    lengths = jnp.where(decoding, at + 1, lengths)
    x, k, v = forward_packed(params, cfg, fed, rows, at, lengths, tables, state.k, state.v)
    raw = family(cfg).head(params, cfg, x[last])  # [R, V]: the lm head on each row's last token
    into = jnp.where(commit, slots, dummy)  # rows that keep nothing read and write the dummy's
    logits = controlled(
        raw, lambda: (state.counts[into], state.seen[into]), state.presence[into],
        state.frequency[into], state.repetition[into], state.bias_ids[into],
        state.bias_vals[into],
    )  # fmt: skip
    logits = apply_mask(logits, mask)
    drawn = at[last] + 1  # where each row's drawn token sits
    out = sample(
        logits, state.keys[into], drawn, state.temperature[into], state.top_k[into],
        state.top_p[into], state.min_p[into],
    )  # fmt: skip
    state = state._replace(k=k, v=v, tokens=state.tokens.at[into].set(out),
                           positions=state.positions.at[into].set(
                               jnp.minimum(drawn, cfg.max_positions - 1)),
                           counts=state.counts.at[into, out].add(1))  # fmt: skip
    return state, pack(raw, out, state.logprobs[into])


def claim(state: DecodeState, slot, seed, sampling: SlotSampling) -> DecodeState:
    """slot: [] int32, seed: [] uint32: `slot`'s sampling state for the sequence
    whose last prompt chunk the next mixed step computes."""
    return claim_slot(state, slot, seed_key(seed), sampling)
