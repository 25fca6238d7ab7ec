"""Deadlines that fit generation, over a real nats-server and HTTP, with a metered
mock decoder (each decode step takes a permit the test hands out).

The default deadline bounds the wait for the first token; a generation producing
tokens runs to its end past it, and one that stops producing ends with a 504 that
says it stalled. Steps are counted, not timed: the only waits are for the clock to
pass a bound the request itself carries. A generation held for a cold start waits
out the start the scheduler measured, past the default deadline.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time

import httpx
import pytest

from services.worker.service import Worker
from tests.support.mock_engine import MockDecoder
from tests.support.stack import running_stack, wait_until

MODEL = "tensorbus-demo-lm"  # bundled: the gateway knows its tokenizer
MAX_TOKENS = 8
BODY = {"model": MODEL, "prompt": "the", "max_tokens": MAX_TOKENS, "temperature": 0}


class MeteredDecoder(MockDecoder):
    """A MockDecoder whose decode steps each take a permit from `permits`. With one
    permit out, a request gets exactly its first token to the gateway (its prompt's
    token, then the step dispatched behind it) and then waits."""

    def __init__(self) -> None:
        super().__init__(name=MODEL, slots=2)
        self.permits = threading.Semaphore(0)

    def step_async(self):
        self.permits.acquire()
        return super().step_async()


async def metered_stack(nats_url: str, **config):
    engine = MeteredDecoder()
    cm = running_stack(nats_url, **config)
    st = await cm.__aenter__()
    try:
        worker = await st.add_worker(engine, "metered", kind="decoder")
    except BaseException:
        engine.permits.release(10_000)
        await cm.__aexit__(None, None, None)
        raise
    return cm, st, engine, worker


async def close(cm, engine) -> None:
    engine.permits.release(10_000)  # nothing may wait on a permit at shutdown
    await cm.__aexit__(None, None, None)


async def first_token_then_pass(worker, bound: str, margin: float = 0.5) -> None:
    """The request's first token reached the worker's output, then the clock passed
    the request's own `bound` (its `deadline` or, for a stall, `stall_s` after it)."""
    await wait_until(lambda: worker.runner.generated >= 1, timeout=20)
    (req,) = worker.runner.requests.values()
    if bound == "deadline":
        until = req.work.deadline + margin
    else:
        until = req.last_token + req.work.stall_s + margin
    await wait_until(lambda: time.time() > until, timeout=60)


def sse(lines: list[str]) -> list[dict]:
    return [json.loads(line[6:]) for line in lines
            if line.startswith("data: ") and line != "data: [DONE]"]


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
async def test_a_generation_longer_than_the_default_deadline_completes(nats_server, stream):
    cm, st, engine, worker = await metered_stack(nats_server.url, request_timeout_s=2.0,
                                                 stall_timeout_s=30.0)
    try:
        engine.permits.release(1)
        async with httpx.AsyncClient(base_url=st.http_url, timeout=60) as h:
            if not stream:
                call = asyncio.create_task(h.post("/v1/completions", json=BODY))
                await first_token_then_pass(worker, "deadline")
                engine.permits.release(10 * MAX_TOKENS)
                r = await call
                assert r.status_code == 200, r.text
                choice = r.json()["choices"][0]
                assert (choice["text"], choice["finish_reason"]) == ("a" * MAX_TOKENS, "length")
                assert r.json()["usage"]["completion_tokens"] == MAX_TOKENS
            else:
                lines = []
                async with h.stream("POST", "/v1/completions", json={**BODY, "stream": True}) as r:
                    assert r.status_code == 200
                    it = r.aiter_lines()
                    async for line in it:
                        lines.append(line)
                        if line.startswith("data: {"):
                            break  # the first token is here; the deadline passes next
                    await first_token_then_pass(worker, "deadline")
                    engine.permits.release(10 * MAX_TOKENS)
                    lines += [line async for line in it]
                chunks = sse(lines)
                assert not any("error" in c for c in chunks), chunks
                assert "".join(c["choices"][0]["text"] for c in chunks) == "a" * MAX_TOKENS
                assert chunks[-1]["choices"][0]["finish_reason"] == "length"
                assert [line for line in lines if line][-1] == "data: [DONE]"
        assert worker.runner.generated == MAX_TOKENS
    finally:
        await close(cm, engine)


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
async def test_a_stalled_generation_ends_with_a_504_that_says_so(nats_server, stream):
    cm, st, engine, worker = await metered_stack(nats_server.url, request_timeout_s=30.0,
                                                 stall_timeout_s=1.0)
    try:
        engine.permits.release(1)
        t0 = time.monotonic()
        async with httpx.AsyncClient(base_url=st.http_url, timeout=60) as h:
            if not stream:
                r = await h.post("/v1/completions", json=BODY)
                assert r.status_code == 504, r.text
                error = r.json()["error"]
            else:
                async with h.stream("POST", "/v1/completions", json={**BODY, "stream": True}) as r:
                    assert r.status_code == 200  # started with the first token
                    lines = [line async for line in r.aiter_lines()]
                chunks = sse(lines)
                assert chunks[0]["choices"][0]["text"] == "a"
                error = chunks[-1]["error"]
                assert [line for line in lines if line][-1] == "data: [DONE]"
        assert error["code"] == "deadline_exceeded" and "stalled" in error["message"]
        assert time.monotonic() - t0 < 20  # the stall timeout ended it, not the 30 s deadline
        # The gateway's Cancel frees the worker's slot once its step may go on.
        engine.permits.release(10 * MAX_TOKENS)
        await wait_until(lambda: worker.runner.in_flight == 0 and not worker.runner.requests,
                         timeout=10)
        assert engine.stats().active == 0
        assert worker.runner.generated < MAX_TOKENS
    finally:
        await close(cm, engine)


async def test_a_generation_ends_at_the_operators_maximum_time_with_a_504_that_says_so(nats_server):
    cm, st, engine, worker = await metered_stack(nats_server.url, request_timeout_s=1.0,
                                                 stall_timeout_s=30.0, max_generation_s=2.0)
    try:
        engine.permits.release(1)
        async with httpx.AsyncClient(base_url=st.http_url, timeout=60) as h:
            r = await h.post("/v1/completions", json=BODY)  # a first token, then no more
        assert r.status_code == 504, r.text
        error = r.json()["error"]
        assert error["code"] == "deadline_exceeded" and "maximum time" in error["message"]
        engine.permits.release(10 * MAX_TOKENS)
        await wait_until(lambda: worker.runner.in_flight == 0 and not worker.runner.requests,
                         timeout=10)
    finally:
        await close(cm, engine)


async def test_a_held_generation_waits_out_the_models_measured_cold_start(nats_server):
    """A model whose worker took 5 s to start: a generation held for it waits that
    out (within its maximum time), past a default deadline of 1 s."""
    async with running_stack(nats_server.url, request_timeout_s=1.0, min_workers=0,
                             idle_to_zero_s=30.0) as st:
        warm = asyncio.Event()
        born: list[float] = []  # the worker's own clock (its start is timed from it)

        class SlowStart(Worker):
            async def warmup(self) -> None:
                born.append(self._born)
                await warm.wait()
                await super().warmup()

        starting = asyncio.create_task(st.add_worker(
            MockDecoder(name=MODEL), "slow", kind="decoder", worker_cls=SlowStart))
        await wait_until(lambda: born and time.perf_counter() - born[0] > 5.0, timeout=30)
        warm.set()
        await starting
        await wait_until(lambda: st.scheduler.holds.start_s.get(MODEL, 0.0) >= 5.0, timeout=5)
        st.kill_worker("slow")  # the model is at zero again
        await wait_until(lambda: not st.scheduler.fleet.available(MODEL), timeout=10)

        async with httpx.AsyncClient(base_url=st.http_url, timeout=60) as h:
            sent = time.monotonic()
            call = asyncio.create_task(h.post("/v1/completions", json=BODY))
            await wait_until(lambda: st.scheduler.holds.count(MODEL) == 1, timeout=10)
            await wait_until(lambda: time.monotonic() - sent > 2.5, timeout=10)
            assert not call.done()  # 1.5 s past its default deadline, still held
            await st.add_worker(MockDecoder(name=MODEL), "fast", kind="decoder")
            r = await call
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["completion_tokens"] == MAX_TOKENS
