"""Waiting on a batch through the openai client, as the Batch API tests do."""

from __future__ import annotations

import asyncio
import time


async def until(client, batch_id: str, cond, timeout: float = 60.0):
    """The batch once `cond(batch)` holds (polled against a deadline, not a sleep)."""
    end = time.monotonic() + timeout
    while True:
        b = await client.batches.retrieve(batch_id)
        if cond(b):
            return b
        assert time.monotonic() < end, f"batch stuck: {b.status} {b.request_counts}"
        await asyncio.sleep(0.05)
