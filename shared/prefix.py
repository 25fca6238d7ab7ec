"""Prompt prefixes as KV cache blocks: the keys a decoder caches blocks under, and
the routing choice they allow. Shared by the engine (which keys its blocks) and the
scheduler (which sends a prompt where its prefix already is); neither imports the
other.

A key names a whole prefix: the hash of a full block's tokens chained with the key
of the block before it. Workers publish the keys they hold in heartbeats, cut to
8 bytes (`short`): a bounded summary, where a rare collision costs only a less good
route, never a wrong answer (the engine matches on the full key).
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Container, Sequence
from typing import TypeVar

import numpy as np

SUMMARY_KEYS = 256  # most keys a worker puts in one heartbeat
T = TypeVar("T")


def prefix_keys(tokens: Sequence[int], block: int) -> list[bytes]:
    """One key per full block of `tokens`: a hash of the block and everything before."""
    out: list[bytes] = []
    prev = b""
    ids = np.asarray(tokens, np.int64)
    for i in range(len(tokens) // block):
        prev = hashlib.blake2b(prev + ids[i * block : (i + 1) * block].tobytes(),
                               digest_size=16).digest()
        out.append(prev)
    return out


def short(key: bytes) -> int:
    return int.from_bytes(key[:8], "big")


def matched(keys: list[int], held: Container[int]) -> int:
    """How many leading blocks of a prompt (its short keys) a worker holds."""
    n = 0
    for k in keys:
        if k not in held:
            break
        n += 1
    return n


def choose(candidates: list[T], keys: list[int], held: Callable[[T], Container[int]],
           load: Callable[[T], tuple], imbalance: float,
           size: Callable[[T], int] | None = None) -> T:
    """The candidate holding the longest prefix of `keys` (the least loaded among
    equals), unless its load (first element: requests) exceeds the least loaded
    one's by more than `imbalance`; else the least loaded. A prompt nobody holds
    goes to the one caching least (`size`: its cached blocks) among the least
    loaded, so new prefixes spread over the fleet's caches instead of piling up
    where the load's tie-break happened to send them."""
    lightest = min(candidates, key=load)
    if not keys:
        return lightest
    best = min(candidates, key=lambda c: (-matched(keys, held(c)), load(c)))
    if matched(keys, held(best)) == 0:
        if size is None:
            return lightest
        return min(candidates, key=lambda c: (load(c)[0], size(c), load(c)))
    if load(best)[0] - load(lightest)[0] > imbalance:
        return lightest
    return best
