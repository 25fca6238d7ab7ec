"""Per-slot sampling on device: greedy, temperature, top-k, top-p, seeded keys.

Every slot carries its own parameters and its own PRNG key, so a slot's draws depend
only on its seed and its own logits: never on which slot it sits in or what the other
slots do. The key never changes during a sequence: the draw for the token that will
sit at position i uses `fold_in(key, i)`. That is one hash per slot and step instead of
a split plus a draw (it also halves the compile time of the sampler on CPU), and it
makes a sequence reproducible from its seed alone.

The order is vLLM's: `logit_bias` added to the model's logits, then the penalties
(`repetition_penalty` as transformers' RepetitionPenaltyLogitsProcessor over the
prompt's and the generated tokens; `frequency_penalty` and `presence_penalty` by
OpenAI's formula over the generated tokens only), then temperature, top-k, top-p
over what top-k kept, and `min_p` (a token stays when its probability is at least
min_p times the top one's: the same set whatever the order, since the top token
always stays). Greedy picks the argmax after the bias and penalties.

No Python branch looks at a device value. The sort behind top-k/top-p/min-p, and
the penalties with their [B, V] reads of the token counts, are skipped by
`lax.cond` (a device-side branch over the whole batch) when no slot asks for them.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


MAX_LOGPROBS = 20  # top logprobs a step computes for every row that wants any


def token_logprobs(logits, tokens, want):
    """logits: [S, V] float32 (the model's own: before bias, penalties and
    temperature, as vLLM reports them), tokens: [S] int32, want: [S] int32 (-1 = none)
    -> [S, 1 + 2 * MAX_LOGPROBS] int32: the token's logprob, the top ids, their
    logprobs (float32 bits as int32, so the step's output is one int32 array).
    Zeros when no row wants logprobs: the log-softmax and top-k are skipped then."""
    rows, k = logits.shape[0], MAX_LOGPROBS

    def computed():
        logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
        top_lp, top_ids = jax.lax.top_k(logp, k)  # [S, K]
        chosen = jnp.take_along_axis(logp, tokens[:, None], axis=-1)  # [S, 1]
        bits = lambda x: jax.lax.bitcast_convert_type(x, jnp.int32)  # noqa: E731
        return jnp.concatenate([bits(chosen), top_ids.astype(jnp.int32), bits(top_lp)], -1)

    return jax.lax.cond(jnp.any(want >= 0), computed,
                        lambda: jnp.zeros((rows, 1 + 2 * k), jnp.int32))


def seed_key(seed):
    """seed: uint32 scalar -> key: [2] uint32 (threefry, raw key data)."""
    return jax.random.PRNGKey(seed)


def _scale(logits, temperature):
    t = jnp.where(temperature > 0, temperature, 1.0).astype(jnp.float32)
    return logits / t[:, None]


def penalize(logits, counts, seen, presence, frequency, repetition, bias_ids, bias_vals):
    """logits: [S, V] float32, counts: [S, V] int32 (generated tokens), seen: [S, V]
    bool (prompt tokens), presence/frequency/repetition: [S], bias_ids: [S, NB] int32,
    bias_vals: [S, NB] float32 (unused entries: value 0) -> [S, V] float32."""
    rows = jnp.arange(logits.shape[0])[:, None]
    logits = logits.at[rows, bias_ids].add(bias_vals)
    generated = counts > 0
    rep = repetition[:, None]
    logits = jnp.where(seen | generated, jnp.where(logits < 0, logits * rep, logits / rep), logits)
    return (logits - presence[:, None] * generated.astype(jnp.float32)
            - frequency[:, None] * counts.astype(jnp.float32))


def uses_controls(presence, frequency, repetition, bias_vals):
    """[S] bool: slots whose logits `penalize` changes."""
    return (presence != 0) | (frequency != 0) | (repetition != 1) | jnp.any(bias_vals != 0, -1)


def controlled(logits, read, presence, frequency, repetition, bias_ids, bias_vals):
    """`penalize`, when any slot asks for it; `read()` -> (counts, seen), both
    [S, V], is only evaluated inside that branch (a step without penalties never
    reads the count arrays)."""
    return jax.lax.cond(
        jnp.any(uses_controls(presence, frequency, repetition, bias_vals)),
        lambda: penalize(logits, *read(), presence, frequency, repetition, bias_ids, bias_vals),
        lambda: logits,
    )


def filter_logits(logits, temperature, top_k, top_p, min_p=None):
    """logits: [S, V] float32 -> temperature-scaled logits, -inf outside each slot's
    top-k / top-p / min-p set. top_k <= 0 or >= V, top_p >= 1 and min_p <= 0 switch
    a filter off."""
    vocab = logits.shape[-1]
    scaled = _scale(logits, temperature)
    ranked = -jnp.sort(-scaled, axis=-1)  # [S, V] descending
    k = jnp.where((top_k > 0) & (top_k < vocab), top_k, vocab)  # [S]
    in_top_k = jnp.arange(vocab)[None, :] < k[:, None]  # [S, V] over ranks
    probs = jax.nn.softmax(jnp.where(in_top_k, ranked, -jnp.inf), axis=-1)
    mass_before = jnp.cumsum(probs, axis=-1) - probs  # [S, V]
    keep = in_top_k & ((mass_before < top_p[:, None]) | (top_p[:, None] >= 1.0))
    keep = keep.at[:, 0].set(True)  # the most likely token always survives
    n_keep = keep.sum(-1)  # keep is a prefix of the ranking
    threshold = jnp.take_along_axis(ranked, (n_keep - 1)[:, None], axis=-1)  # [S, 1]
    if min_p is not None:  # p >= min_p * p_top  <=>  logit >= top logit + log(min_p)
        floor = ranked[:, :1] + jnp.log(jnp.where(min_p > 0, min_p, 0.0))[:, None]
        threshold = jnp.maximum(threshold, floor)
    return jnp.where(scaled >= threshold, scaled, -jnp.inf)


def _draw(shaped, keys, positions):
    """Inverse-CDF sampling: one uniform per slot instead of one Gumbel per vocabulary
    entry (a quarter of a CPU step at batch 16 and V = 4096).

    shaped: [S, V] (-inf = excluded) -> [S] int32. u is in (0, 1], so the first index
    whose cumulative mass reaches u * total always has non-zero probability.
    """
    keys = jax.vmap(jax.random.fold_in)(keys, positions)
    u = 1.0 - jax.vmap(lambda k: jax.random.uniform(k, ()))(keys)  # [S] in (0, 1]
    cdf = jnp.cumsum(jax.nn.softmax(shaped, axis=-1), axis=-1)  # [S, V]
    below = (cdf < (u * cdf[:, -1])[:, None]).sum(-1)
    return jnp.minimum(below, shaped.shape[-1] - 1).astype(jnp.int32)


def sample(logits, keys, positions, temperature, top_k, top_p, min_p=None):
    """logits: [S, V] float32, keys: [S, 2], positions: [S] (where each drawn token
    will sit), per-slot params: [S] -> tokens: [S] int32. temperature == 0 is greedy.

    Device-side branches skip the sort when no slot filters and the draw when every
    slot is greedy (the common cases of a benchmark and of OpenAI's defaults)."""
    vocab = logits.shape[-1]
    hot = temperature > 0
    wants_filter = hot & (((top_k > 0) & (top_k < vocab)) | (top_p < 1.0))
    if min_p is not None:
        wants_filter = wants_filter | (hot & (min_p > 0))

    def drawn():
        shaped = jax.lax.cond(
            jnp.any(wants_filter),
            lambda: filter_logits(logits, temperature, top_k, top_p, min_p),
            lambda: _scale(logits, temperature),
        )
        return _draw(shaped, keys, positions)

    greedy = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    tokens = jax.lax.cond(jnp.any(hot), drawn, lambda: greedy)
    return jnp.where(hot, tokens, greedy)


def mask_words(vocab: int) -> int:
    """int32 words of one row's bit mask (bit j of word i: token 32 i + j)."""
    return (vocab + 31) // 32


def apply_mask(logits, mask):
    """logits: [B, V] float32, mask: [B, W] int32 bits -> logits, -inf where a
    row's bit is clear (tokens past the mask's width included)."""
    rows, vocab = logits.shape
    bits = (mask[:, :, None] >> jnp.arange(32, dtype=jnp.int32)) & 1  # [B, W, 32]
    allowed = bits.reshape(rows, -1)[:, :vocab] != 0
    if allowed.shape[1] < vocab:
        allowed = jnp.pad(allowed, ((0, 0), (0, vocab - allowed.shape[1])))
    return jnp.where(allowed, logits, -jnp.inf)
