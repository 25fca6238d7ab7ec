"""TelemetryService against a real nats-server: records in, /metrics and summaries out.

Each test uses its own model name so records other tests leave on the shared server
(and in the shared TELEMETRY stream) never mix in.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
import uuid
from contextlib import suppress

import httpx
import msgspec
import nats
import numpy as np
import pytest
import pytest_asyncio
from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy, DiscardPolicy
from prometheus_client import CollectorRegistry
from prometheus_client.parser import text_string_to_metric_families

from services.micro import ready_subject
from services.telemetry.metrics import TelemetryMetrics
from services.telemetry.service import SERVICE_NAME, TelemetryService
from services.telemetry.stream import ensure_stream, stream_config
from shared import subjects
from shared.config import Config
from shared.natsd import free_port
from shared.telemetry import (Heartbeat, RequestRecord, ScaleDecision, Summary, encode, itl_bucket,
                              itl_counts, record_decoder)
from tests.support.bus import connect as bus_connect

ALPHA = 0.01
SUMMARY_S = 0.2


def _model() -> str:
    return f"m-{uuid.uuid4().hex[:8]}"


def _request(model: str, total_s: float, *, status: int = 200, endpoint: str = "embeddings",
             prompt: int = 8, completion: int = 0, ttft: float = 0.0, itl: float = 0.0,
             batch: int = 4) -> RequestRecord:
    return RequestRecord(
        request_id=uuid.uuid4().hex, endpoint=endpoint, model=model, version="1",
        worker_id="w", status=status, error_code="" if status < 400 else "overloaded",
        total_s=total_s, queue_s=total_s * 0.2, batch_wait_s=total_s * 0.1,
        compute_s=total_s * 0.6, prompt_tokens=prompt, completion_tokens=completion,
        ttft_s=ttft, itl_s=itl, batch_size=batch, finished_at=time.time(),
        itl_counts=_gaps(itl, completion - 1) if itl else [])


def _gaps(gap: float, n: int) -> list[int]:
    """A worker's per-token histogram of `n` gaps, all `gap` long."""
    counts = itl_counts()
    counts[itl_bucket(gap)] = n
    return counts


def _heartbeat(worker: str, model: str, *, state: str = "ready", queue: int = 0,
               in_flight: int = 0) -> Heartbeat:
    return Heartbeat(
        worker_id=worker, model=model, kind="decoder", state=state, versions=["1"],
        queue_depth=queue, in_flight=in_flight, max_batch=8, batch_occupancy=0.5, steps=1,
        rss_bytes=123_456_789, device="cpu", sent_at=time.time(), kv_blocks_total=512,
        kv_blocks_used=128)


async def _wait_for(probe, timeout: float = 10.0, what: str = "condition"):
    """Poll an async probe until it returns something truthy; fail after `timeout`."""
    end = time.monotonic() + timeout
    while True:
        got = await probe()
        if got:
            return got
        if time.monotonic() > end:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.05)


class Scrape:
    """Samples from one /metrics scrape, looked up by name and a subset of labels."""

    def __init__(self, text: str) -> None:
        self.samples = [s for fam in text_string_to_metric_families(text) for s in fam.samples]

    def get(self, name: str, **labels) -> float | None:
        hits = [s.value for s in self.samples if s.name == name
                and all(s.labels.get(k) == v for k, v in labels.items())]
        return sum(hits) if hits else None

    def labelsets(self, name: str, **labels) -> list[dict]:
        return [s.labels for s in self.samples if s.name == name
                and all(s.labels.get(k) == v for k, v in labels.items())]


async def _scrape(port: int) -> Scrape:
    async with httpx.AsyncClient() as http:
        resp = await http.get(f"http://127.0.0.1:{port}/metrics", timeout=5)
        resp.raise_for_status()
        return Scrape(resp.text)


def _config(nats_url: str, **kw) -> Config:
    base = dict(nats_url=nats_url, metrics_port=0, summary_interval_s=SUMMARY_S,
                worker_expiry_s=0.6)
    return Config(**{**base, **kw})


@pytest_asyncio.fixture
async def started(nats_server):
    """Start a TelemetryService (own connection, fresh registry); yields a factory."""
    running: list[tuple[TelemetryService, asyncio.Task, nats.NATS]] = []

    async def start(**config) -> TelemetryService:
        tnc = await bus_connect(nats_server.url)
        svc = TelemetryService(tnc, _config(nats_server.url, **config),
                               registry=CollectorRegistry(), window_slots=100)
        task = asyncio.create_task(svc.run())
        await asyncio.wait_for(svc.started.wait(), 15)
        running.append((svc, task, tnc))
        return svc

    yield start
    for svc, task, tnc in running:
        await svc.stop()
        await task
        await tnc.drain()


async def test_request_records_reach_counters_and_histograms(started, nc):
    svc = await started()
    model = _model()
    rng = np.random.default_rng(0)
    lat = rng.lognormal(np.log(0.01), 1.0, size=40)
    for x in lat:
        await nc.publish(subjects.TELEMETRY_REQUESTS, encode(_request(model, float(x))))
    for _ in range(5):
        await nc.publish(subjects.TELEMETRY_REQUESTS, encode(_request(model, 0.0001, status=429)))
    gen = [_request(model, 1.5, endpoint="chat.completions", prompt=20, completion=30,
                    ttft=0.12, itl=0.02, batch=0) for _ in range(3)]
    for rec in gen:
        await nc.publish(subjects.TELEMETRY_REQUESTS, encode(rec))
    await nc.flush()

    async def all_counted():
        s = await _scrape(svc.metrics_port)
        return s if s.get("tensorbus_requests_total", model=model) == 48 else None

    s = await _wait_for(all_counted, what="48 requests counted")
    assert s.get("tensorbus_requests_total", model=model, endpoint="embeddings", status="200") == 40
    assert s.get("tensorbus_requests_total", model=model, endpoint="embeddings", status="429") == 5
    assert s.get("tensorbus_requests_total", model=model, endpoint="chat.completions") == 3

    # Histograms hold served requests only; bucket counts match numpy on the same data.
    served = np.concatenate([lat, [1.5] * 3])
    assert s.get("tensorbus_e2e_request_latency_seconds_count", model=model) == 43
    assert s.get("tensorbus_e2e_request_latency_seconds_sum", model=model) == pytest.approx(served.sum())
    for le in ("0.001", "0.01", "0.1", "2.5"):
        assert s.get("tensorbus_e2e_request_latency_seconds_bucket", model=model, le=le) == \
            np.count_nonzero(served <= float(le))
    assert s.get("tensorbus_request_compute_seconds_sum", model=model) == pytest.approx(served.sum() * 0.6)
    assert s.get("tensorbus_request_queue_time_seconds_count", model=model) == 43
    assert s.get("tensorbus_request_batch_wait_seconds_count", model=model) == 43
    assert s.get("tensorbus_batch_size_count", model=model) == 40  # generation had none
    assert s.get("tensorbus_prompt_tokens_total", model=model) == 40 * 8 + 3 * 20
    assert s.get("tensorbus_generation_tokens_total", model=model) == 3 * 30
    assert s.get("tensorbus_request_generation_tokens_count", model=model) == 3
    assert s.get("tensorbus_request_prompt_tokens_bucket", model=model, le="8.0") == 40
    assert s.get("tensorbus_time_to_first_token_seconds_count", model=model) == 3
    assert s.get("tensorbus_time_to_first_token_seconds_sum", model=model) == pytest.approx(0.36)
    assert s.get("tensorbus_inter_token_latency_seconds_count", model=model) == 3 * 29  # per token
    assert s.get("tensorbus_inter_token_latency_seconds_sum", model=model) == pytest.approx(3 * 29 * 0.02)
    assert s.get("tensorbus_inter_token_latency_seconds_bucket", model=model, le="0.01") == 0
    assert s.get("tensorbus_inter_token_latency_seconds_bucket", model=model, le="0.02") == 3 * 29


async def test_heartbeats_drive_gauges_and_silent_workers_disappear(started, nc):
    svc = await started()
    model = _model()
    a, b = f"{model}-a", f"{model}-b"
    alive = asyncio.Event()

    async def beat_a():
        # Worker a keeps heartbeating (its interval, not a synchronisation sleep).
        while not alive.is_set():
            await nc.publish(subjects.TELEMETRY_WORKERS, encode(_heartbeat(a, model, queue=3)))
            with suppress(asyncio.TimeoutError):
                await asyncio.wait_for(alive.wait(), 0.1)

    beater = asyncio.create_task(beat_a())
    await nc.publish(subjects.TELEMETRY_WORKERS,
                     encode(_heartbeat(b, model, state="warming", queue=4, in_flight=2)))

    async def both_up():
        s = await _scrape(svc.metrics_port)
        return s if len(s.labelsets("tensorbus_worker_up", model=model)) == 2 else None

    try:
        s = await _wait_for(both_up, what="two workers up")
        assert s.get("tensorbus_worker_up", worker=b, model=model, state="warming") == 1
        assert s.get("tensorbus_worker_queue_depth", worker=b) == 4
        assert s.get("tensorbus_worker_in_flight", worker=b) == 2
        assert s.get("tensorbus_worker_rss_bytes", worker=b) == 123_456_789
        assert s.get("tensorbus_worker_batch_occupancy", worker=b) == 0.5
        assert s.get("tensorbus_kv_cache_usage_perc", worker=b) == 0.25  # 128 / 512 blocks
        assert s.get("tensorbus_worker_slots_used", worker=b) == 2  # a decoder's in flight
        assert s.get("tensorbus_model_queue_depth", model=model) == 7
        assert s.get("tensorbus_model_ready_workers", model=model) == 1

        # b goes silent: every series of b goes, a stays, the fleet gauges follow.
        async def b_gone():
            s = await _scrape(svc.metrics_port)
            return s if not any(l.get("worker") == b for l in s.labelsets("tensorbus_worker_up")) else None

        s = await _wait_for(b_gone, what="worker b expired")
        for name in ("tensorbus_worker_queue_depth", "tensorbus_worker_in_flight",
                     "tensorbus_worker_rss_bytes", "tensorbus_kv_cache_usage_perc"):
            assert s.get(name, worker=b) is None, name
        assert s.get("tensorbus_worker_up", worker=a, state="ready") == 1
        assert s.get("tensorbus_model_queue_depth", model=model) == 3
    finally:
        alive.set()
        await beater

    # A state change moves the worker to a new `state` series; "stopped" drops it now.
    await nc.publish(subjects.TELEMETRY_WORKERS, encode(_heartbeat(a, model, state="draining")))

    async def draining():
        s = await _scrape(svc.metrics_port)
        return s if s.get("tensorbus_worker_up", worker=a, state="draining") == 1 else None

    s = await _wait_for(draining, what="worker a draining")
    assert s.get("tensorbus_worker_up", worker=a, state="ready") is None
    assert s.get("tensorbus_model_ready_workers", model=model) == 0
    await nc.publish(subjects.TELEMETRY_WORKERS, encode(_heartbeat(a, model, state="stopped")))

    async def a_gone():
        s = await _scrape(svc.metrics_port)
        return s if not s.labelsets("tensorbus_worker_up", model=model) else None

    s = await _wait_for(a_gone, what="worker a stopped")
    assert s.get("tensorbus_model_queue_depth", model=model) == 0


def test_expiry_and_stopped_on_a_fresh_registry():
    reg = CollectorRegistry()
    m = TelemetryMetrics(reg, expiry_s=1.5)
    m.observe_heartbeat(_heartbeat("a", "x", queue=2), now=100.0)
    m.observe_heartbeat(_heartbeat("b", "x", queue=5), now=101.0)
    up = lambda w: reg.get_sample_value(  # noqa: E731
        "tensorbus_worker_up", {"worker": w, "model": "x", "state": "ready"})
    assert m.expire_workers(101.5) == [] and up("a") == 1
    assert m.expire_workers(101.6) == ["a"] and up("a") is None
    assert reg.get_sample_value("tensorbus_model_queue_depth", {"model": "x"}) == 5
    # "stopped" removes the worker at once, without waiting for the expiry.
    m.observe_heartbeat(_heartbeat("b", "x", state="stopped"), now=101.7)
    assert up("b") is None and m.workers() == {}
    assert reg.get_sample_value("tensorbus_model_ready_workers", {"model": "x"}) == 0
    assert reg.get_sample_value("tensorbus_worker_queue_depth", {"worker": "b", "model": "x"}) is None


async def test_scale_decision_sets_desired_replicas(started, nc):
    svc = await started()
    model = _model()
    for desired in (2, 5):
        await nc.publish(subjects.TELEMETRY_SCALE, encode(ScaleDecision(
            model=model, ready_replicas=1, desired_replicas=desired, queue_depth=100,
            in_flight=8, reason="queue", at=time.time())))

    async def five():
        s = await _scrape(svc.metrics_port)
        return s.get("tensorbus_model_desired_replicas", model=model) == 5

    await _wait_for(five, what="desired replicas 5")


def _decision(sid: str, desired: int, held: int = 0, reason: str = "") -> ScaleDecision:
    return ScaleDecision(model="x", ready_replicas=0, desired_replicas=desired, queue_depth=0,
                         in_flight=0, reason=reason, at=time.time(), scheduler_id=sid,
                         held=held, min_replicas=0, max_replicas=4, target_per_replica=32.0)


def test_desired_replicas_combine_live_schedulers_and_idle_reads_zero():
    reg = CollectorRegistry()
    m = TelemetryMetrics(reg)
    desired = lambda: reg.get_sample_value(  # noqa: E731
        "tensorbus_model_desired_replicas", {"model": "x"})
    held = lambda: reg.get_sample_value("tensorbus_model_held_requests", {"model": "x"})  # noqa: E731
    # Two schedulers each hold 20 requests for a cold start: 40 need two workers,
    # though each alone asks for one. The last writer alone would say 1.
    m.observe_scale(_decision("s1", 1, held=20), now=0.0)
    m.observe_scale(_decision("s2", 1, held=20), now=1.0)
    assert (desired(), held()) == (2, 40)
    # s1 goes silent: it stops counting.
    m.expire_decisions(now=10.5)
    assert (desired(), held()) == (1, 20)
    # Idle: the schedulers say 0 and the gauge reads 0, not the last busy value.
    m.observe_scale(_decision("s2", 0, reason="idle for 60 s"), now=11.0)
    assert (desired(), held()) == (0, 0)
    # The last scheduler gone: the value stays (no scheduler is no reason for 0).
    m.expire_decisions(now=30.0)
    assert desired() == 0


def test_memory_gauges_and_cold_start_wait():
    reg = CollectorRegistry()
    m = TelemetryMetrics(reg, expiry_s=1.0)
    hb = msgspec.structs.replace(_heartbeat("a", "x"), mem_used_bytes=900, mem_limit_bytes=1000)
    m.observe_heartbeat(hb, now=0.0)
    labels = {"worker": "a", "model": "x"}
    assert reg.get_sample_value("tensorbus_worker_memory_used_bytes", labels) == 900
    assert reg.get_sample_value("tensorbus_worker_memory_limit_bytes", labels) == 1000
    m.expire_workers(now=5.0)
    assert reg.get_sample_value("tensorbus_worker_memory_used_bytes", labels) is None
    for hold, status in ((2.0, 200), (0.0, 200), (30.0, 504)):
        m.observe_request(msgspec.structs.replace(_request("x", 3.0, status=status), hold_s=hold))
    count = reg.get_sample_value("tensorbus_cold_start_wait_seconds_count", {"model": "x"})
    total = reg.get_sample_value("tensorbus_cold_start_wait_seconds_sum", {"model": "x"})
    assert (count, total) == (2, 32.0)  # held ones only, the one that timed out included


async def test_summary_quantiles_agree_with_numpy(started, nc):
    svc = await started()
    model = _model()
    sub = await nc.subscribe(subjects.TELEMETRY_SUMMARY)
    rng = np.random.default_rng(11)
    lat = rng.lognormal(np.log(0.05), 0.8, size=3_000)
    ttft = rng.lognormal(np.log(0.2), 0.5, size=lat.size)
    for x, t in zip(lat, ttft):
        await nc.publish(subjects.TELEMETRY_REQUESTS, encode(_request(
            model, float(x), endpoint="completions", prompt=10, completion=5, ttft=float(t))))
    for _ in range(30):
        await nc.publish(subjects.TELEMETRY_REQUESTS, encode(_request(model, 30.0, status=504)))
    await nc.flush()

    async def complete_summary():
        summary = record_decoder.decode((await sub.next_msg(timeout=5)).data)
        assert isinstance(summary, Summary)
        ours = [m for m in summary.models if m.model == model]
        return (summary, ours[0]) if ours and ours[0].requests == lat.size + 30 else None

    try:
        summary, ms = await _wait_for(complete_summary, what="summary with every record")
    finally:
        await sub.unsubscribe()
    assert ms.errors == 30
    exact = np.quantile(lat, [0.5, 0.95, 0.99], method="lower")  # 504s are not latency samples
    got = np.array([ms.p50_s, ms.p95_s, ms.p99_s])
    assert np.all(np.abs(got - exact) / exact <= ALPHA * (1 + 1e-9)), (got, exact)
    t_exact = np.quantile(ttft, [0.5, 0.99], method="lower")
    t_got = np.array([ms.ttft_p50_s, ms.ttft_p99_s])
    assert np.all(np.abs(t_got - t_exact) / t_exact <= ALPHA * (1 + 1e-9))
    assert ms.throughput_rps == pytest.approx(lat.size / summary.window_s)
    assert ms.tokens_per_s == pytest.approx(lat.size * 15 / summary.window_s)
    assert ms.cost_per_1m_tokens == 0.0  # a price per worker-hour, and no worker was heard


async def test_records_replay_from_the_stream(started, nc):
    await started()
    js = nc.jetstream()
    start = (await js.stream_info(subjects.TELEMETRY_STREAM)).state.last_seq + 1
    info = await js.stream_info(subjects.TELEMETRY_STREAM)
    assert info.config.max_age == pytest.approx(24 * 3600)
    assert info.config.max_bytes == 1 << 30 and info.config.discard == DiscardPolicy.OLD
    model = _model()
    sent = [_request(model, 0.01 * (i + 1)) for i in range(25)]
    for rec in sent:
        await nc.publish(subjects.TELEMETRY_REQUESTS, encode(rec))
    await nc.flush()

    # A consumer created after the fact reads the records back, in order.
    psub = await js.pull_subscribe(subjects.TELEMETRY_REQUESTS, stream=subjects.TELEMETRY_STREAM,
                                   config=ConsumerConfig(deliver_policy=DeliverPolicy.BY_START_SEQUENCE,
                                                         opt_start_seq=start, ack_policy=AckPolicy.NONE))
    got: list[RequestRecord] = []
    try:
        while len(got) < len(sent):
            for msg in await psub.fetch(100, timeout=5):
                rec = record_decoder.decode(msg.data)
                if isinstance(rec, RequestRecord) and rec.model == model:
                    got.append(rec)
    finally:
        await psub.unsubscribe()
    assert [r.request_id for r in got] == [r.request_id for r in sent]
    assert got[3] == sent[3]


async def test_ensure_stream_is_idempotent_and_restores_limits(started, nc):
    await started()
    js = nc.jetstream()
    want = stream_config()
    first = await ensure_stream(js, want)
    again = await ensure_stream(js, want)
    assert again.config.max_age == first.config.max_age
    await js.update_stream(first.config.evolve(max_age=3600.0))
    fixed = await ensure_stream(js, want)
    assert fixed.config.max_age == pytest.approx(24 * 3600)


async def test_a_burst_never_blocks_the_publisher(started, nats_server):
    svc = await started()
    model = _model()
    pub = await bus_connect(nats_server.url)
    stuck_nc = await bus_connect(nats_server.url, error_cb=_quiet)
    never = asyncio.Event()

    async def stuck(msg):
        await never.wait()  # a consumer that stopped consuming altogether

    stuck_sub = await stuck_nc.subscribe(subjects.TELEMETRY_REQUESTS, cb=stuck, pending_msgs_limit=100)
    try:
        n = 20_000
        data = encode(_request(model, 0.002))
        for _ in range(n):
            await pub.publish(subjects.TELEMETRY_REQUESTS, data)
        # Every publish reached the server although one consumer is stuck.
        await asyncio.wait_for(pub.flush(), 30)
        assert pub.pending_data_size == 0

        async def all_counted():
            s = await _scrape(svc.metrics_port)
            return s if s.get("tensorbus_requests_total", model=model) == n else None

        await _wait_for(all_counted, timeout=60, what="the burst counted")
        assert stuck_sub.pending_msgs <= 100  # the stuck one dropped, nobody waited on it
        svc._account_subscriptions()
        s = await _scrape(svc.metrics_port)
        assert (s.get("tensorbus_telemetry_dropped_messages_total") or 0) == 0
    finally:
        never.set()
        await pub.close()
        await stuck_nc.close()


async def _quiet(exc: Exception) -> None:
    pass  # the stuck subscriber's slow-consumer errors are expected


async def test_bad_records_are_counted_not_fatal(started, nc):
    svc = await started()
    model = _model()
    await nc.publish(subjects.TELEMETRY_REQUESTS, b"\x00 not msgpack")
    await nc.publish(subjects.TELEMETRY_REQUESTS, msgspec.msgpack.encode({"t": "request"}))
    await nc.publish(subjects.TELEMETRY_REQUESTS, encode(_request(model, 0.1)))

    async def counted():
        s = await _scrape(svc.metrics_port)
        return s if s.get("tensorbus_requests_total", model=model) == 1 else None

    s = await _wait_for(counted, what="the good record")
    assert s.get("tensorbus_telemetry_bad_records_total") == 2


async def test_registered_as_micro_service_and_ready(started, nc):
    svc = await started()
    info = json.loads((await nc.request(f"$SRV.INFO.{SERVICE_NAME}.{svc._micro.id}", b"", timeout=2)).data)
    assert info["metadata"]["metrics_port"] == str(svc.metrics_port)
    inbox = nc.new_inbox()
    replies = await nc.subscribe(inbox)
    await nc.publish(ready_subject(SERVICE_NAME), b"", reply=inbox)

    async def ours():
        body = json.loads((await replies.next_msg(timeout=5)).data)
        return body if body["id"] == svc._micro.id else None

    body = await _wait_for(ours, what="our ready answer")
    await replies.unsubscribe()
    assert body["status"] == "ok" and body["details"]["stream"] is True


async def test_stop_is_idempotent(nats_server):
    tnc = await bus_connect(nats_server.url)
    svc = TelemetryService(tnc, _config(nats_server.url), registry=CollectorRegistry())
    task = asyncio.create_task(svc.run())
    await asyncio.wait_for(svc.started.wait(), 15)
    port = svc.metrics_port
    await asyncio.gather(svc.stop(), svc.stop())
    await svc.stop()
    await task
    with pytest.raises(httpx.TransportError):
        await _scrape(port)
    await tnc.drain()


async def test_module_runs_and_stops_on_sigterm(nats_server, nc):
    port = free_port()
    env = {**os.environ, **_config(nats_server.url, metrics_port=port).to_env(),
           "TENSORBUS_LOG_FORMAT": "json"}
    sub = await nc.subscribe(subjects.TELEMETRY_SUMMARY)
    proc = subprocess.Popen([sys.executable, "-m", "services.telemetry"], env=env,
                            stderr=subprocess.PIPE, text=True)
    try:
        await sub.next_msg(timeout=60)  # a summary: connected, subscribed, ticking

        async def scraped():
            with suppress(httpx.TransportError):
                return await _scrape(port)

        s = await _wait_for(scraped, what="/metrics of the process")
        assert s.get("tensorbus_telemetry_bad_records_total") is not None
        proc.send_signal(signal.SIGTERM)
        rc = await asyncio.to_thread(proc.wait, 30)
        assert rc == 0, proc.stderr.read()
        logs = [json.loads(line) for line in proc.stderr.read().splitlines() if line.startswith("{")]
        assert {"telemetry_started", "telemetry_stopped"} <= {l["event"] for l in logs}
    finally:
        await sub.unsubscribe()
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_decoder_cache_metrics_read_as_vllm_names_them():
    """Running and waiting sequences per worker and per model, KV blocks, and the
    prefix-cache and preemption counters, which move by what each heartbeat adds."""
    from prometheus_client import CollectorRegistry, generate_latest

    from services.telemetry.metrics import TelemetryMetrics

    reg = CollectorRegistry()
    m = TelemetryMetrics(reg, expiry_s=60)

    def beat(worker, running, waiting, queries, hits, preempted, now):
        hb = msgspec.structs.replace(
            _heartbeat(worker, "lm"), in_flight=running, queue_depth=waiting, kv_blocks_total=512,
            kv_blocks_used=40, prefix_cache_queries=queries, prefix_cache_hits=hits,
            preemptions=preempted)
        m.observe_heartbeat(hb, now)

    def value(name, **labels):
        return reg.get_sample_value(name, labels)

    beat("w1", 5, 2, 1000, 600, 1, 0.0)
    beat("w2", 3, 0, 200, 0, 0, 0.0)
    beat("w1", 6, 1, 1500, 900, 1, 1.0)
    assert value("tensorbus_num_requests_running", worker="w1", model="lm") == 6
    assert value("tensorbus_model_num_requests_running", model="lm") == 9
    assert value("tensorbus_model_num_requests_waiting", model="lm") == 1
    assert value("tensorbus_kv_cache_blocks", worker="w1", model="lm") == 512
    assert value("tensorbus_prefix_cache_queries_total", worker="w1", model="lm") == 1500
    assert value("tensorbus_prefix_cache_hits_total", worker="w1", model="lm") == 900
    assert value("tensorbus_num_preemptions_total", worker="w1", model="lm") == 1
    assert b"tensorbus_prefix_cache_hits_total" in generate_latest(reg)
    m.expire_workers(100.0)  # both silent: their series go, the fleet gauges read 0
    assert value("tensorbus_prefix_cache_hits_total", worker="w1", model="lm") is None
    assert value("tensorbus_model_num_requests_running", model="lm") == 0


def test_speculative_decoding_counters_read_as_vllm_names_them():
    """Verify passes, draft tokens and accepted tokens per worker, moving by what
    each heartbeat adds; gone with the worker."""
    from prometheus_client import CollectorRegistry

    from services.telemetry.metrics import TelemetryMetrics

    reg = CollectorRegistry()
    m = TelemetryMetrics(reg, expiry_s=60)

    def beat(drafts, drafted, accepted, now):
        m.observe_heartbeat(msgspec.structs.replace(
            _heartbeat("w1", "lm"), spec_decode_drafts=drafts,
            spec_decode_draft_tokens=drafted, spec_decode_accepted_tokens=accepted), now)

    def value(name):
        return reg.get_sample_value(name, {"worker": "w1", "model": "lm"})

    beat(10, 40, 25, 0.0)
    beat(30, 120, 70, 1.0)
    assert value("tensorbus_spec_decode_num_drafts_total") == 30
    assert value("tensorbus_spec_decode_num_draft_tokens_total") == 120
    assert value("tensorbus_spec_decode_num_accepted_tokens_total") == 70
    m.expire_workers(100.0)
    assert value("tensorbus_spec_decode_num_drafts_total") is None


def test_model_card_reads_speculation_over_live_workers():
    """Acceptance (accepted / draft tokens) and tokens per verify pass, summed over
    the model's workers' heartbeats; 0 when none speculated."""
    from types import SimpleNamespace

    from services.gateway.models import _speculation

    def worker(drafts, drafted, accepted):
        return SimpleNamespace(hb=msgspec.structs.replace(
            _heartbeat("w", "lm"), spec_decode_drafts=drafts,
            spec_decode_draft_tokens=drafted, spec_decode_accepted_tokens=accepted))

    assert _speculation([worker(0, 0, 0)]) == {"spec_decode_acceptance": 0.0,
                                               "spec_decode_tokens_per_step": 0.0}
    got = _speculation([worker(10, 40, 30), worker(10, 40, 10)])
    assert got == {"spec_decode_acceptance": 0.5, "spec_decode_tokens_per_step": 3.0}
