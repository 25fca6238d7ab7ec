"""Waiting on a gateway's Prometheus metrics over HTTP."""

from __future__ import annotations

import asyncio
import time

import httpx


async def until_metric(http: httpx.AsyncClient, line: str, timeout: float = 10.0) -> None:
    """Poll the gateway's /metrics until it has `line` (a condition, not a sleep)."""
    end = time.monotonic() + timeout
    while line not in (await http.get("/metrics")).text.splitlines():
        assert time.monotonic() < end, f"never: {line}"
        await asyncio.sleep(0.02)
