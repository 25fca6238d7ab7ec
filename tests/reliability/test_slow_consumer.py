"""A telemetry consumer that never reads cannot slow inference down.

Two such consumers subscribe to `telemetry.v1.>` on a nats-server of their own with a
small per-client buffer: a raw TCP client that never reads its socket, and a nats.py
client whose callback never returns. Meanwhile the stack serves embeddings with the
real encoder and a publisher floods telemetry. Core NATS never makes a publisher wait
for a subscriber: every request succeeds, the flood's flush returns, and the server
cuts the raw consumer off as a slow consumer."""

from __future__ import annotations

import asyncio
import json
import socket
import urllib.request

import msgspec
import nats
import pytest

from shared import subjects
from shared.natsd import NatsServer, free_port
from shared.telemetry import RequestRecord
from shared.telemetry import encode as encode_record
from tests.reliability.conftest import ENCODER
from tests.reliability.replies import ask
from tests.support.stack import running_stack
from tests.support.bus import connect as bus_connect

CONF = 'max_payload: 256KB\nmax_pending: 262144\nwrite_deadline: "1s"\n'


@pytest.fixture
def small_buffer_server(tmp_path):
    conf = tmp_path / "nats.conf"
    conf.write_text(CONF)
    monitor = free_port()
    with NatsServer(tmp_path / "store", config=str(conf), extra=["-m", str(monitor)]) as server:
        yield server, monitor


def varz(monitor: int) -> dict:
    with urllib.request.urlopen(f"http://127.0.0.1:{monitor}/varz", timeout=5) as r:
        return json.loads(r.read())


def sloth(port: int) -> socket.socket:
    """Subscribes to all telemetry, then never reads (a 4 kB receive window)."""
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    s.connect(("127.0.0.1", port))
    s.recv(4096)  # INFO
    s.sendall(b'CONNECT {"verbose":false,"pedantic":false,"name":"sloth"}\r\n'
              b"SUB telemetry.v1.> 1\r\nPING\r\n")
    return s


async def test_a_consumer_that_never_reads_never_slows_inference(small_buffer_server, minilm):
    server, monitor = small_buffer_server
    raw = sloth(server.port)
    stuck = asyncio.Event()
    dropped: list[Exception] = []

    async def on_error(exc: Exception) -> None:
        dropped.append(exc)  # nats.py's slow-consumer report: messages it discarded

    blocked = await bus_connect(server.url, name="blocked-consumer", error_cb=on_error)

    async def never_returns(msg) -> None:
        await stuck.wait()

    await blocked.subscribe("telemetry.v1.>", cb=never_returns, pending_msgs_limit=100)
    flood = await bus_connect(server.url, name="flood")
    try:
        async with running_stack(server.url) as st:
            await st.add_worker(minilm, "enc-slow")
            record = encode_record(RequestRecord(
                "r" * 32, "embeddings", ENCODER, "local", "w", 200, "", 0.01, 0.0, 0.0, 0.01, 4, 0))

            async def flood_telemetry() -> None:
                for i in range(20_000):
                    await flood.publish(subjects.TELEMETRY_REQUESTS, record)
                    if i % 1000 == 0:
                        await asyncio.sleep(0)
                await flood.flush(timeout=30)  # the server took it all: no back-pressure

            body = msgspec.json.encode({"model": ENCODER, "input": ["telemetry is not in the way"]})
            sem = asyncio.Semaphore(16)

            async def one() -> int:
                async with sem:
                    return (await ask(st.client, subjects.EMBEDDINGS, body)).code

            codes, _ = await asyncio.gather(asyncio.gather(*(one() for _ in range(200))),
                                            flood_telemetry())
            assert codes == [200] * 200
            assert st.gateway.nc.is_connected and st.workers["enc-slow"].nc.is_connected
        assert varz(monitor)["slow_consumers"] >= 1  # the server dropped the sloth
        assert dropped  # and the blocked client discarded what it could not hold
    finally:
        stuck.set()
        raw.close()
        await flood.close()
        await blocked.close()
