"""services.scheduler.admission, holds and load reports, without NATS: a real Fleet fed
heartbeats, requests and reports as they arrive on the wire, and the errors a client
would get."""

from __future__ import annotations

import time

import pytest

from services.fleet import Fleet
from services.scheduler.admission import RESERVATION_S, Admission
from services.scheduler.holds import Holds
from services.scheduler.loads import LoadReports
from shared.costs import Cost
from shared.config import Config
from shared.errors import ServiceError
from shared.messages import (
    EmbedWork,
    FleetStatus,
    GenerateWork,
    ModelLoad,
    ModelStatus,
    Reserve,
    Sampling,
    SchedLoad,
    WorkDone,
)
from shared.telemetry import Heartbeat

M = "enc"
PER_TOKEN = 0.001  # seconds of engine time a token


def heartbeat(worker_id: str = "w1", state: str = "ready", version: str = "1") -> Heartbeat:
    return Heartbeat(worker_id=worker_id, model=M, kind="encoder", state=state,
                     versions=[version], queue_depth=0, in_flight=0, max_batch=32,
                     batch_occupancy=0.0, steps=1, rss_bytes=0, device="cpu",
                     sent_at=time.time())


def scheduler(workers: int = 1, timed: bool = True, **config):
    """(Admission, Holds) of one scheduler; `timed`: the model's cost is known."""
    cfg = Config.from_env({}, **{"max_queue_per_worker": 256, "max_queue_s": 5.0,
                                 "worker_expiry_s": 60.0, **config})
    fleet = Fleet(expiry_s=60.0)
    for i in range(workers):
        fleet.observe(heartbeat(f"w{i}"))
    holds = Holds(cfg.max_queue_per_worker)
    adm = Admission(cfg, "s1", fleet, held=holds.tally)
    if timed:
        adm.observe_done(WorkDone("w0", [], compute_s=100 * PER_TOKEN, tokens=100), M)
    return adm, holds


def embed(rid: str, tokens: int = 100, left_s: float = 30.0, reserved: str = "",
          version: str = "") -> EmbedWork:
    return EmbedWork(rid, M, version, [[1] * tokens], time.time() + left_s, "inbox",
                     reserved=reserved)


def refused(fn, *args) -> ServiceError:
    with pytest.raises(ServiceError) as err:
        fn(*args)
    return err.value


def test_a_request_that_cannot_finish_before_its_deadline_is_refused_with_seconds_to_wait():
    adm, _ = scheduler()
    for i in range(10):  # 10 x 100 tokens: 1 s of work on the one worker
        adm.dispatched(embed(f"r{i}"))
    assert adm.admit(embed("fits", left_s=30.0))
    err = refused(adm.admit, embed("late", left_s=1.2))  # 1.1 s to finish, 0.6 s allowed
    assert err.status == 429 and "deadline" in err.message
    assert 0.5 <= err.retry_after <= 0.6  # the excess in seconds of work, up to a tenth


def test_the_queue_bound_is_in_seconds_of_work_and_a_second_worker_halves_it():
    adm, _ = scheduler(max_queue_s=1.0)
    for i in range(10):
        adm.dispatched(embed(f"r{i}"))
    err = refused(adm.admit, embed("over"))  # 1.1 s of work on one worker, 1 s allowed
    assert err.status == 429 and "capacity" in err.message and err.retry_after == pytest.approx(0.1)
    adm.fleet.observe(heartbeat("w9"))
    assert len(adm.admit(embed("spread"))) == 2  # 0.55 s each


def test_another_schedulers_report_counts_against_the_same_bound():
    adm, _ = scheduler(timed=False, max_queue_s=1.0)
    load = SchedLoad("s2", [ModelLoad(M, 10, 10, 1000, PER_TOKEN, 0.0)], time.time())
    adm.observe_load(load, time.monotonic())
    assert adm.costs.cost(M).per_token == pytest.approx(PER_TOKEN)  # its estimate, learned
    assert adm.ahead(M).requests == 10
    assert refused(adm.admit, embed("over")).status == 429
    adm.observe_load(SchedLoad("s1", [ModelLoad(M, 99, 99, 99_000)], time.time()),
                     time.monotonic())  # its own report, heard back: not counted twice
    assert adm.ahead(M).requests == 10


def test_before_any_batch_is_timed_a_count_of_batches_bounds_the_queue():
    adm, _ = scheduler(timed=False)
    for i in range(64):  # two batches of 32 inputs on the one worker
        adm.dispatched(embed(f"r{i}", tokens=1))
    err = refused(adm.admit, embed("more"))
    assert err.status == 429 and "not measured yet" in err.message and err.retry_after == 1.0


def test_a_passed_deadline_is_504_and_a_model_not_served_or_failed_503():
    adm, _ = scheduler()
    assert refused(adm.admit, embed("late", left_s=-1)).status == 504
    adm.observe_status(FleetStatus("o", [ModelStatus(M, "failed", 0, 1, "")], 0.0))
    err = refused(adm.admit, embed("failed"))
    assert err.status == 503 and "invalid configuration" in err.message
    adm, _ = scheduler(fleet=f"{M}=0:0")
    err = refused(adm.admit, embed("unserved"))
    assert err.status == 503 and f"{M}=0:0" in err.message


def test_no_ready_worker_means_hold_unless_a_pinned_version_is_missing():
    adm, _ = scheduler(workers=0)
    assert adm.admit(embed("cold")) == []  # held for the cold start
    adm.fleet.observe(heartbeat("w0"))
    err = refused(adm.admit, embed("pinned", version="7"))
    assert err.status == 503 and "version 7" in err.message


def test_generation_that_no_worker_has_timed_is_bounded_by_count_alone():
    adm, _ = scheduler(max_queue_per_worker=2)
    gen = [GenerateWork(f"g{i}", M, "", [1] * 10_000, 16, Sampling(), [], 1, False,
                        time.time() + 0.1, "inbox") for i in range(3)]
    adm.dispatched(gen[0])
    assert adm.admit(gen[1])  # 10,000 prompt tokens and 0.1 s to live: no work bound
    adm.dispatched(gen[1])
    assert refused(adm.admit, gen[2]).status == 429


def test_a_reservation_holds_room_until_its_work_arrives():
    adm, _ = scheduler(max_queue_s=1.0)
    deadline = time.time() + 30
    assert adm.reserve(Reserve("big", M, "", 4, 800, deadline)) == "s1"  # 0.8 s of work
    assert adm.ahead(M).tokens == 800
    err = refused(adm.reserve, Reserve("next", M, "", 4, 800, deadline))
    assert err.status == 429  # the room is taken, before either is tokenized
    # The work arrives (tokenized: more than estimated) and the cost has moved since:
    # it was admitted already, so it is not refused now.
    adm.costs.learn("other", Cost(0.0, 1.0))
    work = embed("big", tokens=1200, reserved="s1")
    assert adm.admit(work)
    adm.dispatched(work)
    assert not adm.reservations and adm.ahead(M).tokens == 1200  # room became the work


def test_a_reservation_whose_work_never_comes_expires():
    adm, _ = scheduler()
    adm.reserve(Reserve("gone", M, "", 1, 100, time.time() + 30))
    adm.expire_reservations(time.monotonic() + RESERVATION_S - 0.5)
    assert "gone" in adm.reservations
    adm.expire_reservations(time.monotonic() + RESERVATION_S + 0.1)
    assert not adm.reservations and adm.ahead(M).requests == 0


def test_no_ready_worker_reserves_nothing_and_the_submit_decides():
    adm, _ = scheduler(workers=0)
    assert adm.reserve(Reserve("cold", M, "", 1, 100, time.time() + 30)) == ""
    assert not adm.reservations


def test_held_work_counts_ahead_and_is_bounded_as_for_one_worker():
    adm, holds = scheduler(workers=0, max_queue_per_worker=3)
    for i in range(3):
        holds.hold(embed(f"h{i}"), None, queued=0, n_ready=0)
    assert adm.ahead(M).requests == 3 and adm.ahead(M).tokens == 300
    err = refused(holds.hold, embed("h3"), None, 0, 0)
    assert err.status == 429 and "starting" in err.message
    assert [h.work.request_id for h in holds.take(M)] == ["h0", "h1", "h2"]  # oldest first
    assert holds.count(M) == 0


def test_held_work_ends_with_504_at_its_deadline_or_503_when_the_model_failed():
    _, holds = scheduler(workers=0)
    holds.hold(embed("soon", left_s=1.0), None, 0, 0)
    holds.hold(embed("later", left_s=60.0), None, 0, 0)
    (work, err), = holds.expire(time.time() + 2.0)
    assert work.request_id == "soon" and err.status == 504 and "cold start" in err.message
    (work, err), = holds.fail({M: "unknown engine 'x'"})
    assert work.request_id == "later" and err.status == 503 and "unknown engine" in err.message
    assert holds.count(M) == 0


def test_a_held_generation_waits_out_the_measured_cold_start_within_its_end_by_and_a_cancel_drops_it():
    _, holds = scheduler(workers=0)
    now = time.time()

    def gen(rid: str, end_in: float) -> GenerateWork:
        return GenerateWork(rid, M, "", [1, 2], 16, Sampling(), [], 1, False, now + 30, "inbox",
                            end_by=now + end_in)

    holds.hold(gen("unmeasured", 600), None, 0, 0)
    holds.observe_start(M, 80.0)
    holds.observe_start(M, 40.0)  # the slowest start seen counts
    holds.hold(gen("long", 600), None, 0, 0)
    holds.hold(gen("capped", 60), None, 0, 0)
    holds.hold(embed("embed"), None, 0, 0)
    deadlines = {h.work.request_id: h.work.deadline - now for h in holds.by_model[M]}
    assert deadlines["unmeasured"] == pytest.approx(30, abs=1)  # no start seen: its deadline
    assert deadlines["long"] == pytest.approx(100, abs=1)  # 80 s x 1.25
    assert deadlines["capped"] == pytest.approx(60, abs=1)  # its end_by
    assert deadlines["embed"] == pytest.approx(30, abs=1)  # an answer, not a generation
    assert holds.drop("long").request_id == "long" and holds.drop("long") is None
    assert [h.work.request_id for h in holds.take(M)] == ["unmeasured", "capped", "embed"]


def test_the_load_report_carries_work_out_held_work_and_the_cost():
    adm, holds = scheduler()
    reports = LoadReports(None, "s1", adm, holds, interval_s=0.5)
    adm.dispatched(embed("out", tokens=50))
    holds.hold(EmbedWork("held", "other", "", [[1] * 7], time.time() + 30, ""), None, 0, 0)
    by_model = {m.model: m for m in reports.report().models}
    assert (by_model[M].requests, by_model[M].tokens) == (1, 50)
    assert by_model[M].cost_per_token == pytest.approx(PER_TOKEN)
    assert (by_model["other"].requests, by_model["other"].tokens) == (1, 7)
    adm.finished(embed("out", tokens=50))
    holds.take("other")
    # The next report still names both (their counts seen going to zero), then only
    # the model whose cost is known.
    assert {m.model: m.requests for m in reports.report().models} == {M: 0, "other": 0}
    assert [m.model for m in reports.report().models] == [M]


def test_a_workers_warmup_cost_admits_the_first_burst_by_its_work():
    adm, _ = scheduler(timed=False)
    hb = heartbeat("w0")
    hb.cost_per_token, hb.cost_per_batch = PER_TOKEN, 0.0  # timed at its warm-up
    adm.observe_heartbeat(hb)
    for i in range(200):  # far past two batches of inputs, before any batch finished
        adm.dispatched(embed(f"r{i}", tokens=4))
    assert adm.admit(embed("next", tokens=4))  # 0.8 s of work: admitted
    # A measured batch then counts as usual; the heartbeat does not reset it.
    adm.observe_done(WorkDone("w0", [], compute_s=8 * PER_TOKEN * 100, tokens=100), M)
    adm.observe_heartbeat(hb)
    assert adm.costs.cost(M).seconds(1, 100, 32) > 100 * PER_TOKEN
