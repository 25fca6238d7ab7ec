"""Faults injected into real processes under steady load (bench/support/faults.py scenarios,
shortened): a killed worker, a restarted nats-server, a rolling update. Every request
gets an answer; the figures these runs print are in docs/reliability.md."""

from __future__ import annotations

from bench.support import faults


async def test_a_killed_worker_loses_no_request(tmp_path):
    async with faults.running(tmp_path) as (sup, nc):
        res = await faults.kill_worker(sup, nc, "w1", clients=16, before=30, after=80)
    assert res["in_flight_at_kill"] >= 1
    assert res["victim_expired"], "the scheduler never expired the killed worker"
    assert res["redispatched"] >= 1, "nothing the killed worker held was dispatched again"
    # One worker is left, so every request, re-dispatched ones included, succeeds.
    assert res["lost"] == 0 and res["failed"] == {}, res
    assert res["succeeded"] == res["sent"]


async def test_services_reconnect_after_nats_server_restarts(tmp_path):
    async with faults.running(tmp_path) as (sup, nc):
        res = await faults.restart_nats(sup, nc, clients=8, before=30, after=60)
    assert all(res["alive"].values()), res["alive"]  # nothing exited
    assert all(res["reconnected"].values()), res["reconnected"]
    # A request caught in the outage ends with a clear error by its deadline (its work
    # may be gone: the bus is at-most-once) or, if the dying server had it, at its
    # client's timeout; none sent after the restart goes unanswered.
    assert res["lost_sent_after_restart"] == 0, res
    assert res["lost"] <= 8, res  # at most the requests in flight at the outage
    assert set(res["failed"]) <= {"503", "504"}, res
    assert res["slowest_answer_s"] <= faults.DEADLINE_S + faults.MARGIN_S / 2  # no later
    assert res["succeeded"] >= 60  # after the restart, service is normal again


async def test_sigterm_drains_a_worker_without_failing_a_request(tmp_path):
    async with faults.running(tmp_path) as (sup, nc):
        res = await faults.drain_worker(sup, nc, "w2", clients=16, before=30, after=60)
    assert res["exit_code"] == 0 and res["stopped_logged"]
    assert res["lost"] == 0 and res["failed"] == {}, res
    assert res["succeeded"] == res["sent"]
