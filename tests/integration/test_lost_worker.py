"""Streams survive a lost decoder worker: the worker serving some streams vanishes
mid-generation (no drain, no last word, its connection gone) and every stream still
ends with 200 and the same text an unbroken run gives, each token once, soon after
the loss: the scheduler tells the gateway, which resumes each stream from the last
token it delivered on the surviving worker. Sampled requests without a seed get one
drawn by the gateway, so they resume exactly too. A request whose workers keep
dying ends with a 500 at the re-dispatch cap.

Real nats-server, two workers on a tiny GPT-2 decoder built here; greedy answers
checked against transformers, sampled ones against the same request sent again,
unbroken, with the seed the gateway drew (read off the work sent to the workers)."""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import pytest

from engine.decoder import DecoderEngine
from shared import subjects
from shared.messages import GenerateWork, work_decoder
from tests.support.stack import running_stack, wait_until
from tests.support.tiny_models import hf_greedy, serve_tiny

CONTEXT = 256
NEW = 120
STREAMS = 8  # half greedy, half sampled without a seed
SLOTS = 8


def _prompt(i: int) -> list[int]:
    return [5 + i, 17, 200 + 11 * i, 42, 7]


@pytest.fixture(scope="module")
def decoder(tmp_path_factory, jax_cache_dir):
    path = tmp_path_factory.mktemp("lost-gpt2")
    model, engine = serve_tiny("gpt2", path, "tiny-lost", CONTEXT, slots=SLOTS)
    greedy = {i: engine.tokenizer.decode(hf_greedy(model, _prompt(i), NEW))
              for i in range(0, STREAMS, 2)}
    return engine, str(path), greedy


def _second(path: str) -> DecoderEngine:
    engine = DecoderEngine(path, name="tiny-lost", slots=SLOTS, max_context=CONTEXT,
                           prefill_buckets=(16, 64), compile_ahead="lazy")
    engine.warmup(progress=False)
    return engine


class Stream:
    """One streamed completion over HTTP: its text, chunk by chunk."""

    def __init__(self, body: dict) -> None:
        self.body = body
        self.chunks: list[str] = []
        self.status = 0
        self.error = None
        self.usage = None
        self.took = 0.0

    async def run(self, http: httpx.AsyncClient) -> Stream:
        t0 = time.monotonic()
        async with http.stream("POST", "/v1/completions", json=self.body) as r:
            self.status = r.status_code
            if r.status_code != 200:
                self.error = json.loads(await r.aread()).get("error")
                return self
            async for line in r.aiter_lines():
                if line.startswith("data: {"):
                    chunk = json.loads(line[6:])
                    if "error" in chunk:
                        self.error = chunk["error"]
                    elif chunk.get("usage"):
                        self.usage = chunk["usage"]
                    else:
                        self.chunks += [c["text"] for c in chunk["choices"] if c["text"]]
        self.took = time.monotonic() - t0
        return self

    @property
    def text(self) -> str:
        return "".join(self.chunks)


def _body(i: int, **extra) -> dict:
    body = {"model": "tiny-lost", "prompt": _prompt(i), "max_tokens": NEW, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}
    if i % 2 == 0:
        body["temperature"] = 0
    return {**body, **extra}  # odd: sampled (temperature 1.0, the default), no seed


async def _watch_work(nc, worker_ids) -> dict[str, list[GenerateWork]]:
    """Every GenerateWork each worker is sent (a copy: the test's own subscription)."""
    sent: dict[str, list[GenerateWork]] = {w: [] for w in worker_ids}

    def note(wid):
        async def cb(msg):
            work = work_decoder.decode(msg.data)
            if isinstance(work, GenerateWork):
                sent[wid].append(work)
        return cb

    for wid in worker_ids:
        await nc.subscribe(subjects.worker_work(wid), cb=note(wid))
    await nc.flush()
    return sent


async def _vanish(st, worker_id: str) -> None:
    """The worker dies as a killed process does: it stops where it is and its
    connection drops; nothing is drained and nothing more is said."""
    worker = st.workers[worker_id]
    st.kill_worker(worker_id)
    await worker.nc.close()


async def _round(http, bodies) -> list[Stream]:
    return await asyncio.gather(*(Stream(b).run(http) for b in bodies))


async def test_streams_follow_a_lost_worker_to_the_survivor(nats_server, decoder):
    engine, path, greedy = decoder
    async with running_stack(nats_server.url, models={engine.name: path}, max_context=CONTEXT,
                             decode_slots=SLOTS) as st:  # fmt: skip
        await st.add_worker(engine, "dec-a", kind="decoder")
        await st.add_worker(_second(path), "dec-b", kind="decoder")
        sent = await _watch_work(st.client, ["dec-a", "dec-b"])
        async with httpx.AsyncClient(base_url=st.http_url, timeout=120) as http:
            # Rounds with nothing lost: the first compiles shapes (a worker compiles
            # a batch size where first needed); the fastest of the next two is the base.
            times = []
            for _ in range(3):
                for ws in sent.values():
                    ws.clear()
                t0 = time.monotonic()
                unbroken = await _round(http, [_body(i) for i in range(STREAMS)])
                times.append(time.monotonic() - t0)
            base = min(times[1:])
            assert [(s.status, s.error) for s in unbroken] == [(200, None)] * STREAMS
            for i in range(0, STREAMS, 2):
                assert unbroken[i].text == greedy[i]
            # Every sampled request was sent with a seed the gateway drew.
            works = [w for ws in sent.values() for w in ws]
            assert all(w.sampling.seed is not None and w.resumes for w in works)
            for ws in sent.values():
                ws.clear()

            streams = [Stream(_body(i)) for i in range(STREAMS)]
            t0 = time.monotonic()
            tasks = [asyncio.create_task(s.run(http)) for s in streams]
            # The worker with more of them, once each of its streams has chunks out.
            await wait_until(lambda: sum(len(ws) for ws in sent.values()) == STREAMS)
            victim = max(sent, key=lambda w: len(sent[w]))
            mine = {w.request_id for w in sent[victim]}
            served = [s for s, w in zip(streams, _by_prompt(sent, streams)) if w in mine]
            await wait_until(lambda: all(len(s.chunks) >= 2 for s in served), timeout=60)
            assert all(not t.done() for t, s in zip(tasks, streams) if s in served), \
                "the victim's streams ended before it was killed: make them longer"
            await _vanish(st, victim)
            await asyncio.gather(*tasks)
            broken = time.monotonic() - t0

            assert st.scheduler.recovery.told >= len(served)
            assert st.gateway.front.resumed >= len(served)
            for i, s in enumerate(streams):
                assert s.status == 200 and s.error is None, (i, s.error)
                assert s.usage["completion_tokens"] == NEW, (i, s.usage)
                if i % 2 == 0:
                    assert s.text == greedy[i], i
            # Sampled ones: the same request with the seed the gateway drew, unbroken.
            seeds = {tuple(w.prompt): w.sampling.seed for ws in sent.values() for w in ws}
            again = await _round(http, [_body(i, seed=seeds[tuple(_prompt(i))])
                                        for i in range(1, STREAMS, 2)])
            for i, ref in zip(range(1, STREAMS, 2), again):
                assert ref.status == 200 and streams[i].text == ref.text, i
            # Within a bound of an unbroken round measured here (the loss is noticed
            # after the worker expiry, then the survivor carries both halves).
            print(f"lost-worker round {broken:.2f} s, unbroken {times} s")
            assert broken < 2 * base + 5, (broken, base)
            # Nothing ever went to the lost worker's requests again under their old ids.
            survivor = next(w for w in sent if w != victim)
            assert not {w.request_id for w in sent[survivor]} & mine


def _by_prompt(sent, streams) -> list[str]:
    """The request id each stream went out under (matched by its prompt)."""
    ids = {tuple(w.prompt): w.request_id for ws in sent.values() for w in ws}
    return [ids[tuple(s.body["prompt"])] for s in streams]


async def test_a_request_whose_workers_keep_dying_ends_at_the_cap(nats_server, decoder):
    engine, path, _ = decoder
    names = ["cap-0", "cap-1", "cap-2"]
    async with running_stack(nats_server.url, models={engine.name: path}, max_context=CONTEXT,
                             decode_slots=SLOTS, max_redispatch=1) as st:  # fmt: skip
        await st.add_worker(engine, names[0], kind="decoder")
        for name in names[1:]:
            await st.add_worker(_second(path), name, kind="decoder")
        sent = await _watch_work(st.client, names)
        async with httpx.AsyncClient(base_url=st.http_url, timeout=120) as http:
            stream = Stream(_body(0))
            task = asyncio.create_task(stream.run(http))
            for n in (1, 2):  # each worker that takes it dies under it, chunks out first
                await wait_until(lambda: sum(map(len, sent.values())) == n, timeout=60)
                victim = next(w for w in sent if len(sent[w]) == 1 and w in st.workers)
                await wait_until(lambda: stream.chunks and not task.done(), timeout=60)
                await _vanish(st, victim)
            await task
        assert stream.status == 200 and stream.error is not None  # the stream had started
        assert stream.error["code"] == "internal_error", stream.error
        assert "lost 2 times" in stream.error["message"]
        assert "TENSORBUS_MAX_REDISPATCH=1" in stream.error["message"]
        assert st.gateway.front.given_up == 1
        assert sum(map(len, sent.values())) == 2  # not sent a third time
