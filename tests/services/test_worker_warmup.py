"""services.worker.timing.time_encoder and time_decoder: an engine's cost, timed at
warm-up, is the cost its batches (prompts, decode steps) then have (engines whose time
per call and per token is known)."""

from __future__ import annotations

import time
import types

import pytest

from bench.support.mock_encoder import MockEncoder
from services.worker import timing
from services.worker.timing import time_decoder, time_encoder
from tests.support.mock_engine import MockDecoder


class Clock:
    """The timing's clock, moved by the mock engines' work instead of sleeps: what the
    warm-up measures is then exactly the work's cost, however loaded the machine is."""

    def __init__(self) -> None:
        self.now = 100.0

    def perf_counter(self) -> float:
        return self.now

    def spend(self, seconds: float) -> None:
        self.now += seconds


@pytest.fixture
def clock(monkeypatch) -> Clock:
    c = Clock()
    monkeypatch.setattr(timing, "time", types.SimpleNamespace(perf_counter=c.perf_counter))
    return c


class TimedEncoder(MockEncoder):
    """A mock encoder whose batch costs 20 ms + 0.05 ms a token, on the test's clock."""

    def __init__(self, clock: Clock) -> None:
        super().__init__(max_batch=64)
        self.clock = clock

    def embed(self, inputs):
        self.clock.spend(0.02 + 5e-5 * sum(len(x) for x in inputs))
        return super().embed(inputs)


def test_warmup_timing_finds_the_engines_cost_per_batch_and_per_token(clock):
    engine = TimedEncoder(clock)
    cost = time_encoder(engine, max_batch=64)
    assert cost.per_token == pytest.approx(5e-5, rel=1e-6)
    assert cost.per_batch == pytest.approx(0.02, abs=1e-6)
    assert engine.batches == [1, 64, 64, 64, 64]  # one untimed call, then each size twice


def test_a_stalled_probe_does_not_skew_the_encoders_cost(clock):
    """A shared machine stalls one timed batch (here the first, by a second): each
    size's fastest run counts, so the fit is the engine's, not the stall's."""

    class Stalled(TimedEncoder):
        def embed(self, inputs):
            if len(self.batches) == 1:  # the first timed batch
                self.clock.spend(1.0)
            return super().embed(inputs)

    cost = time_encoder(Stalled(clock), max_batch=64)
    assert cost.per_token == pytest.approx(5e-5, rel=1e-6)
    assert cost.per_batch == pytest.approx(0.02, abs=1e-6)


def test_an_engine_that_fails_its_timing_still_starts_without_an_estimate():
    class Broken(MockEncoder):
        def embed(self, inputs):
            raise RuntimeError("broken release")

    assert time_encoder(Broken(), max_batch=32) is None


class Sleeps:
    """Work that takes real time (for a runner that reads the real clock)."""

    spend = staticmethod(time.sleep)


class TimedDecoder(MockDecoder):
    """A mock decoder whose prompt costs 5 ms + 1 ms a token, and a step 20 ms."""

    def __init__(self, clock: Clock | Sleeps = Sleeps()) -> None:
        super().__init__(slots=2, max_context=256)
        self.clock = clock
        self.prompts: list[list[int]] = []

    def begin(self, slot, prompt, sampling, seed, generated=0):
        self.prompts.append(list(prompt))
        return super().begin(slot, prompt, sampling, seed)

    def prefill_step(self, slot, budget=0, mix=False):
        self.clock.spend(5e-3 + 1e-3 * self.prefilling(slot))
        return super().prefill_step(slot, budget, mix)

    def step_async(self):
        self.clock.spend(0.02)
        return super().step_async()


def test_decoder_warmup_timing_finds_the_prompt_and_step_costs(clock):
    engine = TimedDecoder(clock)
    cost = time_decoder(engine, chunk=512)
    assert cost.prefill.per_token == pytest.approx(1e-3, rel=1e-6)
    assert cost.step_s(1) == pytest.approx(0.02, rel=1e-6)
    # The short prompt twice, then a whole chunk (capped by the context) twice.
    assert [len(p) for p in engine.prompts] == [1, 1, 251, 251]
    assert len({p[0] for p in engine.prompts}) == 4  # no prefix the cache could share
    assert engine.stats().active == 0  # its slot is free again


def test_a_decoder_that_fails_its_timing_still_starts_without_an_estimate(clock):
    class Broken(TimedDecoder):
        def step_async(self):
            raise RuntimeError("broken release")

    assert time_decoder(Broken(clock), chunk=512) is None
