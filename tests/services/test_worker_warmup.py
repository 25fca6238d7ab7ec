"""services.worker.service.time_encoder: an encoder's cost, timed at warm-up, is the
cost its batches then have (an engine whose time per batch and per token is known)."""

from __future__ import annotations

import pytest

from bench.nomath import NoMathEncoder
from services.worker.service import time_encoder


def test_warmup_timing_finds_the_engines_cost_per_batch_and_per_token():
    engine = NoMathEncoder(max_batch=64, per_batch_s=0.02, per_token_s=5e-5)
    cost = time_encoder(engine, max_batch=64)
    assert cost.per_token == pytest.approx(5e-5, rel=0.2)
    assert cost.per_batch == pytest.approx(0.02, abs=0.015)
    assert engine.batches == [1, 64, 64]  # one untimed call, then two full batches


def test_an_engine_that_fails_its_timing_still_starts_without_an_estimate():
    class Broken(NoMathEncoder):
        def embed(self, inputs):
            raise RuntimeError("broken release")

    assert time_encoder(Broken(), max_batch=32) is None
