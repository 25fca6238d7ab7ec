"""A request's clock in the gateway's reply inbox: which bound is due when (pure)."""

from __future__ import annotations

import asyncio

from services.gateway.inbox import Clock


def clock(**kw) -> Clock:
    return Clock(asyncio.Queue(), **kw)


def test_the_deadline_bounds_the_wait_for_the_first_token_alone():
    due, expired = clock(deadline=100.0, stall_s=5.0, end_by=600.0).due()
    assert (due, expired.why) == (100.0, "deadline")


def test_after_the_first_token_the_stall_timeout_then_the_end_bound_apply():
    c = clock(deadline=100.0, stall_s=5.0, end_by=600.0)
    c.last = 150.0  # past the deadline: it does not count any more
    due, expired = c.due()
    assert (due, expired.why, expired.seconds) == (155.0, "stall", 5.0)
    c.last = 598.0
    due, expired = c.due()
    assert (due, expired.why) == (600.0, "max_time")


def test_without_a_stall_or_end_bound_a_started_generation_is_never_due():
    c = clock(deadline=100.0)
    c.last = 150.0
    assert c.due()[0] == float("inf")
