"""Which version serves one request: the canary with probability `canary_weight`."""

from __future__ import annotations

import random

from shared.registry import Aliases


def choose_version(aliases: Aliases, rng: random.Random) -> str:
    """The version for one request ("" when the model has no prod version yet).

    Each call is an independent draw, so over n requests the canary's count is
    Binomial(n, canary_weight). Pass a seeded `rng` for reproducible splits.
    """
    if aliases.canary and aliases.canary_weight > 0.0 and rng.random() < aliases.canary_weight:
        return aliases.canary
    return aliases.prod
