"""Which version serves one request: the canary with probability `canary_weight`."""

from __future__ import annotations

import hashlib
import random

from shared.registry import Aliases


def choose_version(aliases: Aliases, rng: random.Random, user: str = "") -> str:
    """The version for one request ("" when the model has no prod version yet).

    Without a `user` each call is an independent draw, so over n requests the
    canary's count is Binomial(n, canary_weight). Pass a seeded `rng` for
    reproducible splits.

    With a `user` the draw is sticky: the user's fixed point in [0, 1) for this
    canary version (a hash, the same in every scheduler and after restarts) is
    compared with the weight, so one user keeps one version while the canary lasts,
    raising the weight only moves users onto the canary, and a new canary version
    draws its users afresh.
    """
    if not (aliases.canary and aliases.canary_weight > 0.0):
        return aliases.prod
    point = user_point(user, aliases.canary) if user else rng.random()
    return aliases.canary if point < aliases.canary_weight else aliases.prod


def user_point(user: str, canary: str) -> float:
    """A uniform point in [0, 1) fixed by (user, canary version)."""
    digest = hashlib.blake2b(f"{canary}\0{user}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") / 2.0**64
