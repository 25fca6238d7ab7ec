"""Per-slot sampling on device: greedy, temperature, top-k, top-p, seeded keys.

Every slot carries its own parameters and its own PRNG key, so a slot's draws depend
only on its seed and its own logits: never on which slot it sits in or what the other
slots do. The key never changes during a sequence: the draw for the token that will
sit at position i uses `fold_in(key, i)`. That is one hash per slot and step instead of
a split plus a draw (it also halves the compile time of the sampler on CPU), and it
makes a sequence reproducible from its seed alone. The order of filters is the reference one (temperature, then top-k, then
top-p over what top-k kept).

No Python branch looks at a device value. The sort behind top-k/top-p is skipped by
`lax.cond` (a device-side branch over the whole batch) when no slot asks for it.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def seed_key(seed):
    """seed: uint32 scalar -> key: [2] uint32 (threefry, raw key data)."""
    return jax.random.PRNGKey(seed)


def _scale(logits, temperature):
    t = jnp.where(temperature > 0, temperature, 1.0).astype(jnp.float32)
    return logits / t[:, None]


def filter_logits(logits, temperature, top_k, top_p):
    """logits: [S, V] float32 -> temperature-scaled logits, -inf outside each slot's
    top-k / top-p set. top_k <= 0 or >= V and top_p >= 1 switch a filter off."""
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
    return jnp.where(scaled >= threshold, scaled, -jnp.inf)


def sample(logits, keys, positions, temperature, top_k, top_p):
    """logits: [S, V] float32, keys: [S, 2], positions: [S] (where each drawn token
    will sit), per-slot params: [S] -> tokens: [S] int32. temperature == 0 is greedy."""
    vocab = logits.shape[-1]
    draw = jax.vmap(jax.random.fold_in)(keys, positions)
    wants_filter = (temperature > 0) & (((top_k > 0) & (top_k < vocab)) | (top_p < 1.0))
    shaped = jax.lax.cond(
        jnp.any(wants_filter),
        lambda: filter_logits(logits, temperature, top_k, top_p),
        lambda: _scale(logits, temperature),
    )
    drawn = jax.vmap(jax.random.categorical)(draw, shaped)
    greedy = jnp.argmax(logits, axis=-1)
    return jnp.where(temperature > 0, drawn, greedy).astype(jnp.int32)
