"""Deterministic inputs for encoder requests, shared by the tests and bench/."""

from __future__ import annotations

import random

import msgspec

WORDS = ("model serving system queue batch worker latency token stream cache engine "
         "gateway request reply subject message scale replica version canary metric "
         "compile shape bucket precision device memory thread event loop").split()


def sentences(n: int, words: int, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(words)) for _ in range(n)]


def short_inputs(n: int = 512) -> list[str]:
    return sentences(n, 12, seed=1)  # 14 tokens with [CLS]/[SEP]: the 16 bucket


def long_inputs(n: int = 512) -> list[str]:
    return sentences(n, 110, seed=2)  # 113-128 tokens (mean 119): the 128 bucket


def embed_body(model: str, text: str) -> bytes:
    return msgspec.json.encode({"model": model, "input": [text]})
