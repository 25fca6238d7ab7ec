"""services.worker.service.time_encoder and time_decoder: an engine's cost, timed at
warm-up, is the cost its batches (prompts, decode steps) then have (engines whose time
per call and per token is known)."""

from __future__ import annotations

import time

import pytest

from bench.support.mock_encoder import MockEncoder
from services.worker.service import time_decoder, time_encoder
from tests.support.mock_engine import MockDecoder


def test_warmup_timing_finds_the_engines_cost_per_batch_and_per_token():
    engine = MockEncoder(max_batch=64, per_batch_s=0.02, per_token_s=5e-5)
    cost = time_encoder(engine, max_batch=64)
    assert cost.per_token == pytest.approx(5e-5, rel=0.2)
    assert cost.per_batch == pytest.approx(0.02, abs=0.015)
    assert engine.batches == [1, 64, 64]  # one untimed call, then two full batches


def test_an_engine_that_fails_its_timing_still_starts_without_an_estimate():
    class Broken(MockEncoder):
        def embed(self, inputs):
            raise RuntimeError("broken release")

    assert time_encoder(Broken(), max_batch=32) is None


class TimedDecoder(MockDecoder):
    """A mock decoder whose prompt costs 5 ms + 1 ms a token, and a step 20 ms."""

    def __init__(self) -> None:
        super().__init__(slots=2, max_context=256)
        self.prompts: list[list[int]] = []

    def begin(self, slot, prompt, sampling, seed, generated=0):
        self.prompts.append(list(prompt))
        return super().begin(slot, prompt, sampling, seed)

    def prefill_step(self, slot, budget=0):
        time.sleep(5e-3 + 1e-3 * self.prefilling(slot))
        return super().prefill_step(slot, budget)

    def step_async(self):
        time.sleep(0.02)
        return super().step_async()


def test_decoder_warmup_timing_finds_the_prompt_and_step_costs():
    engine = TimedDecoder()
    cost = time_decoder(engine, chunk=512)
    assert cost.prefill.per_token == pytest.approx(1e-3, rel=0.3)
    assert cost.step_s(1) == pytest.approx(0.02, rel=0.3)
    # The short prompt twice, then a whole chunk (capped by the context) twice.
    assert [len(p) for p in engine.prompts] == [1, 1, 251, 251]
    assert len({p[0] for p in engine.prompts}) == 4  # no prefix the cache could share
    assert engine.stats().active == 0  # its slot is free again


def test_a_decoder_that_fails_its_timing_still_starts_without_an_estimate():
    class Broken(TimedDecoder):
        def step_async(self):
            raise RuntimeError("broken release")

    assert time_decoder(Broken(), chunk=512) is None
