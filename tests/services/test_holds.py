"""How long the scheduler holds a request for a worker that is starting
(services/scheduler/holds.py): pure rules, no bus."""

from __future__ import annotations

import time

import pytest

from services.scheduler.holds import START_MARGIN, Holds
from shared.messages import EmbedWork, GenerateWork, Sampling


def _generation(deadline: float, end_by: float) -> GenerateWork:
    return GenerateWork("g", "lm", "", [1, 2], 8, Sampling(temperature=0), [], 1, True,
                        deadline, "reply.g", "", end_by=end_by)


def test_a_generation_waits_the_cold_start_allowance_past_its_deadline():
    now = time.time()
    holds = Holds(256, cold_start_s=120.0)
    assert holds.until(_generation(now + 30, now + 600)) == pytest.approx(now + 150)


def test_the_clients_own_timeout_bounds_the_wait():
    now = time.time()  # Tensorbus-Timeout: 40 -> deadline and end_by both at 40 s
    holds = Holds(256, cold_start_s=120.0)
    assert holds.until(_generation(now + 40, now + 40)) == pytest.approx(now + 40)


def test_a_measured_cold_start_longer_than_the_allowance_is_waited_out():
    now = time.time()
    holds = Holds(256, cold_start_s=10.0)
    holds.observe_start("lm", 200.0)
    got = holds.until(_generation(now + 30, now + 600))
    assert got == pytest.approx(time.time() + 200.0 * START_MARGIN, abs=1.0)


def test_an_embedding_waits_its_deadline_only():
    now = time.time()
    work = EmbedWork("e", "enc", "", [[1, 2]], now + 30, "reply.e")
    assert Holds(256, cold_start_s=120.0).until(work) == now + 30
