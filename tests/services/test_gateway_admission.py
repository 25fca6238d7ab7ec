"""services.gateway.admission: what the gateway refuses before tokenizing, without NATS.

A real Fleet fed heartbeats, the schedulers' load reports as they arrive on the wire,
and the errors a client would get."""

from __future__ import annotations

import time

import pytest

from services.fleet import Fleet
from services.gateway.admission import GatewayAdmission, TokenRatio, reserved_by, work_ahead
from shared.admission import Report, Tally
from shared.costs import Cost
from shared.config import Config
from shared.errors import ServiceError
from shared.messages import (
    FleetStatus,
    ModelLoad,
    ModelStatus,
    Reserved,
    SchedLoad,
    WorkError,
    encode,
)
from shared.telemetry import Heartbeat

M = "enc"


def heartbeat(worker_id: str = "w1", state: str = "ready", max_batch: int = 32) -> Heartbeat:
    return Heartbeat(worker_id=worker_id, model=M, kind="encoder", state=state,
                     versions=["1"], queue_depth=0, in_flight=0, max_batch=max_batch,
                     batch_occupancy=0.0, steps=1, rss_bytes=0, device="cpu",
                     sent_at=time.time())


def gateway(workers: int = 1, **config) -> GatewayAdmission:
    cfg = Config.from_env({}, **{"max_queue_per_worker": 8, "max_queue_s": 5.0, **config})
    fleet = Fleet(expiry_s=60.0)
    for i in range(workers):
        fleet.observe(heartbeat(f"w{i}"))
    return GatewayAdmission(None, cfg, fleet, cancel=None)


def report(requests: int, tokens: int, per_token: float = 0.001, sid: str = "s1") -> SchedLoad:
    return SchedLoad(sid, [ModelLoad(M, requests, requests, tokens, per_token, 0.0)], time.time())


def refused(fn, *args, **kw) -> ServiceError:
    with pytest.raises(ServiceError) as err:
        fn(*args, **kw)
    return err.value


def test_a_refusing_schedulers_report_makes_the_gateway_refuse_the_rest_of_a_burst():
    adm = gateway()
    deadline = time.time() + 30
    adm.shed(M, deadline)  # nothing reported yet: the scheduler decides
    # The scheduler reports 6 s of work queued on the one worker (bound: 5 s).
    adm.observe_load(report(requests=6, tokens=6000))
    for _ in range(3):  # every further request of the burst, refused here, at once
        err = refused(adm.shed, M, deadline)
        assert err.status == 429 and err.retry_after >= 1.0 and "capacity" in err.message
    # The queue drained (its next report): admitted again at once.
    adm.observe_load(report(requests=0, tokens=0))
    adm.shed(M, deadline)


def test_work_that_cannot_finish_before_the_deadline_is_refused_with_seconds_to_wait():
    adm = gateway()
    adm.observe_load(report(requests=2, tokens=2000))  # 2 s of work ahead
    adm.shed(M, time.time() + 30)  # fits in half of 30 s
    err = refused(adm.shed, M, time.time() + 3.0)  # half of 3 s is 1.5 s: too late
    assert err.status == 429 and "deadline" in err.message
    # Retry-After in seconds of work: with one more request like those ahead there
    # are 3 s, of which 1.5 s fit; the rest must drain first.
    assert err.retry_after == pytest.approx(1.5, abs=0.15)


def test_a_large_bodys_estimated_size_counts_in_its_own_check():
    adm = gateway()
    adm.observe_load(report(requests=1, tokens=1000))  # 1 s ahead
    deadline = time.time() + 5.0  # admits what finishes within 2.5 s
    adm.shed(M, deadline, inputs=1, tokens=1000)
    assert refused(adm.shed, M, deadline, inputs=8, tokens=2000).status == 429


def test_this_gateways_own_count_bounds_a_burst_before_any_report():
    adm = gateway(workers=2)
    adm.waiting[M] = 15
    adm.shed(M)  # 16th of 8 x 2
    adm.waiting[M] = 16
    err = refused(adm.shed, M)
    assert err.status == 429 and err.retry_after == 1.0 and "16 requests queued" in err.message


def test_a_model_with_no_ready_worker_is_left_to_the_scheduler_to_hold():
    adm = gateway(workers=0)
    adm.waiting[M] = 1000
    adm.observe_load(report(requests=100, tokens=10**6))
    adm.shed(M, time.time() + 1)  # no 429: held through the cold start there


def test_a_model_not_served_or_failed_is_a_503_with_the_reason():
    adm = gateway(fleet=f"{M}=0:0")
    err = refused(adm.check_served, M)
    assert err.status == 503 and f"{M}=0:0" in err.message and err.retry_after is None
    adm = gateway()
    adm.check_served(M)
    failed = ModelStatus(M, "failed", 0, 1, "unknown engine 'x'")
    adm.observe_status(FleetStatus("o", [failed], 0.0))
    err = refused(adm.check_served, M)
    assert err.status == 503 and "unknown engine 'x'" in err.message
    adm.observe_status(FleetStatus("o", [ModelStatus(M, "ready", 1, 1)], 0.0))
    adm.check_served(M)


def test_the_work_ahead_is_never_less_than_what_this_gateway_has_out():
    reports = [(100.0, Report(Tally(2, 2, 200), Cost(0.0, 0.001)))]
    ahead, cost = work_ahead(reports, 100.0, 32, 1)
    assert ahead == Tally(2, 2, 200) and cost == Cost(0.0, 0.001)
    ahead, _ = work_ahead(reports, 100.0, 32, 1, own=Tally(9, 9, 900))
    assert ahead == Tally(9, 9, 900)  # a burst outruns the reports
    ahead, _ = work_ahead(reports, 100.0, 32, 1, done=Tally(1, 1, 100))
    assert ahead == Tally(1, 1, 100)  # its own, seen computed since the report
    assert work_ahead([(100.0, Report(Tally(2, 2, 200), Cost(0.0, 0.0)))], 100.0, 32, 1) is None


def test_the_token_estimate_learns_the_tokenizers_ratio():
    ratio = TokenRatio()
    assert ratio.estimate(M, ["x" * 40], 512) == 12  # 4 characters a token, 2 special
    ratio.learn(M, ["x" * 40], 22)  # 20 tokens of text: 2 characters each
    assert ratio.estimate(M, ["x" * 40, "x" * 4000], 512) == 22 + 512  # at most the limit


def test_a_schedulers_answer_to_a_reservation():
    assert reserved_by(encode(Reserved("r", "s1"))) == "s1"
    assert reserved_by(encode(Reserved("r", ""))) == ""  # no ready worker: decided on submit
    err = refused(reserved_by, encode(WorkError("r", 429, "full", retry_after=2.5)))
    assert err.status == 429 and err.retry_after == 2.5
