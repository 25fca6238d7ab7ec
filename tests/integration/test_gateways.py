"""Several gateways: two share one HTTP port (SO_REUSEPORT, as `honcho start -c
gateway=2` runs them) and both take traffic, over HTTP and NATS, with no request lost."""

from __future__ import annotations

import asyncio
import socket
from collections import Counter

import httpx
import msgspec
import nats

from services.gateway.service import Gateway
from shared import catalog, subjects
from bench.support.mock_encoder import MockEncoder
from tests.support.stack import running_stack, wait_until
from tests.support.bus import connect as bus_connect

MODEL = catalog.ENCODER


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def counted(gw: Gateway, served: Counter, name: str) -> None:
    """Count the requests `gw` submits (whichever transport brought them)."""
    inner = gw.front.submit

    async def submit(*args, **kw):
        served[name] += 1
        return await inner(*args, **kw)

    gw.front.submit = submit


async def test_two_gateways_share_the_http_port_and_both_take_traffic(nats_server):
    port = free_port()
    async with running_stack(nats_server.url, http_port=port) as st:
        nc = await bus_connect(nats_server.url, name="gateway-2")
        second = Gateway(nc, st.config)
        ready = asyncio.Event()
        task = asyncio.create_task(second.run(ready))
        try:
            await ready.wait()
            assert second.http_port == st.gateway.http_port == port
            await st.add_worker(MockEncoder(), "enc-gw")
            await wait_until(lambda: second.front.fleet.ready(MODEL))
            served: Counter[str] = Counter()
            counted(st.gateway, served, "first")
            counted(second, served, "second")
            body = {"model": MODEL, "input": ["hello world"]}
            # No keep-alive: every request is a new connection for the kernel to place.
            limits = httpx.Limits(max_keepalive_connections=0, max_connections=8)
            async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", limits=limits,
                                         timeout=30) as h:
                replies = await asyncio.gather(*(h.post("/v1/embeddings", json=body)
                                                 for _ in range(100)))
            assert [r.status_code for r in replies] == [200] * 100
            assert served["first"] > 0 and served["second"] > 0, served
            http_served = sum(served.values())
            # NATS: the gateway queue group spreads requests over both as well.
            data = msgspec.json.encode(body)
            msgs = await asyncio.gather(*(st.client.request(subjects.EMBEDDINGS, data, timeout=30)
                                          for _ in range(100)))
            assert all(not (m.headers or {}).get("Nats-Service-Error-Code") for m in msgs)
            assert sum(served.values()) == http_served + 100
        finally:
            second.stop()
            await asyncio.gather(task, return_exceptions=True)
            await nc.close()
