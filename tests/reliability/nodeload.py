"""The load and the server loss of the node-loss tests: clients posting embeddings
requests over HTTP in a loop, each request counted as sent, answered (with its vector
checked against the reference) or failed, noted with the scenario it was sent in; a
cluster member SIGKILLed under it, timed until every service is connected elsewhere."""

from __future__ import annotations

import asyncio
import signal
import time
from collections import Counter

import httpx
import numpy as np

from shared import subjects
from shared.bus import close
from shared.natsd import NatsCluster
from shared.telemetry import record_decoder
from tests.reliability.conftest import ENCODER
from tests.support.cluster import js_ready
from tests.support.stack import wait_until

CLIENTS = 4
TEXTS = ["node loss is an outage, never an error", "the cluster keeps three members",
         "a reply lost with its path is asked again", "vectors stay the same"]


def order(cluster: NatsCluster, first: int) -> str:
    """The cluster's members, starting with member `first`."""
    urls = [s.url for s in cluster.servers]
    return ",".join(urls[first:] + urls[:first])


def member(cluster: NatsCluster, nc) -> int:
    return next(i for i, s in enumerate(cluster.servers) if nc.connected_url.port == s.port)


class Load:
    """CLIENTS clients posting embeddings while `running`; the counts of every request."""

    def __init__(self, http_url: str, expected: np.ndarray, prefix: str = "nl") -> None:
        self.http_url, self.expected, self.prefix = http_url, expected, prefix
        self.sent: Counter[str] = Counter()
        self.during: Counter[str] = Counter()  # scenario -> requests sent in it
        self.answered: Counter[str] = Counter()
        self.failed: list[tuple[str, str, int, str]] = []
        self.wrong: list[str] = []
        self.phase = "before"
        self._stop = asyncio.Event()

    def total(self) -> int:
        return sum(self.answered.values()) + len(self.failed)

    async def _client(self, http: httpx.AsyncClient, n: int) -> None:
        i = 0
        while not self._stop.is_set():
            rid, at = f"{self.prefix}-{n}-{i}", self.phase  # the scenario it was sent in
            i += 1
            self.sent[rid] += 1
            self.during[at] += 1
            try:
                r = await http.post("/v1/embeddings", json={"model": ENCODER, "input": TEXTS},
                                    headers={"X-Request-Id": rid})
            except httpx.HTTPError as exc:
                self.failed.append((rid, at, 0, type(exc).__name__))
                continue
            if r.status_code != 200:
                self.failed.append((rid, at, r.status_code, r.text[:120]))
                continue
            self.answered[rid] += 1
            got = np.asarray([d["embedding"] for d in r.json()["data"]], dtype=np.float32)
            if not np.allclose(got, self.expected, atol=2e-3):
                self.wrong.append(rid)

    def running(self):
        """An async context: the clients run inside it, and are stopped (and awaited)
        when it ends."""
        return _Running(self)

    def check(self) -> None:
        """Nothing failed, nothing answered twice or wrong."""
        assert self.failed == [], self.failed
        assert all(n == 1 for n in self.sent.values())
        assert set(self.answered) == set(self.sent)
        assert all(n == 1 for n in self.answered.values())
        assert self.wrong == []


class _Running:
    def __init__(self, load: Load) -> None:
        self.load = load

    async def __aenter__(self) -> Load:
        self.http = httpx.AsyncClient(base_url=self.load.http_url, timeout=60)
        self.tasks = [asyncio.create_task(self.load._client(self.http, n))
                      for n in range(CLIENTS)]
        return self.load

    async def __aexit__(self, *exc) -> None:
        self.load._stop.set()
        await asyncio.gather(*self.tasks)
        await self.http.aclose()


async def lose(cluster: NatsCluster, victim: int, load: Load, scenario: str, clients,
               during=None) -> tuple[float, object]:
    """SIGKILL member `victim` while `load` runs (after a few answers); wait (counted)
    until every connection in `clients` is connected to another member, restart it,
    and wait for more answers through the new paths. `during`: a coroutine function
    started right after the kill (a registry push in the election), awaited at the
    end. Returns the seconds until every client was connected again, and what
    `during` returned."""
    before = load.total()
    await wait_until(lambda: load.total() >= before + 2 * CLIENTS, timeout=30)
    server = cluster.servers[victim]
    killed = time.monotonic()
    load.phase = scenario
    server.proc.send_signal(signal.SIGKILL)
    server.proc.wait()
    task = asyncio.create_task(during()) if during is not None else None

    def back() -> bool:
        return all(nc.is_connected and nc.connected_url.port != server.port for nc in clients)
    try:
        await wait_until(back, timeout=30)
        recovered = time.monotonic() - killed
        server.start(die_with_parent=True)
        after = sum(load.answered.values())
        await wait_until(lambda: sum(load.answered.values()) >= after + 2 * CLIENTS, timeout=30)
        return recovered, (await asyncio.wait_for(task, 60) if task is not None else None)
    finally:
        if task is not None and not task.done():
            task.cancel()


async def stored_records(url: str, want: int, prefix: str) -> Counter[str]:
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
            if rec.request_id.startswith(prefix + "-"):
                seen[rec.request_id] += 1
        await sub.unsubscribe()
    finally:
        await close(nc)
    return seen
