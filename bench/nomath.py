"""An encoder that does no math, and a worker process around it.

    TENSORBUS_MODEL=all-MiniLM-L6-v2 .venv/bin/python -m bench.nomath

`NoMathEncoder` answers with 384-dim one-hot vectors (the bundled encoder's shape, so
replies weigh what real ones weigh) after an optional fixed time per batch and per
token, spent sleeping on the engine thread: the serving path is measured alone
(`--latency 0`), or against a model whose cost is known exactly. The process entry
runs the real `services.worker.Worker` around it, so everything but the engine is
what production runs. Settings come from the environment:

  BENCH_SECONDS_PER_BATCH   fixed time of every engine call (default 0)
  BENCH_SECONDS_PER_TOKEN   added per input token of the batch (default 0)
"""

from __future__ import annotations

import asyncio
import os
import threading
import time

import numpy as np


class NoMathEncoder:
    """Implements engine.interface.Encoder; cost = per_batch + per_token x tokens."""

    def __init__(self, name: str = "all-MiniLM-L6-v2", dim: int = 384, max_batch: int = 64,
                 per_batch_s: float = 0.0, per_token_s: float = 0.0) -> None:
        self.name = name
        self.dim = dim
        self.max_tokens = 256
        self.dtype = "float32"
        self.device = "none"
        self.devices = [self.device]
        self.max_batch = max_batch
        self.per_batch_s = per_batch_s
        self.per_token_s = per_token_s
        self.gate = threading.Event()  # cleared by a test to hold a batch
        self.gate.set()
        self.batches: list[int] = []  # inputs per engine call

    def warmup(self, progress: bool = True) -> int:
        return 0

    def embed(self, inputs: list[list[int]]) -> np.ndarray:
        self.gate.wait()
        cost = self.per_batch_s + self.per_token_s * sum(len(x) for x in inputs)
        if cost > 0:
            time.sleep(cost)
        self.batches.append(len(inputs))
        out = np.zeros((len(inputs), self.dim), np.float32)
        for i, ids in enumerate(inputs):
            out[i, sum(ids) % self.dim] = 1.0
        return out


async def main() -> None:
    from services.worker.service import Worker
    from shared.bus import connection, stop_event
    from shared.config import Config
    from shared.logging import configure_logging

    config = Config.from_env()
    configure_logging("worker", config.log_level, config.log_format)
    engine = NoMathEncoder(config.model, max_batch=config.max_batch,
                           per_batch_s=float(os.environ.get("BENCH_SECONDS_PER_BATCH", "0")),
                           per_token_s=float(os.environ.get("BENCH_SECONDS_PER_TOKEN", "0")))
    stop = stop_event()
    async with connection(config.nats_url, f"worker-{config.model}") as nc:
        worker = Worker(nc, config, engine)
        task = asyncio.create_task(worker.run())
        stopper = asyncio.create_task(stop.wait())
        await asyncio.wait({task, stopper}, return_when=asyncio.FIRST_COMPLETED)
        worker.stop()
        await task


if __name__ == "__main__":
    from services.lifecycle import run_loop
    from shared.config import Config

    run_loop(main(), Config.from_env().event_loop)
