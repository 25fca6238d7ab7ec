"""Two sites joined by a leafnode (docs/decisions/0054-sites.md), each with its own
scheduler, gateway and worker on its own nats-server: requests are answered at
their own site, spill to the other when their site has no worker, a model served
only at the far site answers while the link is up, and a cut link leaves each site
serving its own. Counted from the telemetry records' `site`. The link runs through
a relay (tests/support/relay.py) that can cut it and delay it."""

from __future__ import annotations

import asyncio
import statistics
import time
import uuid
from contextlib import asynccontextmanager

import msgspec

from services.fleet import WorkerView
from services.scheduler.sites import at_site
from shared import catalog, subjects
from shared.errors import HEADER_CODE
from shared.natsd import NatsSites, free_port
from shared.telemetry import Heartbeat, RequestRecord, record_decoder
from bench.support.mock_encoder import MockEncoder
from tests.support.relay import Relay
from tests.support.stack import running_stack, wait_until

MODEL = "all-MiniLM-L6-v2"
FAR = "far-only-encoder"  # served at site b alone


@asynccontextmanager
async def two_sites(tmp_path, delay_s: float = 0.0, **settings):
    """(relay, stack at a, stack at b, records heard at a, records heard at b)."""
    sites = NatsSites(tmp_path / "nats", link_port=free_port())
    relay = Relay(sites.leaf_port, delay_s=delay_s, port=sites.link_port)
    await relay.start()
    with sites.start(die_with_parent=True):
        far = {FAR: str(catalog.bundled_dir(catalog.ENCODER))}  # its tokenizer, for the gateways
        async with running_stack(sites.hub.url, far, site="a", **settings) as a, \
                running_stack(sites.leaf.url, far, site="b", **settings) as b:
            heard: tuple[list, list] = ([], [])
            for st, into in zip((a, b), heard):
                async def keep(msg, into=into):
                    rec = record_decoder.decode(msg.data)
                    if isinstance(rec, RequestRecord):
                        into.append(rec)
                await st.client.subscribe(subjects.TELEMETRY_REQUESTS, cb=keep)
            try:
                yield relay, a, b, heard[0], heard[1]
            finally:
                await relay.cut()


async def ask(nc, model: str = MODEL, rid: str | None = None, timeout: float = 10.0) -> int:
    body = msgspec.json.encode({"model": model, "input": ["hello world"]})
    headers = {"X-Request-Id": rid} if rid else None
    msg = await nc.request(subjects.EMBEDDINGS, body, timeout=timeout, headers=headers)
    return int((msg.headers or {}).get(HEADER_CODE, 200))


async def burst(st, records: list, n: int, model: str = MODEL) -> list[str]:
    """n requests at `st`'s site, all answered 200 -> the sites their records name
    (`records`: heard at that site; the other site's may be among them)."""
    tag = uuid.uuid4().hex[:8]
    codes = await asyncio.gather(*(ask(st.client, model, f"{tag}-{i}") for i in range(n)))
    assert codes == [200] * n
    mine = lambda: [r for r in records if r.request_id.startswith(tag)]  # noqa: E731
    await wait_until(lambda: len(mine()) >= n, timeout=10)
    return [r.site for r in mine()]


def sees(st, worker_id: str) -> bool:
    w = st.scheduler.fleet.workers.get(worker_id)
    return w is not None and w.ready and worker_id in st.gateway.front.fleet.workers


async def test_requests_stay_at_their_site_and_spill_when_it_has_no_worker(tmp_path):
    async with two_sites(tmp_path) as (relay, a, b, heard_a, heard_b):
        await a.add_worker(MockEncoder(), "wa")
        await b.add_worker(MockEncoder(), "wb")
        await b.add_worker(MockEncoder(name=FAR), "wfar")
        await wait_until(lambda: sees(a, "wb") and sees(a, "wfar") and sees(b, "wa"))
        assert a.scheduler.fleet.workers["wb"].hb.site == "b"

        assert await burst(a, heard_a, 20) == ["a"] * 20  # preferred: A's own worker
        assert await burst(b, heard_b, 20) == ["b"] * 20
        assert await burst(a, heard_a, 5, FAR) == ["b"] * 5  # only at B: answered there

        await a.stop_worker("wa")  # A's only worker of the model goes away
        await wait_until(lambda: "wa" not in a.scheduler.fleet.workers)
        assert await burst(a, heard_a, 20) == ["b"] * 20  # spilled to B, all answered


async def test_requests_spill_when_their_sites_workers_are_at_capacity(tmp_path):
    held = MockEncoder()
    held.gate.clear()  # A's worker computes nothing: what it takes stays outstanding
    async with two_sites(tmp_path, max_queue_per_worker=2) as (relay, a, b, heard_a, _):
        await a.add_worker(held, "wa")
        await b.add_worker(MockEncoder(), "wb")
        await wait_until(lambda: sees(a, "wb"))
        asked = asyncio.gather(burst(a, heard_a, 2), burst(a, heard_a, 2))
        # Two fill wa to the bound, two go to B; A's two finish once wa computes.
        await wait_until(lambda: a.scheduler.dispatched == 4)
        assert a.scheduler.load.get("wa") == 2  # at the bound while B took the rest
        held.gate.set()
        sites = sorted(sum(await asked, []))
        assert sites == ["a", "a", "b", "b"]


async def test_a_cut_link_leaves_each_site_serving_its_own(tmp_path):
    async with two_sites(tmp_path) as (relay, a, b, heard_a, heard_b):
        await a.add_worker(MockEncoder(), "wa")
        await b.add_worker(MockEncoder(), "wb")
        await wait_until(lambda: sees(a, "wb") and sees(b, "wa"))
        await relay.cut()
        # Each scheduler sees the other site's worker expire (missed heartbeats)...
        await wait_until(lambda: "wb" not in a.scheduler.fleet.workers
                         and "wa" not in b.scheduler.fleet.workers, timeout=10)
        # ...and each site answers its own requests with its own worker meanwhile.
        assert await burst(a, heard_a, 20) == ["a"] * 20
        assert await burst(b, heard_b, 20) == ["b"] * 20
        await relay.mend()  # the leaf redials: each site sees the other's worker again
        await wait_until(lambda: sees(a, "wb") and sees(b, "wa"), timeout=10)
        assert relay.accepted >= 2


async def test_far_site_answers_cost_the_link_round_trip(tmp_path):
    """p50 of requests answered at their own site against ones answered across a link
    with DELAY_S each way (docs/benchmarks.md)."""
    delay = 0.01
    async with two_sites(tmp_path, delay_s=delay) as (relay, a, b, heard_a, heard_b):
        await a.add_worker(MockEncoder(), "wa")
        await b.add_worker(MockEncoder(name=FAR), "wfar")
        await wait_until(lambda: sees(a, "wfar"))
        p50, p99 = {}, {}
        for name, model in (("local", MODEL), ("far", FAR)):
            assert await ask(a.client, model) == 200  # the gateway's tokenizer loaded
            times = []
            for _ in range(50):
                t = time.perf_counter()
                assert await ask(a.client, model) == 200
                times.append(time.perf_counter() - t)
            p50[name] = statistics.median(times)
            p99[name] = statistics.quantiles(times, n=100)[98]
        print(f"\nsite p50 / p99: local {p50['local'] * 1e3:.1f} / {p99['local'] * 1e3:.1f} ms, "
              f"far {p50['far'] * 1e3:.1f} / {p99['far'] * 1e3:.1f} ms "
              f"(link delay {delay * 1e3:.0f} ms each way)")
        # The work crosses the link once and its answer once: two delays at least.
        assert p50["far"] >= 2 * delay
        assert p50["local"] < p50["far"]


def _view(wid: str, site: str) -> WorkerView:
    hb = Heartbeat(worker_id=wid, model=MODEL, kind="encoder", state="ready", versions=["1"],
                   queue_depth=0, in_flight=0, max_batch=8, batch_occupancy=0.0, steps=0,
                   rss_bytes=0, device="cpu", sent_at=0.0, site=site)
    return WorkerView(hb, 0.0, 0.0)


def test_site_choice_spills_only_when_its_own_site_has_no_room():
    a1, a2, b1 = _view("a1", "a"), _view("a2", "a"), _view("b1", "b")
    load = {"a1": 4, "a2": 1, "b1": 0}
    choose = lambda ready: at_site(ready, "a", lambda w: load[w.worker_id], 4)  # noqa: E731
    assert choose([a1, a2, b1]) == [a2]  # a1 is at capacity, a2 has room
    load["a2"] = 4
    assert choose([a1, a2, b1]) == [a1, a2, b1]  # all of A at capacity: B too
    assert choose([b1]) == [b1]  # none at A
    one = [_view("x", ""), _view("y", "")]
    assert at_site(one, "", lambda w: 99, 4) == one  # one site: nothing filtered
