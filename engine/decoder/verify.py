"""The speculative verify pass, on device: one sequence's last token and its draft
tokens through the model at once, and at each position the token the normal decode
step would have drawn there.

The pass is the decode step's own forward (`model.decode_forward`) with one row per
fed token, every row the same sequence at consecutive positions and through the same
block table: each row writes its K/V before any row attends, so row j sees the
tokens of rows before it. So it runs the step's paged attention (the Pallas kernel
on a GPU) and costs what a decode step at a batch of K + 1 rows costs: nearly one
row's on a memory-bound accelerator, about K + 1 rows' on a CPU whose small-batch
matmuls are compute-bound (docs/decisions/0047).

A draft is accepted while it equals what was drawn at its position; the first drawn
token that differs (or the one after the last draft) is the bonus token. The draws
use the slot's own key folded with each position (`sampling.sample`, exactly as
`steps.generate` draws), so greedy and seeded output is the same with speculation
on or off. The K/V of every fed token is written; the rejected ones' sit past the
sequence's new length and are overwritten by later steps. Sampling controls that
read the generated tokens (penalties, logit bias) and logprobs are not applied here:
the host sends such sequences through the normal step instead
(engine/decoder/speculative.py).
"""

from __future__ import annotations

import jax.numpy as jnp

from engine.decoder.config import DecoderConfig
from engine.decoder.kvcache import DecodeState
from engine.decoder.model import decode_forward
from engine.decoder.sampling import sample


def verify(params: dict, cfg: DecoderConfig, state: DecodeState, fed, offset, length, table,
           slot, kernel: str = "xla", interpret: bool = False):
    """fed: [T] int32 (the sequence's last token, then its drafts, padded), offset: []
    int32 (fed[0]'s position), length: [] int32 (1 + drafts), table: [NW] int32 (its
    blocks: the attention window, NW * BLOCK >= offset + length), slot: [] int32,
    kernel: the paged attention's implementation (engine/decoder/attention.py)
    -> (state, out: [T + 1] int32: the token drawn at each of the T positions after
    fed's, then how many drafts were accepted). The slot's next token and position
    become the bonus token and its place; its counts note the tokens it emitted."""
    t = fed.shape[0]
    positions = offset + jnp.arange(t, dtype=jnp.int32)  # [T]
    tables = jnp.broadcast_to(table, (t, table.shape[0]))  # [T, NW]
    live = jnp.arange(t) < length  # padding rows write the scratch block
    raw, k, v = decode_forward(params, cfg, fed, positions, tables, live, state.k, state.v,
                               kernel, interpret)  # [T, V] float32
    rows = jnp.full((t,), slot, jnp.int32)
    at = positions + 1  # where each drawn token sits
    drawn = sample(raw, state.keys[rows], at, state.temperature[rows], state.top_k[rows],
                   state.top_p[rows], state.min_p[rows])  # [T]
    j = jnp.arange(t - 1)
    match = (j + 1 < length) & (fed[1:] == drawn[:-1])  # draft j against its position's draw
    accepted = jnp.cumprod(match.astype(jnp.int32)).sum().astype(jnp.int32)
    emitted = (jnp.arange(t) <= accepted).astype(jnp.int32)
    state = state._replace(
        k=k, v=v, tokens=state.tokens.at[slot].set(drawn[accepted]),
        positions=state.positions.at[slot].set(
            jnp.minimum(offset + 1 + accepted, cfg.max_positions - 1)),
        counts=state.counts.at[slot, drawn].add(emitted),
    )  # fmt: skip
    return state, jnp.concatenate([drawn, accepted[None]])
