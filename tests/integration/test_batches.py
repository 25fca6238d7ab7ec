"""OpenAI's Files and Batch API through the whole stack: a real nats-server, gateway,
scheduler, a SmolLM2-135M-Instruct decoder worker and a MiniLM encoder worker, and the
batch runner as its own process (`python -m services.batch`), driven by the unchanged
`openai` client.

- A chat completions batch and an embeddings batch, run side by side, complete: one
  output line per custom_id, each body the one the same request gets sent
  interactively (greedy text equal, vectors within 1e-6); a line naming an unknown
  model lands in the error file; request_counts add up.
- The runner killed (SIGKILL) mid-batch and started again: every custom_id answered
  exactly once.
- Cancelled mid-way: `cancelled`, with the lines done so far.
- A bad line, a duplicate custom_id or a line whose url is not the batch's endpoint
  fails the batch in validation, by line (OpenAI's `invalid_url` for the last); a
  wrong endpoint is a 400 at creation.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys
import time
from pathlib import Path

import httpx
import numpy as np
import openai
import pytest
import pytest_asyncio

from shared import catalog
from tests.support.batches import until
from tests.support.stack import running_stack

MODEL = catalog.SMOLLM2
ENCODER = catalog.ENCODER
CONTEXT = 256
PREFILL = 128
REPO = Path(__file__).resolve().parents[2]
READY = "tensorbus.v1.svc.tensorbus-batch.ready"
QUESTIONS = ["What is the capital of France?", "Name a primary colour.", "What is 2 + 2?",
             "Say hello in Spanish.", "Name a planet.", "What do bees make?",
             "Name a fruit that is yellow.", "What is the opposite of hot?",
             "How many legs does a spider have?", "What colour is the sky?"]


@pytest.fixture(scope="module")
def engine(smollm2_dir, jax_cache_dir):
    from engine.decoder import DecoderEngine

    engine = DecoderEngine(smollm2_dir, MODEL, slots=2, max_context=CONTEXT,
                           prefill_buckets=(PREFILL,), decode_windows=(), compile_ahead="all",
                           quant="gguf", quant_form="kernel")  # fmt: skip
    engine.warmup(progress=False)
    return engine


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def stack(nats_server, engine, minilm, smollm2_dir):
    async with running_stack(nats_server.url, models={MODEL: str(smollm2_dir)},
                             max_context=CONTEXT, decode_slots=2) as st:
        await st.add_worker(engine, "dec-batches", kind="decoder")
        await st.add_worker(minilm, "enc-batches")
        yield st


class Runner:
    """The batch runner as a process of its own, on the stack's nats-server."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.proc: asyncio.subprocess.Process | None = None

    async def start(self, nc) -> None:
        env = {**os.environ, "TENSORBUS_NATS_URL": self.url, "TENSORBUS_LOG_LEVEL": "warning",
               "TENSORBUS_BATCH_CONCURRENCY": "2", "TENSORBUS_EVENT_LOOP": "asyncio"}
        self.proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "services.batch", cwd=REPO, env=env)
        end = time.monotonic() + 30
        while True:  # ready when its own probe says so
            assert self.proc.returncode is None, "the batch runner exited"
            try:
                msg = await nc.request(READY, b"", timeout=1)
                if not (msg.headers or {}).get("Nats-Service-Error-Code"):
                    return
            except Exception:  # noqa: BLE001 - not subscribed yet
                pass
            assert time.monotonic() < end, "the batch runner did not get ready"
            await asyncio.sleep(0.1)

    async def kill(self) -> None:
        self.proc.send_signal(signal.SIGKILL)
        await self.proc.wait()

    async def stop(self) -> None:
        if self.proc and self.proc.returncode is None:
            self.proc.terminate()
            await asyncio.wait_for(self.proc.wait(), 15)


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def runner(stack, nats_server):
    r = Runner(nats_server.url)
    await r.start(stack.client)
    yield r
    await r.stop()


@pytest.fixture
def client(stack):
    return openai.AsyncOpenAI(base_url=stack.http_url + "/v1", api_key="none", max_retries=0)


def chat_line(cid: str, question: str, max_tokens: int = 8) -> dict:
    return {"custom_id": cid, "method": "POST", "url": "/v1/chat/completions",
            "body": {"model": MODEL, "temperature": 0, "max_tokens": max_tokens,
                     "messages": [{"role": "user", "content": question}]}}


def embed_line(cid: str, text: str) -> dict:
    return {"custom_id": cid, "method": "POST", "url": "/v1/embeddings",
            "body": {"model": ENCODER, "input": text}}


def jsonl(lines: list[dict]) -> bytes:
    return b"".join(json.dumps(x).encode() + b"\n" for x in lines)


async def submit(client, lines: list[dict], endpoint: str = "/v1/chat/completions"):
    f = await client.files.create(file=("input.jsonl", jsonl(lines)), purpose="batch")
    return await client.batches.create(input_file_id=f.id, endpoint=endpoint,
                                       completion_window="24h", metadata={"test": "batches"})




def final(b) -> bool:
    return b.status in ("completed", "failed", "cancelled", "expired")


async def lines_of(client, file_id: str | None) -> dict[str, dict]:
    if file_id is None:
        return {}
    raw = (await client.files.content(file_id)).content
    out = [json.loads(x) for x in raw.splitlines() if x.strip()]
    by_id = {x["custom_id"]: x for x in out}
    assert len(by_id) == len(out), "a custom_id answered twice"
    return by_id


async def test_batches_answer_each_line_as_the_interactive_request(stack, runner, client):
    chats = [chat_line(f"chat-{i}", q) for i, q in enumerate(QUESTIONS)]
    chats.insert(5, chat_line("unknown-model", "hi") | {
        "body": {"model": "no-such-model", "messages": [{"role": "user", "content": "hi"}]}})
    embeds = [embed_line(f"emb-{i}", f"sentence number {i} about {q}")
              for i, q in enumerate(QUESTIONS[:8])]
    assert len(chats) + len(embeds) == 19

    batch, other = await asyncio.gather(submit(client, chats),
                                        submit(client, embeds, "/v1/embeddings"))
    assert batch.id.startswith("batch_") and batch.object == "batch"
    assert batch.status == "validating" and batch.metadata == {"test": "batches"}
    assert batch.completion_window == "24h" and batch.expires_at == batch.created_at + 86400
    done, embedded = await asyncio.gather(until(client, batch.id, final, timeout=120),
                                          until(client, other.id, final, timeout=120))
    assert done.status == "completed" and embedded.status == "completed", (done, embedded)
    assert (done.request_counts.total, done.request_counts.completed,
            done.request_counts.failed) == (11, 10, 1)
    assert (embedded.request_counts.total, embedded.request_counts.completed,
            embedded.request_counts.failed) == (8, 8, 0)
    assert done.in_progress_at and done.finalizing_at and done.completed_at

    out = await lines_of(client, done.output_file_id)
    errs = await lines_of(client, done.error_file_id)
    assert set(out) == {x["custom_id"] for x in chats} - {"unknown-model"}
    assert list(out) == [x["custom_id"] for x in chats if x["custom_id"] in out]  # input order
    (err,) = errs.values()
    assert err["custom_id"] == "unknown-model" and err["response"]["status_code"] == 404
    assert err["response"]["body"]["error"]["code"] == "model_not_found"
    assert embedded.error_file_id is None
    out |= await lines_of(client, embedded.output_file_id)

    async with httpx.AsyncClient(base_url=stack.http_url, timeout=120) as http:
        for line in chats + embeds:
            got = out.get(line["custom_id"])
            if got is None:
                continue
            assert got["id"].startswith("batch_req_") and got["error"] is None
            assert got["response"]["status_code"] == 200 and got["response"]["request_id"]
            want = (await http.post(line["url"], json=line["body"])).json()
            body = got["response"]["body"]
            if line["url"] == "/v1/embeddings":
                np.testing.assert_allclose(body["data"][0]["embedding"],
                                           want["data"][0]["embedding"], atol=1e-6)
            else:
                assert body["choices"][0]["message"]["content"] == \
                    want["choices"][0]["message"]["content"], line["custom_id"]
                assert body["usage"] == want["usage"]

    listed = await client.batches.list(limit=100)
    assert batch.id in [b.id for b in listed.data]
    meta = await client.files.retrieve(done.output_file_id)
    assert meta.purpose == "batch_output" and meta.bytes > 0


async def test_a_runner_killed_mid_batch_answers_every_line_exactly_once(stack, runner,
                                                                         client):
    lines = [chat_line(f"r-{i}", QUESTIONS[i % 10] + " " * (i // 10), max_tokens=12)
             for i in range(12)]
    batch = await submit(client, lines)
    await until(client, batch.id, lambda b: final(b) or b.request_counts.completed >= 5)
    await runner.kill()
    mid = await client.batches.retrieve(batch.id)
    assert mid.status == "in_progress", "the batch finished before the runner was killed"
    await runner.start(stack.client)
    done = await until(client, batch.id, final, timeout=120)
    assert done.status == "completed" and done.request_counts.completed == 12
    assert done.request_counts.failed == 0 and done.error_file_id is None
    out = await lines_of(client, done.output_file_id)
    assert list(out) == [x["custom_id"] for x in lines]


async def test_a_cancelled_batch_keeps_what_was_done(stack, runner, client):
    lines = [chat_line(f"c-{i}", QUESTIONS[i % 10], max_tokens=16) for i in range(16)]
    batch = await submit(client, lines)
    await until(client, batch.id, lambda b: final(b) or b.request_counts.completed >= 2)
    cancelling = await client.batches.cancel(batch.id)
    assert cancelling.status == "cancelling" and cancelling.cancelling_at
    done = await until(client, batch.id, final)
    assert done.status == "cancelled" and done.cancelled_at
    out = await lines_of(client, done.output_file_id)
    assert 2 <= len(out) < 16 and done.request_counts.completed == len(out)
    assert done.request_counts.total == 16
    with pytest.raises(openai.BadRequestError):
        await client.batches.cancel((await submit_done(client)).id)


async def submit_done(client):
    """A batch that failed validation: final, so it cannot be cancelled."""
    batch = await submit(client, [{"custom_id": "x"}])
    return await until(client, batch.id, final)


async def test_bad_input_fails_validation_by_line(stack, runner, client):
    lines = [chat_line("a", "hi"), chat_line("b", "hi"), chat_line("a", "again")]
    data = jsonl(lines[:2]) + b"{not json\n" + jsonl(lines[2:])
    f = await client.files.create(file=("bad.jsonl", data), purpose="batch")
    assert f.object == "file" and f.bytes == len(data) and f.purpose == "batch"
    assert (await client.files.content(f.id)).content == data
    batch = await client.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions",
                                        completion_window="24h")
    done = await until(client, batch.id, final)
    assert done.status == "failed" and done.failed_at and done.output_file_id is None
    assert [(e.line, e.code) for e in done.errors.data] == [
        (3, "invalid_json_line"), (4, "duplicate_custom_id")]
    assert done.request_counts.total == 0

    # every line on the batch's endpoint, as OpenAI requires: the others named by line
    mixed = await submit(client, [chat_line("c", "hi"), embed_line("e", "hi"),
                                  chat_line("d", "hi")])
    failed = await until(client, mixed.id, final)
    assert failed.status == "failed" and failed.request_counts.total == 0
    assert [(e.line, e.code, e.param) for e in failed.errors.data] == [(2, "invalid_url", "url")]
    assert "/v1/embeddings" in failed.errors.data[0].message
    assert "/v1/chat/completions" in failed.errors.data[0].message

    with pytest.raises(openai.BadRequestError, match="endpoint"):
        await client.batches.create(input_file_id=f.id, endpoint="/v1/responses",
                                    completion_window="24h")
    with pytest.raises(openai.BadRequestError, match="input_file_id"):
        await client.batches.create(input_file_id="file-nope", endpoint="/v1/embeddings",
                                    completion_window="24h")
    deleted = await client.files.delete(f.id)
    assert deleted.deleted and deleted.id == f.id
    with pytest.raises(openai.NotFoundError):
        await client.files.retrieve(f.id)
    with pytest.raises(openai.NotFoundError):
        await client.batches.retrieve("batch_nope")
