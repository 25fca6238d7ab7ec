"""The tests' NATS connections, on the project's client class (shared.bus): its
`flush()` is a barrier for the subscriptions and messages given before it, which
nats-py's own is not (its PING can overtake a SUB still queued for its flusher, and
a message published right after then finds no subscriber)."""

from __future__ import annotations

from nats.aio.client import Client

from shared.bus import open_client
from shared.config import Config


async def connect(url: str, **kw) -> Client:
    """`nats.connect(url, **kw)`, with no credentials beyond those in the URL."""
    return await open_client(url, Config.from_env({}), **kw)
