"""A generation request's parameters, read from the request, then the model's own
`generation_config.json`, then OpenAI's defaults: the token budget (`max_tokens`,
never silently clamped) and the `Sampling` a worker applies on the device."""

from __future__ import annotations

import functools
import json
import random
from pathlib import Path

from shared.errors import bad_request
from shared.messages import Sampling


def max_tokens(req, chat: bool, prompt: int, limit: int) -> int:
    """The request's token budget; when it asks for more than the context leaves,
    a 400 naming both numbers (never a silent clamp). Unset: what the context leaves."""
    field = "max_completion_tokens" if chat and req.max_completion_tokens else "max_tokens"
    asked = (req.max_completion_tokens if chat else None) or req.max_tokens
    if asked is None:
        asked_min = limit - prompt
        if req.min_tokens > asked_min:
            raise bad_request(f"'min_tokens' is {req.min_tokens}: the context leaves "
                              f"{asked_min} tokens to generate for this prompt")
        return asked_min
    if req.min_tokens > asked:
        raise bad_request(f"'min_tokens' is {req.min_tokens}, more than '{field}' "
                          f"({asked})")
    if prompt + asked > limit:
        raise bad_request(
            f"'{field}' is {asked} and the prompt has {prompt} tokens: {prompt + asked} "
            f"tokens in all, over the model's context of {limit} tokens (at most "
            f"{limit - prompt} can be generated for this prompt)",
            code="context_length_exceeded")
    return asked


# OpenAI's defaults, used when neither the request nor the model's
# generation_config.json sets a field.
SAMPLING_DEFAULTS = {"temperature": 1.0, "top_p": 1.0, "top_k": -1, "min_p": 0.0,
                     "repetition_penalty": 1.0}


@functools.lru_cache(maxsize=64)
def generation_defaults(model_dir: str) -> dict[str, float]:
    """The sampling defaults the model's authors ship in `generation_config.json`
    (as vLLM applies them): those of SAMPLING_DEFAULTS it sets, with valid values."""
    path = Path(model_dir) / "generation_config.json"
    try:
        cfg = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    out: dict[str, float] = {}
    for key in SAMPLING_DEFAULTS:
        value = cfg.get(key)
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            out[key] = value
    return out


def top_logprobs(req, chat: bool) -> int:
    """Top logprobs per token the request wants: -1 none, 0 the sampled token's only."""
    if chat:
        return (req.top_logprobs or 0) if req.logprobs else -1
    return -1 if req.logprobs is None else req.logprobs


def drawn_seed(seed: int | None) -> int:
    """The request's seed, or one drawn here when it has none: every generation is
    then the same when generated again from its start (a stream whose worker was
    lost resumes exactly: the engine's draw for a token depends on the seed and the
    token's position only; services.gateway.continuity)."""
    return seed if seed is not None else random.getrandbits(31)


def sampling(req, defaults: dict[str, float], logprobs: int = -1, grammar: str = "") -> Sampling:
    """The request's sampling fields; those it leaves unset from the model's
    defaults, then OpenAI's."""
    def pick(key: str):
        value = getattr(req, key)
        if value is None:
            value = defaults.get(key, SAMPLING_DEFAULTS[key])
        return value

    return Sampling(temperature=max(0.0, float(pick("temperature"))),
                    top_p=min(1.0, float(pick("top_p"))) or 1.0, top_k=int(pick("top_k")),
                    seed=drawn_seed(req.seed), min_p=min(1.0, max(0.0, float(pick("min_p")))),
                    presence_penalty=req.presence_penalty or 0.0,
                    frequency_penalty=req.frequency_penalty or 0.0,
                    repetition_penalty=float(pick("repetition_penalty")) or 1.0,
                    logit_bias=sorted((req.logit_bias or {}).items()),
                    stop_token_ids=list(req.stop_token_ids or []), logprobs=logprobs,
                    grammar=grammar, min_tokens=req.min_tokens)


def check_tokens(sampling: Sampling, vocab: int) -> None:
    """Token ids in `logit_bias` and `stop_token_ids` must name tokens of the model."""
    for field, ids in (("logit_bias", [t for t, _ in sampling.logit_bias]),
                       ("stop_token_ids", sampling.stop_token_ids)):
        bad = next((t for t in ids if t >= vocab), None)
        if bad is not None:
            raise bad_request(f"'{field}' names token id {bad}, outside the vocabulary of "
                              f"{vocab} tokens")
