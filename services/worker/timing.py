"""An engine's cost, timed once at a worker's warm-up (before its first request), so
that a fresh scheduler admits a first burst by its work: `time_encoder` for an
encoder's batches, `time_decoder` for a decoder's prompts and steps. Each probe runs
TRIES times and the fastest counts."""

from __future__ import annotations

import time
from typing import cast

from services.worker.batcher import run_encoder
from shared.costs import Cost, CostBook, GenCost
from shared.logging import get_logger
from shared.messages import Sampling

log = get_logger("worker")

PROBE_TOKENS = (16, 64)  # tokens per input of the two batches timed at warm-up: two
# sizes, so the fit tells a batch's fixed cost from its cost per token
TRIES = 2  # each probe (encoder batch, decoder prompt) timed this often, the fastest
# counting: a shared machine's stalls, background compiles and compiles where first
# needed only ever add time (one stalled encoder probe skewed its two-point fit so far
# that a worker under load refused half of a burst it could serve)


def _fastest(run, tries: int = TRIES) -> float:
    """The shortest of `tries` timed calls of `run()`, in seconds."""
    best = float("inf")
    for _ in range(tries):
        t0 = time.perf_counter()
        run()
        best = min(best, time.perf_counter() - t0)
    return best


def time_encoder(engine, max_batch: int) -> Cost | None:
    """An encoder's engine time (`shared.costs.Cost`), from two full batches of
    the runner (`max_batch` inputs, one engine call each, as `WorkDone` reports a
    batch) timed after its warm-up; None if it failed. Before it, a fresh scheduler
    knew no cost until the first batches finished, and refused a first burst by a
    count of batches (short requests: 144 of 400 at two workers)."""
    batch = max(1, max_batch)
    book = CostBook()
    try:
        run_encoder(engine, [[1] * PROBE_TOKENS[0]])  # untimed: whatever a first call costs
        for n in PROBE_TOKENS:
            n = min(n, engine.max_tokens)
            inputs = [[1] * n for _ in range(batch)]
            book.observe("probe", _fastest(lambda: run_encoder(engine, inputs)), batch * n)
    except Exception as exc:  # noqa: BLE001 - a broken engine fails its requests, not its start
        log.warning("warmup_timing_failed", error=f"{type(exc).__name__}: {exc}")
        return None
    return book.cost("probe")


DECODE_PROBE = 1  # the short prompt a decoder times at warm-up; the long one is a whole
# chunk (128 tokens on a CPU, 0.3 s, so TRIES of it cost less than one 512 did): far apart, so the fit finds the cost per token, and the two prompt shapes a
# warm-up compiles first (a 96-token probe ran on the chunk's program while the smaller
# ones compiled: about 5x the cost per token it has later, and a first minute of 429s)
DECODE_STEPS = 3  # decode steps timed at warm-up (the fastest counts: one stream's step)


def _no_victim(holders: list[int]) -> int:
    raise RuntimeError("one timed sequence found the KV pool full")


def time_decoder(engine, chunk: int) -> GenCost | None:
    """A decoder's engine time (`shared.costs.GenCost`) after its warm-up:
    prompts of DECODE_PROBE tokens and of a whole chunk computed in one slot (per
    chunk and per prompt token), then DECODE_STEPS decode steps of one sequence, at
    the batch bucket the warm-up compiled first. One sequence cannot tell a step's fixed
    cost from its cost per sequence: it counts as the step's (a small batch's step
    costs about what one stream's does), and the runner's own steps refit it. None
    if it failed."""
    book = CostBook()
    slot, vocab = 0, max(engine.info.vocab_size - 1, 1)
    steps: list[float] = []
    try:
        top = engine.info.max_context - DECODE_STEPS - 2
        for i, n in enumerate([DECODE_PROBE, chunk or top]):
            n = max(1, min(n, top))
            best = float("inf")
            for r in range(TRIES):
                prompt = [(7 * (i * TRIES + r) + k) % vocab + 1 for k in range(n)]  # no shared prefix
                t0 = time.perf_counter()
                engine.begin(slot, prompt, Sampling(temperature=0.0), 0)
                while engine.prefill_step(slot, chunk) is None:
                    pass
                best = min(best, time.perf_counter() - t0)
                if not steps:  # the sequence now decoding: time its steps
                    for _ in range(DECODE_STEPS):
                        engine.make_room(_no_victim)
                        t0 = time.perf_counter()
                        engine.step_async().result()
                        steps.append(time.perf_counter() - t0)
                engine.free(slot)
            book.observe("prefill", best, n)
    except Exception as exc:  # noqa: BLE001 - a broken engine fails its requests, not its start
        log.warning("warmup_timing_failed", error=f"{type(exc).__name__}: {exc}")
        return None
    # None only if both prompts timed 0 s (`observe` skips those): never on a real clock.
    return GenCost(cast(Cost, book.cost("prefill")), Cost(min(steps), 0.0))
