"""Deterministic benchmark inputs and a closed-loop load generator over NATS."""

from __future__ import annotations

import asyncio
import random
import time

import msgspec
import numpy as np

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


def percentiles(lat_s: list[float]) -> dict[str, float]:
    a = np.asarray(lat_s) * 1000
    if not len(a):
        return {"p50_ms": float("nan"), "p99_ms": float("nan")}
    return {"p50_ms": float(np.percentile(a, 50)), "p99_ms": float(np.percentile(a, 99))}


async def closed_loop(nc, subject: str, bodies: list[bytes], concurrency: int,
                      seconds: float, warmup_s: float = 1.0, timeout: float = 30.0) -> dict:
    """`concurrency` clients, each sending its next request when the last returns."""
    lat: list[float] = []
    errors = 0
    t_start = time.perf_counter()
    t_measure = t_start + warmup_s
    t_end = t_measure + seconds
    counted = answered = 0

    async def client(i: int) -> None:
        nonlocal errors, counted, answered
        k = i
        while True:
            t0 = time.perf_counter()
            if t0 >= t_end:
                return
            msg = await nc.request(subject, bodies[k % len(bodies)], timeout=timeout)
            t1 = time.perf_counter()
            answered += 1
            k += concurrency
            if t0 >= t_measure and t1 <= t_end:
                counted += 1
                lat.append(t1 - t0)
                if (msg.headers or {}).get("Nats-Service-Error-Code"):
                    errors += 1

    await asyncio.gather(*(client(i) for i in range(concurrency)))
    # answered / wall_s: every request of the call, warm-up included (CPU per request)
    return {"concurrency": concurrency, "requests": counted, "errors": errors,
            "rps": counted / seconds, "answered": answered,
            "wall_s": time.perf_counter() - t_start, **percentiles(lat)}


def embed_body(model: str, text: str) -> bytes:
    return msgspec.json.encode({"model": model, "input": [text]})
