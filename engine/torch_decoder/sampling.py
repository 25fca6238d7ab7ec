"""Per-slot sampling in torch: greedy, temperature, top-k, top-p, one seeded
`torch.Generator` per sequence.

Greedy is `argmax` over float32 logits (first index on ties), as in the JAX engine,
so the two engines pick the same greedy tokens whenever their logits agree.
Sampling follows the same recipe (temperature, then top-k, then top-p over what
top-k kept; one inverse-CDF draw per slot) but cannot reproduce JAX's random
numbers: JAX draws from threefry keys, this engine from torch's CPU Mersenne Twister.
A seed therefore reproduces a sequence within one engine, not across engines.

A sequence's generator is seeded from the request's seed at prefill and advanced
once per token it draws, so the draws depend on the seed alone, never on the slot
or on the other sequences in the batch.
"""

from __future__ import annotations

import torch

NEG_INF = float("-inf")


def filter_logits(logits, temperature, top_k, top_p):
    """logits: [N, V] float32, temperature/top_p: [N] float32, top_k: [N] int64
    -> temperature-scaled logits, -inf outside each row's top-k / top-p set.
    top_k <= 0 or >= V and top_p >= 1 switch a filter off."""
    vocab = logits.shape[-1]
    scaled = scale(logits, temperature)
    ranked = scaled.sort(dim=-1, descending=True).values  # [N, V]
    k = torch.where((top_k > 0) & (top_k < vocab), top_k, torch.full_like(top_k, vocab))
    in_top_k = torch.arange(vocab, device=logits.device)[None, :] < k[:, None]  # over ranks
    probs = torch.softmax(ranked.masked_fill(~in_top_k, NEG_INF), dim=-1)
    mass_before = probs.cumsum(-1) - probs  # [N, V]
    keep = in_top_k & ((mass_before < top_p[:, None]) | (top_p[:, None] >= 1.0))
    keep[:, 0] = True  # the most likely token always survives
    n_keep = keep.sum(-1)  # keep is a prefix of the ranking
    threshold = ranked.gather(-1, (n_keep - 1)[:, None])  # [N, 1]
    return scaled.masked_fill(scaled < threshold, NEG_INF)


def scale(logits, temperature):
    t = torch.where(temperature > 0, temperature, torch.ones_like(temperature))
    return logits / t[:, None]


def draw(shaped, generators: list[torch.Generator]):
    """Inverse-CDF sampling, one uniform per row from that row's own generator.

    shaped: [N, V] float32 (-inf = excluded) -> [N] int64. u is in (0, 1], so the
    first index whose cumulative mass reaches u * total has non-zero probability.
    """
    u = torch.stack([1.0 - torch.rand((), generator=g) for g in generators])  # [N]
    u = u.to(shaped.device)
    cdf = torch.softmax(shaped, dim=-1).cumsum(-1)  # [N, V]
    below = (cdf < (u * cdf[:, -1])[:, None]).sum(-1)
    return below.clamp(max=shaped.shape[-1] - 1)


def sample(logits, temperature, top_k, top_p, generators: list[torch.Generator | None]):
    """logits: [N, V] float32; per-row parameters: [N]; generators: one per row,
    None for a greedy row (temperature 0) -> tokens: [N] int64.

    Only the rows that sample pay for the softmax and the draw, and only the rows
    that filter pay for the sort."""
    tokens = logits.argmax(-1)
    hot = [i for i, g in enumerate(generators) if g is not None]
    if not hot:
        return tokens
    rows = torch.tensor(hot, device=logits.device)
    lg, t, k, p = logits[rows], temperature[rows], top_k[rows], top_p[rows]
    filtering = ((k > 0) & (k < logits.shape[-1])) | (p < 1.0)
    shaped = filter_logits(lg, t, k, p) if bool(filtering.any()) else scale(lg, t)
    tokens[rows] = draw(shaped, [g for g in generators if g is not None])
    return tokens
