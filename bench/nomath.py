"""A worker process around an encoder that does no math.

    TENSORBUS_MODEL=all-MiniLM-L6-v2 .venv/bin/python -m bench.nomath

The engine is the mock encoder (bench/support/mock_encoder.py) at the bundled
encoder's width, 384 (so replies weigh what real ones weigh): one-hot vectors after an
optional fixed time per batch and per token, spent sleeping on the engine thread. The
serving path is measured alone, or against a model whose cost is known exactly. The
process runs the real `services.worker.Worker` around it, so everything but the engine
is what production runs. Settings come from the environment:

  BENCH_SECONDS_PER_BATCH   fixed time of every engine call (default 0)
  BENCH_SECONDS_PER_TOKEN   added per input token of the batch (default 0)
"""

from __future__ import annotations

import asyncio
import os

from bench.support.mock_encoder import MockEncoder

DIM = 384  # all-MiniLM-L6-v2's output width


async def main() -> None:
    from services.worker.service import Worker
    from shared.bus import connection, stop_event
    from shared.config import Config
    from shared.logging import configure_logging

    config = Config.from_env()
    configure_logging("worker", config.log_level, config.log_format)
    engine = MockEncoder(config.model, dim=DIM, max_batch=config.max_batch,
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
    from bench import harness
    from services.lifecycle import run_loop
    from shared.config import Config

    harness.parser(__doc__).parse_args()  # settings come from the environment; --help
    run_loop(main(), Config.from_env().event_loop)
