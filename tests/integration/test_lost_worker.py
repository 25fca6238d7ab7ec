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
            # Followed, not waited out: a stream left on the lost worker until its
            # stall timeout would end no sooner than that (then in 504). How fast the
            # survivor takes over is a figure, not a bound here: on two loaded cores
            # the same round took 13 s against 3.5 s unbroken, 1.6 s against 1.1 s quiet.
            print(f"lost-worker round {broken:.2f} s, unbroken {times} s")
            assert broken < st.config.stall_timeout_s, (broken, base)
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


# ------------------------------------------------------------- several choices
SEED = 4242  # the seeded requests' own


class Answer:
    """One request with several choices over HTTP, streamed or whole: each choice's
    text, its streamed pieces, its finish reason."""

    def __init__(self, body: dict, chat: bool = False) -> None:
        self.body, self.chat = body, chat
        n = body["n"]
        self.pieces: list[list[str]] = [[] for _ in range(n)]
        self.finish: list[str | None] = [None] * n
        self.status, self.error, self.usage = 0, None, None

    async def run(self, http: httpx.AsyncClient) -> Answer:
        path = "/v1/chat/completions" if self.chat else "/v1/completions"
        if not self.body.get("stream"):
            r = await http.post(path, json=self.body)
            got = r.json()
            self.status, self.error, self.usage = r.status_code, got.get("error"), got.get("usage")
            for c in got.get("choices", []):
                self.pieces[c["index"]] = [c["message"]["content"] if self.chat else c["text"]]
                self.finish[c["index"]] = c["finish_reason"]
            return self
        async with http.stream("POST", path, json=self.body) as r:
            self.status, held = r.status_code, b""
            if r.status_code != 200:
                self.error = json.loads(await r.aread()).get("error")
                return self
            async for data in r.aiter_bytes():  # events split on blank lines only: a
                *events, held = (held + data).split(b"\n\n")  # text may hold U+2028
                for event in events:
                    if event.startswith(b"data: {"):
                        self._take(json.loads(event[6:]))
        return self

    def _take(self, chunk: dict) -> None:
        self.error = chunk.get("error", self.error)
        self.usage = chunk.get("usage") or self.usage
        for c in chunk.get("choices", []):
            text = c["delta"].get("content") if self.chat else c["text"]
            if text:
                self.pieces[c["index"]].append(text)
            self.finish[c["index"]] = c["finish_reason"] or self.finish[c["index"]]

    @property
    def texts(self) -> list[str]:
        return ["".join(p) for p in self.pieces]


def _choices(i: int, n: int, stream: bool, chat: bool = False, **extra) -> dict:
    """Request i's body: prompt i (chat: its text), n choices of NEW tokens."""
    body = {"model": "tiny-lost", "max_tokens": NEW, "ignore_eos": True, "n": n,
            "stream": stream, **extra}
    if chat:
        body["messages"] = [{"role": "user", "content": f"tell me {i} things"}]
    else:
        body["prompt"] = _prompt(i)
    if stream:
        body["stream_options"] = {"include_usage": True}
    return body


def _stop_early(text: str, others: list[str]) -> str:
    """A stop string that ends `text` early and none of `others`."""
    for at in range(8, len(text) - 6):
        stop = text[at:at + 6]
        if stop.strip() and not any(stop in o for o in others):
            return stop
    raise AssertionError(f"no stop string ends {text!r} alone")


async def test_every_choice_follows_a_lost_worker(nats_server, decoder):
    """n = 2 or 3, streamed and whole, chat and completions, greedy, seeded and
    sampled without a seed: the worker generating them all vanishes mid-stream, with
    one choice already finished; each choice resumes from its own last token on the
    survivor, the finished one is not generated again, and every choice's text is the
    unbroken run's."""
    engine, path, greedy = decoder
    # Engines of their own: the module's engine may still hold the slots of a worker
    # an earlier test killed. The second is built ahead: it joins while the first
    # is generating.
    first, second = _second(path), _second(path)
    async with running_stack(nats_server.url, models={engine.name: path}, max_context=CONTEXT,
                             decode_slots=SLOTS) as st:  # fmt: skip
        await st.add_worker(first, "many-a", kind="decoder")
        sent = await _watch_work(st.client, ["many-a", "many-b"])
        async with httpx.AsyncClient(base_url=st.http_url, timeout=120) as http:
            # Seeded, three choices: a stop string that ends the first one early only.
            free = await Answer(_choices(2, 3, True, seed=SEED)).run(http)
            stop = _stop_early(free.texts[0], free.texts[1:])
            streamed = [  # 8 choices: every one in a slot at once
                (_choices(0, 2, True, temperature=0), False),  # greedy
                (_choices(1, 3, True, chat=True), True),  # sampled, no seed
                (_choices(2, 3, True, seed=SEED, stop=[stop]), False)]  # seeded, one ends early
            whole = [(_choices(3, 2, False), False),  # sampled, no seed
                     (_choices(4, 2, False, chat=True, temperature=0), True)]  # greedy
            # Unbroken references of the seeded and greedy ones (and shapes compiled).
            refs = await asyncio.gather(*(Answer(b, chat).run(http) for b, chat in streamed + whole))
            assert [(a.status, a.error) for a in refs] == [(200, None)] * 5
            assert refs[0].texts == [greedy[0]] * 2  # transformers' tokens
            assert refs[2].finish == ["stop", "length", "length"]
            for ws in sent.values():
                ws.clear()

            answers = [Answer(b, chat) for b, chat in streamed + whole]
            tasks = [asyncio.create_task(a.run(http)) for a in answers[:3]]
            await wait_until(lambda: len(sent["many-a"]) == 3)  # the streamed ones first
            tasks += [asyncio.create_task(a.run(http)) for a in answers[3:]]
            await wait_until(lambda: len(sent["many-a"]) == 5)
            await st.add_worker(second, "many-b", kind="decoder")
            seeded = answers[2]
            await wait_until(lambda: seeded.finish[0] == "stop" and all(
                len(p) >= 2 for a in answers[:3] for p, f in zip(a.pieces, a.finish) if not f),
                timeout=60)
            assert not any(t.done() for t in tasks[:3]), \
                "the streams ended before their worker was killed: make them longer"
            await _vanish(st, "many-a")
            await asyncio.gather(*tasks)

            assert st.scheduler.recovery.told == 5 and st.gateway.front.resumed == 5
            for i, a in enumerate(answers):
                assert a.status == 200 and a.error is None, (i, a.error)
            # Each went again to the survivor, every unfinished choice from its own
            # last token; the seeded request's finished choice was not sent again.
            lost = {w.request_id: w for w in sent["many-a"]}
            again = {w.request_id.rsplit("-r", 1)[0]: w for w in sent["many-b"]}
            assert set(again) == set(lost)
            seeded_id = next(r for r, w in lost.items() if w.stop)
            resumed = again[seeded_id]
            assert resumed.choices == [1, 2] and resumed.skips[0] > 0, resumed
            assert all(s > 0 for s in resumed.skips[1:]), resumed.skips
            assert resumed.sampling.seed == SEED
            for a, ref in zip(answers, refs):
                if a.body.get("temperature") == 0 or "seed" in a.body:
                    assert a.texts == ref.texts, a.body
                    assert a.usage == ref.usage, a.body  # finished choices counted too
            # Sampled without a seed: the same requests with the seeds drawn, unbroken.
            drawn = {(w.stream, w.n): w.sampling.seed for w in lost.values()
                     if w.sampling.temperature > 0 and not w.stop}
            for a, chat in ((answers[1], True), (answers[3], False)):
                seed = drawn[(a.body["stream"], a.body["n"])]
                ref = await Answer({**a.body, "seed": seed}, chat).run(http)
                assert ref.status == 200 and a.texts == ref.texts, a.body
                assert a.usage == ref.usage, a.body
