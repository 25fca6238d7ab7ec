"""The two sites of test_sites.py, each on a host of its own: a Linux network namespace
per site (tests/support/netns.py), joined by a veth pair that the leafnode crosses.
Each site's nats-server runs in its namespace (`ip netns exec`), bound to the
namespace's address; its gateway, scheduler and workers run on a loop whose thread
entered the namespace, so they reach their own server and nothing else. Needs root
(CI runs as root); fails saying so otherwise.

The delay between the sites is netem's on the veth pair where the kernel has it, a
TCP relay inside site a's namespace where it has not; the test prints which."""

from __future__ import annotations

import asyncio
import socket
import statistics
import time
from contextlib import AsyncExitStack, ExitStack, asynccontextmanager
from dataclasses import dataclass, field

from shared import catalog, subjects
from shared.natsd import NatsServer, site_config
from shared.telemetry import RequestRecord, record_decoder
from tests.reliability.test_sites import FAR, MODEL, ask, burst, sees
from bench.support.mock_encoder import MockEncoder
from tests.support.netns import Host, Link, NsLoop, listening
from tests.support.relay import Relay
from tests.support.stack import running_stack, wait_until

CLIENT_PORT, LEAF_PORT, RELAY_PORT = 4222, 7422, 7423  # each namespace has every port free
DELAY_S = 0.01


@dataclass
class Site:
    host: Host
    loop: NsLoop
    server: NatsServer
    stack: object = None  # tests.support.stack.Stack, living on `loop`
    heard: list = field(default_factory=list)  # request records heard at this site
    exit: AsyncExitStack | None = None

    async def run(self, fn, *args, timeout: float = 60.0):
        """`fn(*args)` run in this site's namespace, on its loop."""
        return await self.loop.call(fn, *args, timeout=timeout)

    async def open(self, site: str, settings: dict) -> None:
        """(on the site's loop) its stack, and every request record it hears."""
        self.exit = AsyncExitStack()
        far = {FAR: str(catalog.bundled_dir(catalog.ENCODER))}  # its tokenizer, for the gateway
        self.stack = await self.exit.enter_async_context(
            running_stack(self.server.url, far, site=site, **settings))

        async def keep(msg):
            rec = record_decoder.decode(msg.data)
            if isinstance(rec, RequestRecord):
                self.heard.append(rec)

        await self.stack.client.subscribe(subjects.TELEMETRY_REQUESTS, cb=keep)


@asynccontextmanager
async def netns_sites(tmp_path, delay_s: float = 0.0, **settings):
    """(link, site a, site b); site a is the hub, b dials it across the veth pair."""
    with Link(delay_s) as link:
        a, b = link.a, link.b
        relayed = link.delay_by == "relay"
        hub = f"nats-leaf://{a.addr}:{RELAY_PORT if relayed else LEAF_PORT}"
        confs = {"a": site_config("a", leaf_listen=LEAF_PORT, host=a.addr),
                 "b": site_config("b", hub=hub)}
        sites = []
        for name, host in (("a", a), ("b", b)):
            conf = tmp_path / f"{name}.conf"
            conf.write_text(confs[name])
            server = NatsServer(tmp_path / name, port=CLIENT_PORT, config=str(conf),
                                host=host.addr, launcher=host.launcher)
            sites.append(Site(host, NsLoop(host.ns), server))
        relay = None
        with ExitStack() as stop:  # however it ends: loops stopped, servers stopped
            for s in sites:
                stop.callback(s.server.stop)
                s.server.start(die_with_parent=True, wait=False)
                stop.callback(s.loop.stop)
                s.loop.start()
                await s.run(listening, s.host.addr, CLIENT_PORT)
            try:
                if relayed:
                    relay = Relay(LEAF_PORT, delay_s=delay_s, port=RELAY_PORT, host=a.addr)
                    await sites[0].run(relay.start)
                for name, s in zip("ab", sites):
                    await s.run(s.open, name, settings)
                yield link, sites[0], sites[1]
            finally:
                for s in sites:
                    if s.exit is not None:
                        await s.run(s.exit.aclose)
                if relay is not None:
                    await sites[0].run(relay.cut)


async def timings(st, model: str, n: int) -> list[float]:
    """(on the site's loop) n sequential requests after a warm-up: seconds each."""
    assert await ask(st.client, model) == 200  # the gateway's tokenizer loaded
    times = []
    for _ in range(n):
        t = time.perf_counter()
        assert await ask(st.client, model) == 200
        times.append(time.perf_counter() - t)
    return times


def unreachable_from_here(addr: str, port: int) -> bool:
    """No nats-server answers at a namespace's address from the machine's own network
    (a connection may be taken there by something else, but no INFO comes)."""
    try:
        with socket.create_connection((addr, port), timeout=0.5) as s:
            s.settimeout(0.5)
            return not s.recv(4).startswith(b"INFO")
    except OSError:
        return True


async def test_two_hosts_serve_locally_and_answer_a_far_only_model_across_the_link(tmp_path):
    async with netns_sites(tmp_path, DELAY_S) as (link, a, b):
        assert unreachable_from_here(a.host.addr, CLIENT_PORT)
        await a.run(a.stack.add_worker, MockEncoder(), "wa")
        await b.run(b.stack.add_worker, MockEncoder(), "wb")
        await b.run(b.stack.add_worker, MockEncoder(name=FAR), "wfar")
        await a.run(wait_until, lambda: sees(a.stack, "wb") and sees(a.stack, "wfar"))
        await b.run(wait_until, lambda: sees(b.stack, "wa"))
        assert a.stack.scheduler.fleet.workers["wfar"].hb.site == "b"

        assert await a.run(burst, a.stack, a.heard, 20) == ["a"] * 20  # at their own site
        assert await b.run(burst, b.stack, b.heard, 20) == ["b"] * 20
        carried = link.bytes_carried()
        assert await a.run(burst, a.stack, a.heard, 5, FAR) == ["b"] * 5  # across the pair
        assert link.bytes_carried() > carried

        local = await a.run(timings, a.stack, MODEL, 50)
        far = await a.run(timings, a.stack, FAR, 50)
        p50 = {k: statistics.median(v) for k, v in (("local", local), ("far", far))}
        p99 = {k: statistics.quantiles(v, n=100)[98] for k, v in (("local", local), ("far", far))}
        print(f"\nnetns site p50 / p99: local {p50['local'] * 1e3:.1f} / "
              f"{p99['local'] * 1e3:.1f} ms, far {p50['far'] * 1e3:.1f} / "
              f"{p99['far'] * 1e3:.1f} ms (veth pair, {DELAY_S * 1e3:.0f} ms each way "
              f"by {link.delay_by})")
        assert p50["far"] >= 2 * DELAY_S  # the work out and the answer back
        assert p50["local"] < p50["far"]


async def test_a_veth_pair_taken_down_leaves_each_host_serving_its_own(tmp_path):
    async with netns_sites(tmp_path) as (link, a, b):
        await a.run(a.stack.add_worker, MockEncoder(), "wa")
        await b.run(b.stack.add_worker, MockEncoder(), "wb")
        await a.run(wait_until, lambda: sees(a.stack, "wb"))
        await b.run(wait_until, lambda: sees(b.stack, "wa"))
        link.cut()  # packets stop; no connection is closed
        await asyncio.gather(
            a.run(wait_until, lambda: "wb" not in a.stack.scheduler.fleet.workers, 10),
            b.run(wait_until, lambda: "wa" not in b.stack.scheduler.fleet.workers, 10))
        assert await a.run(burst, a.stack, a.heard, 20) == ["a"] * 20
        assert await b.run(burst, b.stack, b.heard, 20) == ["b"] * 20
        link.mend()  # the leafnode's connection carries on: each sees the other again
        await asyncio.gather(a.run(wait_until, lambda: sees(a.stack, "wb"), 20),
                             b.run(wait_until, lambda: sees(b.stack, "wa"), 20))
