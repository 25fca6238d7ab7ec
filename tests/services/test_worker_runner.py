"""The decoder runner behind its narrow seam: LoadedModels in, an Outbox out, no NATS.

MockDecoder versions generate their own letter ("a" for version 1, "b" for 2), so a
choice's text says which engine produced it and the chunk's `version` is checked
against it."""

from __future__ import annotations

import asyncio
import time
from contextlib import asynccontextmanager
from concurrent.futures import ThreadPoolExecutor

from services.worker.generation import DecoderRunner
from services.worker.versions import LoadedModels
from shared.messages import GenChunk, GenDone, GenerateWork, Sampling
from tests.support.mock_engine import MockDecoder
from tests.support.stack import wait_until


class Recorder:
    """An Outbox that keeps what the runner says."""

    worker_id, model = "w-test", "mock-lm"
    max_payload = 1 << 20  # what the bus carries in one message

    def __init__(self) -> None:
        self.messages: list = []
        self.errors: list = []
        self.finished: list[str] = []

    async def publish(self, work, message) -> None:
        self.messages.append(message)

    @asynccontextmanager
    async def held(self):
        yield

    async def error(self, work, err, version: str = "") -> None:
        self.errors.append((work.request_id, err.status))

    async def done(self, done: dict[str, list[str]], compute_s: float = 0.0, tokens: int = 0) -> None:
        for ids in done.values():
            self.finished += ids

    async def refuse(self, work, err) -> None:
        await self.error(work, err)
        await self.done({work.sched_id: [work.request_id]})

    def texts(self, rid: str) -> dict[int, tuple[str, set[str]]]:
        """choice -> (its text, the versions its chunks named)."""
        out: dict[int, tuple[str, set[str]]] = {}
        for m in self.messages:
            if isinstance(m, GenChunk) and m.request_id == rid:
                text, versions = out.get(m.index, ("", set()))
                out[m.index] = (text + m.text, versions | {m.version})
        return out

    def done_version(self, rid: str) -> str:
        return next(m.version for m in self.messages
                    if isinstance(m, GenDone) and m.request_id == rid)


def work(rid: str, n: int = 1, max_tokens: int = 3, version: str = "") -> GenerateWork:
    return GenerateWork(rid, "mock-lm", version, [3, 4], max_tokens, Sampling(temperature=0),
                        [], n, True, time.time() + 30, f"reply.{rid}", "sched")


async def test_a_request_finishes_on_its_version_and_the_old_lane_goes_when_unused():
    v1, v2 = MockDecoder(tag=0, slots=1), MockDecoder(tag=1, slots=1)
    models = LoadedModels(v1, "1", kind="decoder")
    out = Recorder()
    runner = DecoderRunner(models, out, ThreadPoolExecutor(1), prefill_per_step=4)
    task = asyncio.create_task(runner.run())
    try:
        v1.gate.clear()
        runner.submit(work("a", n=2))  # one slot: choice 1 waits for choice 0
        await asyncio.to_thread(v1.entered.wait, 5)  # a decode step of v1 is held
        unused = asyncio.create_task(runner.wait_unused("1"))
        models.switch("2", "", {"2": v2})  # promote: "1" is named by nothing now
        assert set(runner.lanes) == {"1", "2"} and runner.uses("1")
        runner.submit(work("b"))
        v1.gate.set()
        await wait_until(lambda: {"a", "b"} <= set(out.finished), timeout=5)
        # Both choices of "a" ran on version 1 (the second was admitted after the
        # switch); "b", sent after it, ran on version 2. Every chunk says so.
        assert out.texts("a") == {0: ("aaa", {"1"}), 1: ("aaa", {"1"})}
        assert out.texts("b") == {0: ("bbb", {"2"})}
        assert (out.done_version("a"), out.done_version("b")) == ("1", "2")
        await asyncio.wait_for(unused, 5)
        assert not runner.uses("1") and out.errors == []
        models.drop("1")
        assert set(runner.lanes) == {"2"}  # the lane followed the drop: no engine kept
        load = runner.gauges()
        assert (load.max_batch, load.in_flight, load.queue_depth) == (1, 0, 0)
    finally:
        task.cancel()


async def test_prod_and_canary_run_side_by_side_each_with_its_own_slots():
    v1, v2 = MockDecoder(tag=0, slots=2), MockDecoder(tag=1, slots=2)
    models = LoadedModels(kind="decoder")
    models.switch("1", "2", {"1": v1, "2": v2})
    out = Recorder()
    runner = DecoderRunner(models, out, ThreadPoolExecutor(1), prefill_per_step=8)
    task = asyncio.create_task(runner.run())
    try:
        for i in range(4):  # unpinned: prod; pinned: the canary
            runner.submit(work(f"p{i}", max_tokens=4))
            runner.submit(work(f"c{i}", max_tokens=4, version="2"))
        await wait_until(lambda: len(out.finished) == 8, timeout=5)
        for i in range(4):
            assert out.texts(f"p{i}") == {0: ("aaaa", {"1"})}
            assert out.texts(f"c{i}") == {0: ("bbbb", {"2"})}
        assert runner.gauges().max_batch == 4  # prod's slots and the canary's
    finally:
        task.cancel()


async def _one_request_in_a_step():
    """A running runner on one version, request "a" (4 tokens) held inside a decode
    step until the engine's gate opens: (engine, outbox, runner, its task)."""
    v1 = MockDecoder(tag=0, slots=2)
    out = Recorder()
    runner = DecoderRunner(LoadedModels(v1, "1", kind="decoder"), out, ThreadPoolExecutor(1),
                           prefill_per_step=4)
    task = asyncio.create_task(runner.run())
    v1.gate.clear()
    runner.submit(work("a", max_tokens=4))
    await asyncio.to_thread(v1.entered.wait, 5)  # "a" is in a decode step
    return v1, out, runner, task


async def test_work_sent_again_while_it_runs_is_answered_once_and_the_runner_lives():
    """A scheduler that judged the worker stalled (a long compile, say) re-sends the
    work it had sent: the copy is ignored, the first one finishes, and the runner
    keeps serving (the copy once ended the runner on a token of an unknown request)."""
    v1, out, runner, task = await _one_request_in_a_step()
    try:
        runner.submit(work("a", max_tokens=4))  # the same request, re-dispatched
        v1.gate.set()
        await wait_until(lambda: "a" in out.finished, timeout=5)
        runner.submit(work("b"))
        await wait_until(lambda: "b" in out.finished, timeout=5)
        assert out.texts("a") == {0: ("aaaa", {"1"})} and out.texts("b") == {0: ("aaa", {"1"})}
        assert out.finished.count("a") == 1 and not task.done()
    finally:
        task.cancel()


async def test_drain_answers_what_is_held_and_then_the_loop_ends():
    """A stopping worker drains its runner: the request in a step finishes whole, and
    the runner's loop then returns by itself (the worker's task group can close)."""
    v1, out, runner, task = await _one_request_in_a_step()
    try:
        drained = asyncio.create_task(runner.drain())
        v1.gate.set()
        await asyncio.wait_for(drained, 5)
        assert out.texts("a") == {0: ("aaaa", {"1"})} and out.finished == ["a"]
        await asyncio.wait_for(task, 5)  # the loop ended: no cancel needed
    finally:
        task.cancel()
