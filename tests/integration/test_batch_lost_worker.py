"""A 1,000-line batch survives a lost worker: the Batch API driven by the unchanged
`openai` client (`files.create`, `batches.create`, `batches.retrieve` polled,
`files.content`), the batch runner (`services.batch.runner.BatchRunner`, on its own
connection), a real nats-server, gateway and scheduler, and the hand-checkable mock
encoder as the model.

The only worker holds its engine after a few hundred inputs, with lines of the batch
in its queue, and vanishes as a killed process does (no drain, no last word, its
connection gone); once the scheduler has sent its work on again, a replacement
worker comes. The batch completes with every custom_id answered exactly once (the
output file holds each once, the error file none, nothing missing), in input order,
each line in OpenAI's output shape (`id` `batch_req_...`, `custom_id`, `response`
with `status_code`, `request_id` and the embeddings body, `error` null), and each
body is its own line's answer (the mock's one-hot row names the input's token).
Every wait is on a condition.
"""

from __future__ import annotations

import asyncio
import json
import threading

import openai
import pytest

from bench.support.mock_encoder import MockEncoder
from services.batch.runner import BatchRunner
from tests.support.batches import until
from tests.support.bus import connect as bus_connect
from tests.support.stack import running_stack, wait_until

MODEL = "all-MiniLM-L6-v2"
LINES = 1000
DIM = 64  # the mock's row is one-hot at (sum of the input's ids) % DIM
FIRST = 1000  # line i's input is the single token FIRST + i
FRAME = 101 + 102  # the gateway frames a token input with MiniLM's [CLS] and [SEP]
STALL_AFTER = 400  # inputs the first worker computes before it is held


class Stalling(MockEncoder):
    """The mock encoder, held for good once it has computed `after` inputs."""

    def __init__(self, after: int | None = None) -> None:
        super().__init__(dim=DIM, max_batch=8)
        self.after = after
        self.computed = 0
        self.held = threading.Event()

    def embed(self, inputs):
        if self.after is not None and self.computed >= self.after:
            self.gate.clear()
            self.held.set()
        out = super().embed(inputs)  # waits at the gate
        self.computed += len(inputs)
        return out


def embed_line(i: int) -> dict:
    return {"custom_id": f"line-{i}", "method": "POST", "url": "/v1/embeddings",
            "body": {"model": MODEL, "input": [FIRST + i]}}




async def vanish(st, worker_id: str) -> None:
    """Gone as a killed process is: its task stops where it is, its connection drops."""
    worker = st.workers[worker_id]
    st.kill_worker(worker_id)
    await worker.nc.close()


@pytest.mark.timeout(120)
async def test_a_batch_answers_every_line_once_across_a_lost_worker(nats_server):
    first = Stalling(after=STALL_AFTER)
    async with running_stack(nats_server.url, max_batch=8, batch_concurrency=16) as st:
        await st.add_worker(first, "enc-first")
        rnc = await bus_connect(nats_server.url, name="batch-runner")
        runner = BatchRunner(rnc, st.config)
        running = asyncio.create_task(runner.run())
        client = openai.AsyncOpenAI(base_url=st.http_url + "/v1", api_key="none",
                                    max_retries=0)
        try:
            data = b"".join(json.dumps(embed_line(i)).encode() + b"\n" for i in range(LINES))
            f = await client.files.create(file=("input.jsonl", data), purpose="batch")
            batch = await client.batches.create(input_file_id=f.id, endpoint="/v1/embeddings",
                                                completion_window="24h")

            # Held mid-way, with lines of the batch dispatched to it.
            assert await asyncio.to_thread(first.held.wait, 60), "the worker was never held"
            sched = st.scheduler
            await wait_until(lambda: any(o.worker_id == "enc-first"
                                         for o in sched.outstanding.values()))
            mid = await until(client, batch.id, lambda b: b.request_counts.completed > 0)
            assert mid.status == "in_progress", mid
            assert mid.request_counts.completed < LINES, mid.request_counts
            await vanish(st, "enc-first")
            # Its work is sent on (held: no worker serves the model now), then one comes.
            await wait_until(lambda: sched.recovery.redispatched >= 1, timeout=30)
            second = Stalling()
            await st.add_worker(second, "enc-second")

            done = await until(client, batch.id,
                               lambda b: b.status in ("completed", "failed", "cancelled",
                                                      "expired"), timeout=90)
            assert done.status == "completed", done
            counts = done.request_counts
            assert (counts.total, counts.completed, counts.failed) == (LINES, LINES, 0)
            assert done.error_file_id is None and second.computed > 0

            raw = (await client.files.content(done.output_file_id)).content
            out = [json.loads(x) for x in raw.splitlines() if x.strip()]
            # Each custom_id exactly once, none missing, in input order.
            assert [x["custom_id"] for x in out] == [f"line-{i}" for i in range(LINES)]
            assert len({x["id"] for x in out}) == LINES
            assert len({x["response"]["request_id"] for x in out}) == LINES
            for i, x in enumerate(out):
                assert set(x) == {"id", "custom_id", "response", "error"}, x
                assert x["id"].startswith("batch_req_") and x["error"] is None
                assert x["response"]["status_code"] == 200
                body = x["response"]["body"]
                assert body["object"] == "list" and body["model"] == MODEL
                (row,) = body["data"]
                vec = row["embedding"]
                assert len(vec) == DIM and vec.index(max(vec)) == (FRAME + FIRST + i) % DIM, i
        finally:
            runner.stop()
            await asyncio.gather(running, return_exceptions=True)
            await rnc.close()
