"""The batch lane (services.scheduler.lane) and the scheduler's rule around it, without
NATS: a real Scheduler on a bus double that records what it publishes, a real Fleet
fed heartbeats, and the WorkDone messages a worker sends.

The rule: interactive work is dispatched at once; batch work only to a worker with
room (fewer requests outstanding than its batch size), after the interactive work,
oldest first; it is never refused for the work ahead or its deadline, and what
waits in the lane is not counted ahead of interactive work."""

from __future__ import annotations

import time
from types import SimpleNamespace

import msgspec
import pytest

from services.fleet import Fleet
from services.scheduler.admission import Admission
from services.scheduler.holds import Holds
from services.scheduler.lane import WAIT_SHARE, BatchLane, idle, room
from services.scheduler.service import Scheduler
from shared import priority, subjects
from shared.config import Config
from shared.errors import ServiceError
from shared.messages import Cancel, EmbedWork, WorkDone, encode, work_decoder
from shared.priority import BATCH, INTERACTIVE
from shared.telemetry import Heartbeat

M = "enc"


def heartbeat(worker_id: str = "w1", max_batch: int = 1, in_flight: int = 0) -> Heartbeat:
    return Heartbeat(worker_id=worker_id, model=M, kind="encoder", state="ready",
                     versions=["1"], queue_depth=0, in_flight=in_flight, max_batch=max_batch,
                     batch_occupancy=0.0, steps=1, rss_bytes=0, device="cpu",
                     sent_at=time.time())


def embed(rid: str, lane: int = INTERACTIVE, tokens: int = 100, left_s: float = 30.0) -> EmbedWork:
    return EmbedWork(rid, M, "", [[1] * tokens], time.time() + left_s, f"inbox.{rid}",
                     priority=lane)


class Bus:
    """What a Scheduler needs of a NATS connection: it records every publish."""

    is_connected, is_closed = True, False
    _disconnected_cb = _reconnected_cb = None

    def __init__(self) -> None:
        self.sent: list[tuple[str, bytes]] = []

    async def publish(self, subject: str, data: bytes, reply: str = "", headers=None) -> None:
        self.sent.append((subject, data))

    def dispatched(self, worker_id: str = "w1") -> list[str]:
        """Request ids sent to the worker, in order."""
        work = subjects.worker_work(worker_id)
        return [work_decoder.decode(d).request_id for s, d in self.sent if s == work]


def scheduler(max_batch: int = 1, workers: int = 1) -> tuple[Scheduler, Bus]:
    bus = Bus()
    cfg = Config.from_env({}, max_queue_per_worker=8, max_queue_s=5.0, worker_expiry_s=60.0)
    sched = Scheduler(bus, cfg, scheduler_id="s1")  # type: ignore[arg-type]
    for i in range(workers):
        sched.fleet.observe(heartbeat(f"w{i + 1}", max_batch))
    sched.admission.observe_done(WorkDone("w1", [], compute_s=0.1, tokens=100), M)
    return sched, bus


async def done(sched: Scheduler, *rids: str, worker_id: str = "w1") -> None:
    await sched._on_done(SimpleNamespace(data=encode(WorkDone(worker_id, list(rids)))))


# ------------------------------------------------------------------ pure rule
def test_room_is_a_workers_batch_size_less_its_outstanding_requests():
    assert room(4, 1) == 3 and room(4, 4) == 0 and room(4, 9) == 0
    assert room(0, 0) == 1  # a worker that reports no size takes one at a time
    fleet = Fleet(expiry_s=60.0)
    busy, free = fleet.observe(heartbeat("busy", 2)), fleet.observe(heartbeat("free", 2))
    load = {"busy": 2, "free": 1}
    assert idle([busy, free], lambda w: load[w.worker_id]) == [free]


def test_the_lane_is_oldest_first_bounded_and_a_cancel_leaves_it():
    lane = BatchLane(max_queue_per_worker=2)
    for rid in ("b0", "b1"):
        lane.put(embed(rid, BATCH), n_ready=1)
    with pytest.raises(ServiceError) as err:
        lane.put(embed("b2", BATCH), n_ready=1)
    assert err.value.status == 429 and err.value.retry_after
    assert lane.drop("b0") is not None and lane.drop("b0") is None
    got = list(lane.take(M, lambda work: ["a worker"]))
    assert [w.request_id for w, _ in got] == ["b1"] and not lane.waits(M)


def test_the_lane_stops_at_the_first_request_without_room():
    lane = BatchLane(max_queue_per_worker=8)
    for rid in ("b0", "b1", "b2"):
        lane.put(embed(rid, BATCH), n_ready=1)
    rooms = iter([["w"], []])  # room for one, then none
    assert [w.request_id for w, _ in lane.take(M, lambda work: next(rooms))] == ["b0"]
    assert lane.count(M) == 2 and lane.first(M).work.request_id == "b1"


def test_batch_work_waits_a_share_of_its_time_then_gets_a_429_to_retry_never_a_504():
    lane = BatchLane(max_queue_per_worker=8)
    now = time.time()
    lane.put(embed("b", BATCH, left_s=100.0), n_ready=1, now=now)
    assert lane.expire(now + 100 * WAIT_SHARE - 1) == []
    (work, err), = lane.expire(now + 100 * WAIT_SHARE + 0.01)
    assert work.request_id == "b" and err.status == 429 and "interactive" in err.message
    assert not lane.waits(M)


# ------------------------------------------------------------- the scheduler
async def test_interactive_work_that_arrives_after_batch_work_is_dispatched_first():
    sched, bus = scheduler(max_batch=1)
    await sched.admit(embed("a"))  # interactive: the worker's one place
    await sched.admit(embed("b", BATCH))  # no room: it waits in the lane
    await sched.admit(embed("c"))  # interactive: dispatched at once, past the batch work
    assert bus.dispatched() == ["a", "c"] and sched.lane.count(M) == 1
    await done(sched, "a")  # the worker still holds c: no room yet
    assert bus.dispatched() == ["a", "c"]
    await done(sched, "c")  # idle: the batch work goes out
    assert bus.dispatched() == ["a", "c", "b"] and not sched.lane.waits(M)


async def test_batch_work_runs_on_an_idle_fleet_up_to_its_room_and_the_rest_follows():
    sched, bus = scheduler(max_batch=2, workers=2)
    for i in range(6):
        await sched.admit(embed(f"b{i}", BATCH))
    sent = bus.dispatched("w1") + bus.dispatched("w2")
    assert sorted(sent) == ["b0", "b1", "b2", "b3"] and sched.lane.count(M) == 2
    first = bus.dispatched("w1")[0]
    await done(sched, first)
    assert bus.dispatched("w1")[-1] == "b4"  # oldest first, into the room that freed
    await done(sched, *bus.dispatched("w2"), worker_id="w2")
    assert set(bus.dispatched("w2")) >= {"b5"} and not sched.lane.waits(M)


async def test_a_workers_heartbeat_counts_work_other_schedulers_sent_it():
    sched, bus = scheduler(max_batch=2)
    sched.fleet.observe(heartbeat("w1", 2, in_flight=2))  # full with another scheduler's work
    await sched.admit(embed("b", BATCH))
    assert bus.dispatched() == [] and sched.lane.waits(M)
    hb = heartbeat("w1", 2, in_flight=1)
    await sched._on_heartbeat(SimpleNamespace(data=msgspec.msgpack.encode(hb)))
    assert bus.dispatched() == ["b"]


async def test_a_cancelled_batch_request_leaves_the_lane_and_is_never_dispatched():
    sched, bus = scheduler(max_batch=1)
    await sched.admit(embed("a"))
    await sched.admit(embed("b", BATCH))
    await sched._on_cancel(SimpleNamespace(data=encode(Cancel("b"))))
    await done(sched, "a")
    assert bus.dispatched() == ["a"] and not sched.lane.waits(M)


# -------------------------------------------------------------- admission
def admission() -> Admission:
    cfg = Config.from_env({}, max_queue_per_worker=256, max_queue_s=5.0, worker_expiry_s=60.0)
    fleet = Fleet(expiry_s=60.0)
    fleet.observe(heartbeat("w1", 32))
    adm = Admission(cfg, "s1", fleet)
    adm.observe_done(WorkDone("w1", [], compute_s=0.1, tokens=100), M)  # 1 ms a token
    return adm


def test_batch_work_is_not_refused_for_the_work_ahead_or_its_deadline():
    adm = admission()
    for i in range(40):  # 4 s of work ahead
        adm.dispatched(embed(f"r{i}"))
    with pytest.raises(ServiceError) as err:
        adm.admit(embed("late", left_s=2.0))
    assert err.value.status == 429
    assert adm.admit(embed("batch", BATCH, left_s=2.0))  # it waits instead


def test_batch_work_waiting_or_held_is_not_counted_ahead_of_interactive_work():
    sched, _ = scheduler(max_batch=1)
    before = sched.admission.ahead(M)
    sched.lane.put(embed("waiting", BATCH), n_ready=1)
    assert sched.admission.ahead(M) == before
    holds = Holds(max_queue_per_worker=8)
    holds.hold(embed("held-batch", BATCH), None, 0, 0)
    holds.hold(embed("held"), None, 0, 0)
    assert holds.tally(M).requests == 1
    # a cold start's release: interactive work first, whatever arrived earlier
    assert [h.work.request_id for h in holds.take(M)] == ["held", "held-batch"]


# ------------------------------------------------------------------ the wire
def test_the_header_lowers_a_request_to_the_batch_lane_and_nothing_else_is_accepted():
    assert priority.parse(None) == priority.parse("") == INTERACTIVE
    assert priority.parse("interactive") == INTERACTIVE
    assert priority.parse(" Batch ") == BATCH
    with pytest.raises(ServiceError) as err:
        priority.parse("urgent")
    assert err.value.status == 400 and priority.HEADER in err.value.message
    assert err.value.code == "invalid_priority"


def test_work_from_before_the_field_decodes_as_interactive():
    fields = msgspec.msgpack.decode(encode(embed("old", BATCH)))
    at = 1 + EmbedWork.__struct_fields__.index("priority")  # after the tag
    assert fields[at] == BATCH
    old = msgspec.msgpack.encode(fields[:at])  # a sender that knows no priority (nor later)
    assert work_decoder.decode(old).priority == INTERACTIVE


# ------------------------------------------------------------------ signals
def test_the_lane_is_a_gauge_of_its_own_and_no_scaling_demand():
    from prometheus_client import CollectorRegistry

    from services.telemetry.metrics import TelemetryMetrics

    sched, _ = scheduler(max_batch=1)
    idle_fleet = sched.scaling.decide(M)
    for i in range(5):
        sched.lane.put(embed(f"b{i}", BATCH), n_ready=1)
    waiting = sched.scaling.decide(M)
    assert waiting.batch_waiting == 5 and idle_fleet.batch_waiting == 0
    assert waiting.desired_replicas == idle_fleet.desired_replicas  # batch work scales nothing
    reg = CollectorRegistry()
    TelemetryMetrics(reg).observe_scale(waiting, now=0.0)
    assert reg.get_sample_value("tensorbus_model_batch_waiting_requests", {"model": M}) == 5
