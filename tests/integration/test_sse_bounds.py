"""An SSE client that stops reading (services/gateway/sse_bounds.py), over a real
nats-server and HTTP with the mock decoder: a raw socket with a tiny receive window
asks for a long stream and never reads. Within TENSORBUS_SSE_WRITE_TIMEOUT_S of its
writes stalling the gateway cancels it: counted in
`tensorbus_gateway_sse_streams_cancelled_total`, the connection dropped, the work
cancelled at the worker (its slot freed before its tokens ran out). A stream read
beside it is served whole, and so is a request after it."""

from __future__ import annotations

import asyncio
import os
import socket
import time

import httpx
import msgspec

from tests.support.metrics import until_metric
from tests.support.mock_engine import MockDecoder
from tests.support.stack import running_stack, wait_until

MODEL = "tensorbus-demo-lm"
CONTEXT = 512  # the bundled model's: 4 choices of 500 tokens, about 400 KB of events
LONG = {"model": MODEL, "prompt": "the", "max_tokens": 500, "n": 4, "stream": True}
CANCELLED = ('tensorbus_gateway_sse_streams_cancelled_total{reason="write_timeout",'
             'route="completions"} 1.0')


class PacedDecoder(MockDecoder):
    """The mock at a model's pace: each decode step takes STEP_S of its engine thread
    (500 steps: 2.5 s, longer than the stall and its timeout take)."""

    def step_async(self):
        time.sleep(STEP_S)
        return super().step_async()


STEP_S = 0.005


async def test_a_stream_whose_client_stops_reading_is_cancelled_and_frees_its_slot(
        nats_server):
    engine = PacedDecoder(name=MODEL, slots=8, max_context=CONTEXT)
    async with running_stack(nats_server.url, sse_write_timeout_s=0.5,
                             max_context=CONTEXT) as st:
        worker = await st.add_worker(engine, "w-sse", kind="decoder")
        runner = worker.runner
        small_send_buffers(st.gateway.http_port)
        stuck = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        stuck.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # before connect: the window
        stuck.setblocking(False)
        loop = asyncio.get_running_loop()
        await loop.sock_connect(stuck, ("127.0.0.1", st.gateway.http_port))
        body = msgspec.json.encode(LONG)
        await loop.sock_sendall(stuck, b"POST /v1/completions HTTP/1.1\r\nHost: t\r\n"
                                b"Content-Type: application/json\r\n"
                                b"Content-Length: %d\r\n\r\n" % len(body) + body)
        await wait_until(lambda: runner.in_flight == 4, timeout=10)

        async with httpx.AsyncClient(base_url=st.http_url, timeout=30) as http:
            # a reader beside it gets its stream whole
            events = await read_stream(http, {**LONG, "max_tokens": 50, "n": 1})
            assert events[-1] == "[DONE]" and len(events) > 2

            await until_metric(http, CANCELLED, timeout=30)
            await wait_until(lambda: runner.in_flight == 0 and not runner.requests, timeout=10)
            assert runner.generated < 50 + 4 * LONG["max_tokens"]  # cut short, not run out
            assert await drained(loop, stuck)  # the connection was dropped
            stuck.close()

            generated = runner.generated
            events = await read_stream(http, {**LONG, "max_tokens": 20, "n": 1})
            assert events[-1] == "[DONE]"
            assert runner.generated == generated + 20


def small_send_buffers(port: int) -> None:
    """Give the gateway's connections a small kernel send buffer (they inherit the
    listening socket's), so that a client that stops reading stalls its writes after
    kilobytes instead of the megabytes loopback's autotuning would absorb."""
    for fd in os.listdir("/proc/self/fd"):
        try:
            sock = socket.socket(fileno=os.dup(int(fd)))
        except OSError:
            continue
        with sock:
            try:
                if (sock.type == socket.SOCK_STREAM and sock.getsockname()[1] == port
                        and sock.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN)):
                    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
                    return
            except (OSError, IndexError, TypeError):
                continue
    raise AssertionError("the gateway's listening socket was not found")


async def read_stream(http: httpx.AsyncClient, body: dict) -> list[str]:
    async with http.stream("POST", "/v1/completions", json=body) as r:
        assert r.status_code == 200
        return [line.removeprefix("data: ") async for line in r.aiter_lines()
                if line.startswith("data: ")]


async def drained(loop, sock: socket.socket) -> bool:
    """Read what the gateway had sent until the connection ends: True when it does."""
    try:
        while await asyncio.wait_for(loop.sock_recv(sock, 1 << 20), 10):
            pass
    except ConnectionResetError:
        pass
    return True


