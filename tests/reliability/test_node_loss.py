"""Node loss under load: a three-server NATS cluster, the gateway, the scheduler and a
real encoder worker each connected to a different member, a steady load of embeddings
requests over HTTP; then the server the gateway is on is SIGKILLed (and restarted),
then the one the worker is on. Counted: every request sent is answered once and with
its vector, none fails, and every service is connected again within seconds."""

from __future__ import annotations

import asyncio
import signal
import time
from collections import Counter

import httpx
import numpy as np
import pytest

from services.telemetry.stream import ensure_stream, stream_config
from shared import subjects
from shared.bus import close
from shared.natsd import NatsCluster
from shared.telemetry import record_decoder
from tests.reliability.conftest import ENCODER
from tests.support.cluster import js_ready, until
from tests.support.stack import running_stack, wait_until

CLIENTS = 4
TEXTS = ["node loss is an outage, never an error", "the cluster keeps three members",
         "a reply lost with its path is asked again", "vectors stay the same"]
FIGURES: dict[str, dict] = {}  # per scenario, for docs/benchmarks.md


def order(cluster: NatsCluster, first: int) -> str:
    """The cluster's members, starting with member `first`."""
    urls = [s.url for s in cluster.servers]
    return ",".join(urls[first:] + urls[:first])


def member(cluster: NatsCluster, nc) -> int:
    return next(i for i, s in enumerate(cluster.servers) if nc.connected_url.port == s.port)


@pytest.fixture
async def cluster(tmp_path):
    """A formed cluster with the TELEMETRY stream on all three members."""
    with NatsCluster(tmp_path / "nats", 3).start(die_with_parent=True) as c:
        nc = await js_ready(c.url)
        try:
            await until(lambda: ensure_stream(nc.jetstream(), stream_config(), 3))
        finally:
            await close(nc)
        yield c


async def stored_records(url: str, want: int) -> Counter[str]:
    """The gateway's records on the TELEMETRY stream, per request id (the load's)."""
    nc = await js_ready(url)
    seen: Counter[str] = Counter()
    try:
        sub = await nc.jetstream().subscribe(subjects.TELEMETRY_REQUESTS, ordered_consumer=True)
        end = time.monotonic() + 30
        while sum(seen.values()) < want and time.monotonic() < end:
            try:
                msg = await sub.next_msg(timeout=1)
            except TimeoutError:
                continue
            rec = record_decoder.decode(msg.data)
            if rec.request_id.startswith("nl-"):
                seen[rec.request_id] += 1
        await sub.unsubscribe()
    finally:
        await close(nc)
    return seen


async def test_losing_the_gateways_and_the_workers_server_under_load(cluster, minilm,
                                                                sentence_transformer):
    async with running_stack(cluster.url, urls={"gateway": order(cluster, 0),
                                                "scheduler": order(cluster, 1),
                                                "client": order(cluster, 2)}) as st:
        worker = await st.add_worker(minilm, "enc-node-loss", url=order(cluster, 2))
        services = {"gateway": st.gateway.nc, "scheduler": st.scheduler.nc,
                    "worker": worker.nc}
        assert [member(cluster, nc) for nc in services.values()] == [0, 1, 2]
        expected = sentence_transformer.encode(TEXTS, normalize_embeddings=True)  # the reference

        sent: Counter[str] = Counter()
        answered: Counter[str] = Counter()
        failed: list[tuple[str, str, int, str]] = []
        phase = ["before"]
        wrong: list[str] = []
        stop = asyncio.Event()

        async def load(http: httpx.AsyncClient, n: int) -> None:
            i = 0
            while not stop.is_set():
                rid, at = f"nl-{n}-{i}", phase[0]  # the scenario it was sent in
                i += 1
                sent[rid] += 1
                try:
                    r = await http.post("/v1/embeddings", json={"model": ENCODER,
                                                                "input": TEXTS},
                                        headers={"X-Request-Id": rid})
                except httpx.HTTPError as exc:
                    failed.append((rid, at, 0, type(exc).__name__))
                    continue
                if r.status_code != 200:
                    failed.append((rid, at, r.status_code, r.text[:120]))
                    continue
                answered[rid] += 1
                got = np.asarray([d["embedding"] for d in r.json()["data"]], dtype=np.float32)
                if not np.allclose(got, expected, atol=2e-3):
                    wrong.append(rid)

        def total() -> int:
            return sum(answered.values()) + len(failed)

        async def lose(victim: int, scenario: str) -> None:
            """SIGKILL member `victim` while the load runs; wait (counted) until every
            service is connected to another member, restart it, and note the figures."""
            before = total()
            await wait_until(lambda: total() >= before + 2 * CLIENTS, timeout=30)
            sent_before = sum(sent.values())
            server = cluster.servers[victim]
            killed = time.monotonic()
            phase[0] = scenario
            server.proc.send_signal(signal.SIGKILL)
            server.proc.wait()

            def back() -> bool:
                return all(nc.is_connected and nc.connected_url.port != server.port
                           for nc in [*services.values(), st.client])
            await wait_until(back, timeout=30)
            recovered = time.monotonic() - killed
            server.start(die_with_parent=True)
            # and the load goes on through the new paths: more requests answered
            after = sum(answered.values())
            await wait_until(lambda: sum(answered.values()) >= after + 2 * CLIENTS, timeout=30)
            FIGURES[scenario] = {"recovered_s": round(recovered, 2),
                                 "sent_during": sum(sent.values()) - sent_before,
                                 "gateway_retried": st.gateway.front.retried,
                                 "redispatched": st.scheduler.redispatched}

        async with httpx.AsyncClient(base_url=st.http_url, timeout=60) as http:
            loads = [asyncio.create_task(load(http, n)) for n in range(CLIENTS)]
            try:
                await lose(member(cluster, st.gateway.nc), "gateway's server")
                await lose(member(cluster, worker.nc), "worker's server")
            finally:
                stop.set()
                await asyncio.gather(*loads)

        print("node loss:", FIGURES, "sent", sum(sent.values()), "failed", len(failed),
              "records retried", st.gateway.front.recorder.retried)
        assert failed == [], failed
        assert all(n == 1 for n in sent.values())
        assert set(answered) == set(sent) and all(n == 1 for n in answered.values())
        assert wrong == []
        # the scheduler's books balance: a request sent twice is counted once
        sched = st.scheduler
        await wait_until(lambda: not sched.outstanding, timeout=10)
        assert all(n == 0 for n in sched.load.values()), sched.load
        # every request's record stored once on the stream, none lost with a server
        records = await stored_records(cluster.url, len(answered))
        assert records == answered, set(records) ^ set(answered)
        assert st.gateway.front.recorder.lost == 0
        assert all(f["recovered_s"] < 15 for f in FIGURES.values()), FIGURES
