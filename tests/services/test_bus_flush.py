"""`flush()` on a tensorbus connection is a barrier: once it returns, the server has the
subscriptions and messages given before it (nats-py alone answers its PING before
commands still queued for its flusher task, so a `tail` that said it was ready missed
the first records under load)."""

from shared.bus import close, open_client
from shared.config import Config


class _Wire:
    """Records what a connection writes to its socket, in order."""

    def __init__(self, transport) -> None:
        self.sent: list[bytes] = []
        self._transport = transport

    def write(self, data) -> None:
        self.sent.append(bytes(data))
        self._transport.write(data)

    def writelines(self, lines) -> None:
        lines = list(lines)
        self.sent.extend(bytes(x) for x in lines)
        self._transport.writelines(lines)

    def __getattr__(self, name):
        return getattr(self._transport, name)


async def test_the_last_ping_follows_every_subscription_on_the_wire(nats_server):
    nc = await open_client(nats_server.url, Config.from_env({}))
    try:
        wire = _Wire(nc._transport)
        nc._transport = wire
        for subject in ("a.one", "a.two", "a.three"):
            await nc.subscribe(subject)
        await nc.publish("a.one", b"x")
        await nc.flush()
        data = b"".join(wire.sent)
        # The PONG that ended flush() answers the last PING written: everything
        # queued before the call precedes it on the wire, so the server has it.
        last_ping = data.rindex(b"PING\r\n")
        for command in (b"SUB a.one", b"SUB a.two", b"SUB a.three", b"PUB a.one"):
            assert -1 < data.find(command) < last_ping, (command, data)
    finally:
        await close(nc)


async def test_a_subscription_made_before_flush_gets_the_next_publish(nats_server):
    listener = await open_client(nats_server.url, Config.from_env({}))
    publisher = await open_client(nats_server.url, Config.from_env({}))
    try:
        sub = await listener.subscribe("b.records")
        await listener.flush()
        await publisher.publish("b.records", b"first")
        await publisher.flush()
        msg = await sub.next_msg(timeout=10)
        assert msg.data == b"first"
    finally:
        await close(listener)
        await close(publisher)
