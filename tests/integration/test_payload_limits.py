"""Payload limits handled on purpose.

- The HTTP body limit follows the bus: a nats-server that takes smaller messages than
  TENSORBUS_MAX_PAYLOAD lowers it, and a body over it is a prompt 413 that names the
  limit in bytes, never a timeout.
- Embeddings are the exception: a request larger than one bus message (its token
  ids, or its vectors on the way back) is cut into parts that fit and answered
  whole, equal to sentence-transformers on the same texts, up to TENSORBUS_MAX_BODY.
- A worker never tries to publish an answer larger than the bus carries: a NATS
  client that asks for too many vectors at once gets a 413 that says so.
"""

from __future__ import annotations

import asyncio
import time

import httpx
import msgspec
import numpy as np

from shared import subjects
from shared.errors import HEADER_CODE
from shared.natsd import NatsServer
from bench.support.mock_encoder import MockEncoder
from tests.support.metrics import until_metric
from tests.support.stack import running_stack

MODEL = "all-MiniLM-L6-v2"
BUS_LIMIT = 32_768


def body(chars: int, model: str = MODEL) -> bytes:
    return msgspec.json.encode({"model": model, "input": ["word " * (chars // 5)]})


def completion(chars: int) -> bytes:
    return msgspec.json.encode({"model": "any", "prompt": "word " * (chars // 5)})


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

                for send in (completion(40_000), _chunked(completion(40_000))):  # declared, streamed
                    t0 = time.monotonic()
                    r = await http.post("/v1/completions", content=send)
                    assert r.status_code == 413, r.text
                    assert time.monotonic() - t0 < 2
                    err = r.json()["error"]
                    assert f"{BUS_LIMIT} bytes" in err["message"] and "max_payload" in err["message"]
                    assert err["code"] == "payload_too_large"


async def test_the_gateways_own_limits_hold_under_a_larger_bus(nats_server):
    async with running_stack(nats_server.url, max_payload=20_000, max_body=30_000) as st:
        assert st.gateway.front.nc.max_payload > 20_000  # the embedded server: 8 MB
        async with httpx.AsyncClient(base_url=st.http_url, timeout=30) as http:
            r = await http.post("/v1/completions", content=completion(25_000))
            assert r.status_code == 413
            assert "20000 bytes (TENSORBUS_MAX_PAYLOAD)" in r.json()["error"]["message"]
            r = await http.post("/v1/embeddings", content=body(35_000))
            assert r.status_code == 413
            assert "30000 bytes (TENSORBUS_MAX_BODY)" in r.json()["error"]["message"]


TEXTS = [f"passage {i}: " + " ".join(f"w{(i * 7 + j) % 97}" for j in range(25)) for i in range(160)]
SMALL_BUS = 16_384


async def test_embeddings_larger_than_a_bus_message_are_cut_and_answered_whole(
        tmp_path, minilm, sentence_transformer):
    """160 inputs: about 18 KB of JSON and 250 KB of vectors over a bus that carries
    16 KB a message. The answer is whole, in order, and equal to sentence-transformers;
    usage counts every input; no part was larger than the bus (the server would have
    refused it)."""
    conf = tmp_path / "small.conf"
    conf.write_text(f"max_payload: {SMALL_BUS}\n")
    with NatsServer(tmp_path / "js", config=str(conf)) as server:
        async with running_stack(server.url) as st:
            await st.add_worker(minilm, "w-parts", time_warmup=True)  # admitted by work
            payload = msgspec.json.encode({"model": MODEL, "input": TEXTS})
            assert len(payload) > SMALL_BUS
            async with httpx.AsyncClient(base_url=st.http_url, timeout=60) as http:
                r = await http.post("/v1/embeddings", content=payload)
            assert r.status_code == 200, r.text
            got = np.array([d["embedding"] for d in r.json()["data"]])
            assert [d["index"] for d in r.json()["data"]] == list(range(len(TEXTS)))
            want = sentence_transformer.encode(TEXTS, normalize_embeddings=True)
            np.testing.assert_allclose(got, want, atol=2e-4)
            tokens = sum(len(x) for x in sentence_transformer.tokenizer(TEXTS)["input_ids"])
            assert r.json()["usage"]["prompt_tokens"] == tokens

            # Over NATS the client's own library bounds the request; the answer it
            # asks for must still fit: 30 inputs of 384 floats do not, and say so.
            msg = await st.client.request(subjects.EMBEDDINGS, msgspec.json.encode(
                {"model": MODEL, "input": TEXTS[:30]}), timeout=30)
            assert msg.headers[HEADER_CODE] == "413"
            assert f"at most {SMALL_BUS}" in msgspec.json.decode(msg.data)["error"]["message"]


async def _chunked(data: bytes):
    for i in range(0, len(data), 8192):  # no Content-Length: the stream is counted
        yield data[i:i + 8192]


BUDGET = 100_000


async def test_bodies_in_memory_at_once_are_bounded_by_the_budget(nats_server):
    """TENSORBUS_MAX_INFLIGHT_BODY_BYTES: a client that states a large body and sends
    it slowly holds its share of the budget; while it does, a body that does not fit
    beside it is a prompt 429 with Retry-After naming the limit, one that fits is
    served, and once the slow body is in, the budget is free again."""
    async with running_stack(nats_server.url, max_inflight_body_bytes=BUDGET) as st:
        await st.add_worker(MockEncoder(), "w-budget")
        slow_body, big, small = inputs(80_000), inputs(30_000), inputs(1_000)
        assert len(slow_body) + len(big) > BUDGET > len(slow_body) + len(small)
        async with httpx.AsyncClient(base_url=st.http_url, timeout=30) as http:
            port = st.gateway.http_port
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(b"POST /v1/embeddings HTTP/1.1\r\nHost: t\r\n"
                         b"Content-Type: application/json\r\n"
                         b"Content-Length: %d\r\n\r\n" % len(slow_body) + slow_body[:100])
            await writer.drain()
            await until_held(http, len(slow_body))

            r = await http.post("/v1/embeddings", content=big)
            assert r.status_code == 429, r.text
            assert r.headers["Retry-After"] == "1"
            err = r.json()["error"]
            assert err["code"] == "body_budget_exhausted"
            assert f"{BUDGET} bytes (TENSORBUS_MAX_INFLIGHT_BODY_BYTES)" in err["message"]
            r = await http.post("/v1/embeddings", content=small)
            assert r.status_code == 200, r.text

            writer.write(slow_body[100:])  # the slow body arrives whole: answered, given back
            await writer.drain()
            head = await reader.readuntil(b"\r\n\r\n")
            assert head.startswith(b"HTTP/1.1 200"), head
            writer.close()
            await until_held(http, 0)
            r = await http.post("/v1/embeddings", content=big)
            assert r.status_code == 200, r.text


def inputs(chars: int) -> bytes:
    """An embeddings body of about `chars` bytes, in short inputs."""
    return msgspec.json.encode({"model": MODEL, "input": ["word " * 20] * (chars // 103)})


async def until_held(http: httpx.AsyncClient, held: int, timeout: float = 10) -> None:
    """Until the gateway's body budget gauge reads `held` bytes."""
    await until_metric(http, f"tensorbus_gateway_http_inflight_body_bytes {float(held)}", timeout)
