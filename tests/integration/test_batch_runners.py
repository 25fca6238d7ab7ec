"""Two batch runners on one bus (services/batch/lease.py): a real nats-server,
gateway, scheduler and the hand-checkable mock encoder, the Batch API driven by the
unchanged `openai` client, each runner (`BatchRunner`) on its own connection, leases
of TENSORBUS_BATCH_LEASE_S = 3 s (renewed each second: a loaded machine's pauses
do not hand a lease over). The test watches the `leases.*` keys themselves.

- Side by side: several batches at once each run under one runner's lease from
  start to end, each custom_id answered exactly once, and the model computed each
  line once (no line sent by both runners).
- One runner dies mid-batch (its connection drops first, so it releases nothing):
  the other takes its lease over once the lease stops moving and finishes the
  batch, each custom_id once, none missing.
- One runner stops cleanly mid-batch: it releases its lease and the other finishes
  the batch, each custom_id once.
Every wait is on a condition.
"""

from __future__ import annotations

import asyncio
import json
import threading

import msgspec
import openai
import pytest
from nats.js.kv import KV_DEL, KV_PURGE

from bench.support.mock_encoder import MockEncoder
from services.batch.runner import BatchRunner
from services.batchstore import BatchStore
from tests.support.batches import until
from tests.support.bus import connect as bus_connect
from tests.support.stack import running_stack, wait_until

MODEL = "all-MiniLM-L6-v2"
FINAL = ("completed", "failed", "cancelled", "expired")


class Counting(MockEncoder):
    """The mock encoder, counting inputs; held for good after `after` of them."""

    def __init__(self) -> None:
        super().__init__(max_batch=8)
        self.computed = 0
        self.after: int | None = None
        self.held = threading.Event()

    def embed(self, inputs):
        if self.after is not None and self.computed >= self.after:
            self.gate.clear()
            self.held.set()
        out = super().embed(inputs)
        self.computed += len(inputs)
        return out


class Runner:
    """A batch runner on a connection of its own."""

    def __init__(self, url: str, config) -> None:
        self.url, self.config = url, config

    async def start(self) -> Runner:
        self.nc = await bus_connect(self.url, name="batch-runner")
        self.runner = BatchRunner(self.nc, self.config)
        self.task = asyncio.create_task(self.runner.run())
        await wait_until(lambda: self.runner.health.ready)
        return self

    @property
    def owner(self) -> str:
        return self.runner.owner

    async def kill(self) -> None:
        """Gone as a killed process is: the connection first, so nothing is released."""
        await self.nc.close()
        self.task.cancel()
        await asyncio.gather(self.task, return_exceptions=True)

    async def stop(self) -> None:
        if not self.task.done():
            self.runner.stop()
            await asyncio.gather(self.task, return_exceptions=True)
        if not self.nc.is_closed:
            await self.nc.close()


async def watch_owners(nc) -> tuple[dict[str, list[str]], object]:
    """batch id -> the runners named by each write of its lease, in order."""
    owners: dict[str, list[str]] = {}
    kv = (await BatchStore.open(nc)).kv

    async def follow(watcher):
        async for e in watcher:
            if e is None or e.operation in (KV_DEL, KV_PURGE) or not e.value:
                continue
            owners.setdefault(e.key.split(".", 1)[1], []).append(
                msgspec.json.decode(e.value)["runner"])

    watcher = await kv.watch("leases.*")
    return owners, asyncio.create_task(follow(watcher))


def lines(prefix: str, n: int) -> bytes:
    return b"".join(json.dumps({"custom_id": f"{prefix}-{i}", "method": "POST",
                                "url": "/v1/embeddings",
                                "body": {"model": MODEL, "input": f"{prefix} line {i}"}}
                               ).encode() + b"\n" for i in range(n))


async def submit(client, prefix: str, n: int):
    f = await client.files.create(file=(f"{prefix}.jsonl", lines(prefix, n)), purpose="batch")
    return await client.batches.create(input_file_id=f.id, endpoint="/v1/embeddings",
                                       completion_window="24h")




async def answered_once(client, batch, prefix: str, n: int) -> None:
    """Completed, each custom_id in the output exactly once and in input order."""
    assert batch.status == "completed", batch
    c = batch.request_counts
    assert (c.total, c.completed, c.failed) == (n, n, 0) and batch.error_file_id is None
    raw = (await client.files.content(batch.output_file_id)).content
    out = [json.loads(x) for x in raw.splitlines() if x.strip()]
    assert [x["custom_id"] for x in out] == [f"{prefix}-{i}" for i in range(n)]
    assert all(x["response"]["status_code"] == 200 for x in out)


@pytest.mark.timeout(120)
async def test_two_runners_share_the_batches_and_one_takes_over_a_dead_ones(nats_server):
    eng = Counting()
    async with running_stack(nats_server.url, max_batch=8, batch_concurrency=8,
                             batch_lease_s=3.0) as st:
        await st.add_worker(eng, "enc-runners")
        owners, follower = await watch_owners(st.client)
        a = await Runner(nats_server.url, st.config).start()
        b = await Runner(nats_server.url, st.config).start()
        client = openai.AsyncOpenAI(base_url=st.http_url + "/v1", api_key="none",
                                    max_retries=0)
        c: Runner | None = None
        try:
            # Side by side: each batch under one lease, each line computed once.
            batches = await asyncio.gather(*(submit(client, f"s{k}", 40) for k in range(6)))
            done = await asyncio.gather(*(until(client, x.id, lambda y: y.status in FINAL)
                                          for x in batches))
            for k, d in enumerate(done):
                await answered_once(client, d, f"s{k}", 40)
                assert len(set(owners[d.id])) == 1, owners[d.id]
            assert eng.computed == 6 * 40
            held = {owners[d.id][0] for d in done}
            assert held <= {a.owner, b.owner}
            print(f"batches per runner: {[owners[d.id][0] for d in done]}")

            # One dies mid-batch: the other takes the batch over and finishes it.
            eng.after = eng.computed + 50
            batch = await submit(client, "t", 150)
            assert await asyncio.to_thread(eng.held.wait, 30), "the engine was never held"
            mid = await until(client, batch.id, lambda y: y.request_counts.completed > 0)
            assert mid.status == "in_progress" and mid.request_counts.completed < 150, mid
            holder = owners[batch.id][-1]
            dead, alive = (a, b) if holder == a.owner else (b, a)
            await dead.kill()
            eng.after = None
            eng.gate.set()  # what the dead runner had in flight is answered to no one
            await wait_until(lambda: owners[batch.id][-1] == alive.owner, timeout=20)
            finished = await until(client, batch.id, lambda y: y.status in FINAL)
            await answered_once(client, finished, "t", 150)
            assert set(owners[batch.id]) == {dead.owner, alive.owner}

            # One stops cleanly mid-batch: it releases the lease, the other goes on.
            c = await Runner(nats_server.url, st.config).start()
            eng.held.clear()
            eng.after = eng.computed + 50
            batch = await submit(client, "u", 150)
            assert await asyncio.to_thread(eng.held.wait, 30), "the engine was never held"
            await until(client, batch.id, lambda y: y.request_counts.completed > 0)
            leaving, staying = (alive, c) if owners[batch.id][-1] == alive.owner else (c, alive)
            await leaving.stop()
            eng.after = None
            eng.gate.set()
            await wait_until(lambda: owners[batch.id][-1] == staying.owner, timeout=20)
            await answered_once(client, await until(client, batch.id,
                                                    lambda y: y.status in FINAL), "u", 150)
        finally:
            eng.gate.set()
            for r in (a, b, c):
                if r is not None:
                    await r.stop()
            follower.cancel()
