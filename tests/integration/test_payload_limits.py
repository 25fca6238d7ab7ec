"""The HTTP body limit follows the bus: a nats-server that takes smaller messages than
TENSORBUS_MAX_PAYLOAD lowers it, and a body over it is a prompt 413 that names the
limit in bytes, never a timeout."""

from __future__ import annotations

import time

import httpx
import msgspec

from shared.natsd import NatsServer
from tests.support.mock_engine import MockEncoder
from tests.support.stack import running_stack

MODEL = "all-MiniLM-L6-v2"
BUS_LIMIT = 32_768


def body(chars: int) -> bytes:
    return msgspec.json.encode({"model": MODEL, "input": ["word " * (chars // 5)]})


async def test_a_body_over_the_buses_max_payload_is_a_413_naming_it(tmp_path):
    conf = tmp_path / "small.conf"
    conf.write_text(f"max_payload: {BUS_LIMIT}\n")  # a bus stricter than the gateway
    with NatsServer(tmp_path / "js", config=str(conf)) as server:
        async with running_stack(server.url, max_payload=1_048_576) as st:
            await st.add_worker(MockEncoder(), "w-limits")
            assert st.gateway.front.nc.max_payload == BUS_LIMIT
            async with httpx.AsyncClient(base_url=st.http_url, timeout=30) as http:
                ok = await http.post("/v1/embeddings", content=body(1000))
                assert ok.status_code == 200, ok.text

                for send in (body(40_000), _chunked(body(40_000))):  # declared, then streamed
                    t0 = time.monotonic()
                    r = await http.post("/v1/embeddings", content=send)
                    assert r.status_code == 413, r.text
                    assert time.monotonic() - t0 < 2
                    err = r.json()["error"]
                    assert f"{BUS_LIMIT} bytes" in err["message"] and "max_payload" in err["message"]
                    assert err["code"] == "payload_too_large"


async def test_the_gateways_own_limit_holds_under_a_larger_bus(nats_server):
    async with running_stack(nats_server.url, max_payload=20_000) as st:
        assert st.gateway.front.nc.max_payload > 20_000  # the embedded server: 8 MB
        async with httpx.AsyncClient(base_url=st.http_url, timeout=30) as http:
            r = await http.post("/v1/embeddings", content=body(25_000))
        assert r.status_code == 413
        assert "20000 bytes (TENSORBUS_MAX_PAYLOAD)" in r.json()["error"]["message"]


async def _chunked(data: bytes):
    for i in range(0, len(data), 8192):  # no Content-Length: the stream is counted
        yield data[i:i + 8192]
