"""Prompt logprobs: how likely the model finds each token of a prompt, given the ones
before it (the completions API's `echo` with `logprobs`, what evaluation harnesses ask
for to score answers).

One forward pass over the whole prompt without the cache (`model.prompt_logits`), padded
to a power of two so few shapes compile, then log-softmax in float32 and the top
alternatives at each position, and each token's rank in the vocabulary (1 + how many
tokens are more likely there, as vLLM counts it: chat's `prompt_logprobs` shows it), on
the device; only [T, 2 + 2K] numbers come back. It runs on the engine's thread between
decode steps and touches no slot.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from engine.decoder.config import DecoderConfig
from engine.decoder.model import prompt_logits

MAX_TOP = 20  # alternatives computed at each position (OpenAI allows up to 20)
MIN_BUCKET = 16


@functools.lru_cache(maxsize=8)
def _scorer(cfg: DecoderConfig):
    def score(params, tokens, length):  # tokens: [T] -> [T - 1], [T - 1, K] ids, [T - 1, K], [T - 1]
        logp = jax.nn.log_softmax(prompt_logits(params, cfg, tokens, length)[:-1], axis=-1)
        chosen = jnp.take_along_axis(logp, tokens[1:, None], axis=-1)[:, 0]
        top_lp, top_ids = jax.lax.top_k(logp, MAX_TOP)
        rank = 1 + jnp.sum(logp > chosen[:, None], axis=-1, dtype=jnp.int32)
        return chosen, top_ids, top_lp, rank

    return jax.jit(score)


def prompt_logprobs(params, cfg: DecoderConfig, tokens: list[int],
                    top: int) -> list[tuple[int, float, list[tuple[int, float]], int]]:
    """For each prompt token after the first: (token, its logprob given the tokens
    before it, the `top` most likely tokens there with theirs, best first, its rank
    there: 1 + how many tokens are more likely)."""
    if len(tokens) < 2:
        return []
    if not 0 <= top <= MAX_TOP:
        raise ValueError(f"prompt logprobs: top must be 0..{MAX_TOP}, not {top}")
    size = max(MIN_BUCKET, 1 << (len(tokens) - 1).bit_length())
    padded = np.zeros(size, np.int32)
    padded[: len(tokens)] = tokens  # padding comes after: causal attention never sees it
    chosen, ids, lps, ranks = jax.device_get(_scorer(cfg)(params, jnp.asarray(padded),
                                                          jnp.int32(len(tokens))))
    n = len(tokens) - 1
    return [(int(tokens[i + 1]), float(chosen[i]),
             [(int(t), float(v)) for t, v in zip(ids[i, :top], lps[i, :top])], int(ranks[i]))
            for i in range(n)]
