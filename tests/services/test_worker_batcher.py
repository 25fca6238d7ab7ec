"""The encoder runner behind its narrow seam: LoadedModels in, an Outbox out, no NATS."""

from __future__ import annotations

import asyncio
import time
from concurrent.futures import ThreadPoolExecutor

from services.worker.batcher import EncoderRunner
from services.worker.versions import LoadedModels
from shared.messages import EmbedResult, EmbedWork
from tests.services.test_worker_runner import Recorder
from bench.support.mock_encoder import MockEncoder
from tests.support.stack import wait_until


class Counting(MockEncoder):
    """Keeps every input the engine was asked to embed."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[list[int]] = []

    def embed(self, inputs: list[list[int]]):
        self.seen += inputs
        return super().embed(inputs)


def work(rid: str, ids: list[int]) -> EmbedWork:
    return EmbedWork(rid, "all-MiniLM-L6-v2", "", [ids], time.time() + 30,
                     f"reply.{rid}", "sched")


async def test_a_request_cancelled_while_queued_is_never_computed_but_reported_done():
    engine = Counting()
    out = Recorder()
    runner = EncoderRunner(LoadedModels(engine, "1"), out, ThreadPoolExecutor(1),
                           max_batch=8, max_wait_s=0.0)
    task = asyncio.create_task(runner.run())
    try:
        engine.gate.clear()
        runner.submit(work("a", [1]))
        await asyncio.to_thread(engine.entered.wait, 5)  # "a" computes, held
        runner.submit(work("b", [2]))
        runner.submit(work("c", [3]))
        runner.cancel("b")  # queued behind "a"
        runner.cancel("a")  # computing: one engine call, it finishes
        assert runner.queue_depth == 1
        engine.gate.set()
        await wait_until(lambda: len(out.finished) == 3, timeout=5)
        await runner.drain()
    finally:
        task.cancel()
    assert engine.seen == [[1], [3]]  # "b" never reached the engine
    assert sorted(out.finished) == ["a", "b", "c"]  # its scheduler still hears it is done
    assert sorted(m.request_id for m in out.messages if isinstance(m, EmbedResult)) == ["a", "c"]
    assert out.errors == []
