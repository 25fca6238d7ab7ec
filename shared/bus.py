"""NATS connection and process lifecycle helpers shared by every service.

Connections reconnect forever (a restarted nats-server is an outage, never an exit)
and drain on shutdown so nothing in flight is dropped.
"""

from __future__ import annotations

import asyncio
import signal
import time
from contextlib import asynccontextmanager
from typing import AsyncIterator

import nats
import nats.errors
from nats.aio.client import Client

from shared.logging import get_logger

log = get_logger("bus")


async def connect(url: str, name: str, **kw) -> Client:
    async def on_disconnect() -> None:
        log.warning("nats_disconnected", client=name)

    async def on_reconnect() -> None:
        log.info("nats_reconnected", client=name)

    last: dict[str, float] = {}

    async def on_error(exc: Exception) -> None:
        # A slow consumer reports one error per dropped message: log each kind at
        # most once a second so a burst cannot flood the logs.
        kind = type(exc).__name__
        now = time.monotonic()
        if now - last.get(kind, 0.0) >= 1.0:
            last[kind] = now
            log.warning("nats_error", client=name, error=str(exc) or kind)

    opts = dict(
        servers=[u.strip() for u in url.split(",")],
        name=name,
        max_reconnect_attempts=-1,
        reconnect_time_wait=0.25,
        allow_reconnect=True,
        connect_timeout=2,
        # Keep publishing into a buffer while reconnecting instead of raising.
        pending_size=64 * 1024 * 1024,
        disconnected_cb=on_disconnect,
        reconnected_cb=on_reconnect,
        error_cb=on_error,
        **kw,
    )
    # The first connection is retried too: under honcho every service starts at
    # once, and nats-server may need a moment to listen.
    delay = 0.1
    while True:
        try:
            return await nats.connect(**opts)
        except (OSError, nats.errors.NoServersError, TimeoutError) as exc:
            log.info("nats_waiting", client=name, error=str(exc) or type(exc).__name__)
            await asyncio.sleep(delay)
            delay = min(delay * 2, 2.0)


@asynccontextmanager
async def connection(url: str, name: str, **kw) -> AsyncIterator[Client]:
    nc = await connect(url, name, **kw)
    try:
        yield nc
    finally:
        if nc.is_connected:
            try:
                await asyncio.wait_for(nc.drain(), 5)
            except Exception as exc:  # noqa: BLE001 - shutdown must finish
                log.warning("drain_failed", error=str(exc))
        await close(nc)


async def close(nc: Client, timeout: float = 5.0) -> None:
    """Close a connection, whatever state the bus left it in. With nats-server gone,
    nats-py's close writes its pending buffer to a transport that is already closed and
    raises (uvloop: RuntimeError): a service stopped then must still exit cleanly."""
    if nc.is_closed:
        return
    try:
        await asyncio.wait_for(nc.close(), timeout)
    except Exception as exc:  # noqa: BLE001 - shutdown must finish
        log.warning("close_failed", client=nc.options.get("name"),
                    error=str(exc) or type(exc).__name__)


def stop_event() -> asyncio.Event:
    """An Event set by SIGINT or SIGTERM (call inside the running loop)."""
    ev = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, ev.set)
    return ev
