"""A heartbeat carries each value once, under one name: the worker's gauges, the
wire, the model card and the Prometheus gauges all read the same fields."""

from __future__ import annotations

import dataclasses
import time

import msgspec
import pytest

from services.worker.runner import Gauges
from shared.telemetry import Heartbeat, heartbeat_decoder, kv_usage, record_decoder

# Names a heartbeat sent beside another that carried the same value (or their ratio).
GONE = ("running", "slots_used", "waiting", "slots_total", "kv_usage",
        "spec_steps", "spec_drafted", "spec_accepted", "capacity")


def _beat(**fields) -> Heartbeat:
    base = {"worker_id": "w1", "model": "lm", "kind": "decoder", "state": "ready",
            "versions": ["1"], "queue_depth": 2, "in_flight": 5, "max_batch": 8,
            "batch_occupancy": 0.5, "steps": 1, "rss_bytes": 1, "device": "cpu",
            "sent_at": time.time(), "kv_blocks_total": 400, "kv_blocks_used": 100,
            "spec_decode_drafts": 10, "spec_decode_draft_tokens": 40,
            "spec_decode_accepted_tokens": 30}
    return Heartbeat(**(base | fields))


def test_the_heartbeat_has_none_of_the_duplicate_names():
    names = set(Heartbeat.__struct_fields__)
    assert names.isdisjoint(GONE)
    assert len(names) == len(Heartbeat.__struct_fields__) == 46


def test_the_runner_gauges_carry_the_heartbeats_names():
    """Every gauge a runner reports goes across under its own name (occupancy is the
    heartbeat's batch_occupancy)."""
    gauges = {f.name for f in dataclasses.fields(Gauges)} - {"occupancy"}
    assert gauges <= set(Heartbeat.__struct_fields__)
    assert gauges.isdisjoint(GONE)


def test_no_record_struct_refuses_unknown_fields():
    """Older stored heartbeats, which sent the removed names, still decode."""
    old = msgspec.msgpack.encode(msgspec.structs.asdict(_beat()) | {
        "t": "heartbeat", "running": 5, "slots_used": 5, "waiting": 2, "slots_total": 8,
        "kv_usage": 0.25})
    assert record_decoder.decode(old) == heartbeat_decoder.decode(old) == _beat(
        sent_at=msgspec.msgpack.decode(old)["sent_at"])


def test_kv_usage_is_the_ratio_of_blocks():
    assert kv_usage(_beat()) == 0.25
    assert kv_usage(_beat(kv_blocks_total=0, kv_blocks_used=0)) == 0.0


def test_prometheus_gauges_are_derived_from_the_single_fields():
    from prometheus_client import CollectorRegistry

    from services.telemetry.metrics import TelemetryMetrics

    reg = CollectorRegistry()
    m = TelemetryMetrics(reg, expiry_s=60)
    m.observe_heartbeat(_beat(), now=0.0)
    m.observe_heartbeat(_beat(worker_id="e1", model="enc", kind="encoder", kv_blocks_total=0,
                              kv_blocks_used=0), now=0.0)

    def value(name, **labels):
        return reg.get_sample_value(f"tensorbus_{name}", labels)

    lm = {"worker": "w1", "model": "lm"}
    assert value("worker_in_flight", **lm) == value("num_requests_running", **lm) \
        == value("worker_slots_used", **lm) == 5
    assert value("worker_queue_depth", **lm) == value("num_requests_waiting", **lm) == 2
    assert value("kv_cache_usage_perc", **lm) == 0.25
    assert value("kv_cache_blocks", **lm) == 400
    assert value("spec_decode_num_drafts_total", **lm) == 10
    assert value("spec_decode_num_draft_tokens_total", **lm) == 40
    assert value("spec_decode_num_accepted_tokens_total", **lm) == 30
    # An encoder's requests are not vLLM's decode sequences: those gauges read 0.
    enc = {"worker": "e1", "model": "enc"}
    assert value("worker_in_flight", **enc) == 5
    assert value("num_requests_running", **enc) == value("worker_slots_used", **enc) == 0
    assert value("num_requests_waiting", **enc) == 0
    assert value("model_num_requests_running", model="lm") == 5
    assert value("model_num_requests_waiting", model="lm") == 2


def test_the_model_card_reads_the_speculation_counters():
    from services.fleet import Fleet
    from services.gateway.models import ModelTable

    fleet = Fleet(expiry_s=60)
    fleet.observe(_beat())
    fleet.observe(_beat(worker_id="w2", spec_decode_drafts=10, spec_decode_draft_tokens=40,
                        spec_decode_accepted_tokens=10))

    class NoDecisions:
        def desired(self, _model):
            return 0

        def kind(self, _model):
            return ""

    models = ModelTable(fleet)
    card = models.card("lm", NoDecisions())
    assert card.spec_decode_acceptance == pytest.approx(40 / 80)
    assert card.spec_decode_tokens_per_step == pytest.approx((40 + 20) / 20)
