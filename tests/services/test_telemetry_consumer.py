"""`tensorbus telemetry tail|replay` as a user runs it: a real subprocess against a real
nats-server, with the real telemetry service keeping the TELEMETRY stream.

Each test uses its own model name, so other tests' records on the shared server never
mix in (every command here filters with --model)."""

from __future__ import annotations

import asyncio
import json
import os
import re
import sys
import time
import uuid
from contextlib import suppress
from pathlib import Path

import pytest

from services.telemetry.consumer import parse_duration
from shared import subjects
from shared.natsd import NatsServer, free_port
from shared.telemetry import (Heartbeat, ModelSummary, RequestRecord, ScaleDecision, Summary,
                              encode)
from tests.support.telemetry import running_telemetry

REPO = Path(__file__).resolve().parents[2]


def _model() -> str:
    return f"m-{uuid.uuid4().hex[:8]}"


def _request(model: str, status: int = 200) -> RequestRecord:
    return RequestRecord(
        request_id=uuid.uuid4().hex, endpoint="embeddings", model=model, version="1",
        worker_id="w1", status=status, error_code="" if status < 400 else "overloaded",
        total_s=0.01, queue_s=0.001, batch_wait_s=0.002, compute_s=0.005, prompt_tokens=7,
        completion_tokens=0, batch_size=2, finished_at=time.time())


def _heartbeat(model: str) -> Heartbeat:
    return Heartbeat(worker_id="w1", model=model, kind="encoder", state="ready",
                     versions=["1"], queue_depth=3, in_flight=1, max_batch=8,
                     batch_occupancy=0.5, steps=9, rss_bytes=1 << 20, device="cpu",
                     sent_at=time.time())


def _scale(model: str, desired: int) -> ScaleDecision:
    return ScaleDecision(model=model, ready_replicas=1, desired_replicas=desired,
                         queue_depth=40, in_flight=2, reason="queue", at=time.time())


async def _cli(nats_url: str, *args: str, timeout: float = 30.0) -> tuple[int, list[dict], str]:
    """Run `python -m services.cli telemetry ARGS`; (exit code, JSON lines, stderr)."""
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "services.cli", "telemetry", *args, cwd=REPO,
        env={**os.environ, "TENSORBUS_NATS_URL": nats_url},
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    out, err = await asyncio.wait_for(proc.communicate(), timeout)
    return proc.returncode, [json.loads(line) for line in out.splitlines()], err.decode()


async def _publish_all(nc, records) -> None:
    """Publish with core NATS like the services do; the last one through JetStream, whose
    ack says the stream holds it (and, same connection, everything before it)."""
    *rest, last = records
    for subject, rec in rest:
        await nc.publish(subject, encode(rec))
    await nc.jetstream().publish(last[0], encode(last[1]))


async def test_replay_prints_every_kind_as_json_lines_and_exits(nats_server, nc):
    model, other = _model(), _model()
    reqs = [_request(model), _request(model, status=429), _request(other)]
    async with running_telemetry(nats_server.url, summary_interval_s=0.2):
        await nc.publish(subjects.TELEMETRY_REQUESTS, b"\x00 not a record")  # skipped
        await _publish_all(nc, [
            *((subjects.TELEMETRY_REQUESTS, r) for r in reqs),
            (subjects.TELEMETRY_WORKERS, _heartbeat(model)),
            (subjects.TELEMETRY_SCALE, _scale(model, 2)),
        ])
        started = time.monotonic()
        rc, lines, err = await _cli(nats_server.url, "replay", "--since", "1m", "--model", model)
    assert rc == 0, err
    assert time.monotonic() - started < 20  # ended by itself at the end of the stream
    kinds = [line["kind"] for line in lines]
    assert {"request", "worker", "scale"} <= set(kinds)
    requests = [line for line in lines if line["kind"] == "request"]
    assert [r["request_id"] for r in requests] == [r.request_id for r in reqs[:2]]
    assert [r["status"] for r in requests] == [200, 429]
    assert all(line.get("model", model) == model for line in lines)
    (scale,) = [line for line in lines if line["kind"] == "scale"]
    assert scale["desired_replicas"] == 2 and scale["reason"] == "queue"


async def test_replay_filters_by_kind_and_keeps_only_the_models_summary_entry(nats_server, nc):
    model = _model()
    summary = Summary(window_s=60.0, at=time.time(), models=[
        ModelSummary(model="someone-else", requests=1, errors=0, throughput_rps=1.0,
                     p50_s=0.1, p95_s=0.1, p99_s=0.1, tokens_per_s=3.0),
        ModelSummary(model=model, requests=5, errors=1, throughput_rps=2.0, p50_s=0.01,
                     p95_s=0.02, p99_s=0.03, tokens_per_s=9.0)])
    async with running_telemetry(nats_server.url):
        await _publish_all(nc, [
            (subjects.TELEMETRY_REQUESTS, _request(model)),
            (subjects.TELEMETRY_SCALE, _scale(model, 3)),
            (subjects.TELEMETRY_SUMMARY, summary),
        ])
        rc, scales, err = await _cli(nats_server.url, "replay", "--since", "30s",
                                     "--kind", "scale", "--model", model)
        assert rc == 0, err
        assert [(s["kind"], s["desired_replicas"]) for s in scales] == [("scale", 3)]
        rc, sums, err = await _cli(nats_server.url, "replay", "--since", "30s",
                                   "--kind", "summary,request", "--model", model)
    assert rc == 0, err
    assert {s["kind"] for s in sums} == {"summary", "request"}
    mine = [s for s in sums if s["kind"] == "summary" and s["at"] == summary.at]
    assert [m["model"] for m in mine[0]["models"]] == [model]
    assert mine[0]["models"][0]["requests"] == 5


async def test_replay_with_nothing_in_range_exits_at_once(nats_server, nc):
    async with running_telemetry(nats_server.url):
        rc, lines, err = await _cli(nats_server.url, "replay", "--since", "5s",
                                    "--model", _model(), timeout=15)
    assert (rc, lines) == (0, []), err


async def test_tail_prints_live_records_as_they_arrive(nats_server, nc):
    model = _model()
    async with running_telemetry(nats_server.url, summary_interval_s=0.2):
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "services.cli", "telemetry", "tail", "--model", model,
            "--kind", "request", "--kind", "summary", "--limit", "3", cwd=REPO,
            env={**os.environ, "TENSORBUS_NATS_URL": nats_server.url},
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
        try:
            banner = await asyncio.wait_for(proc.stderr.readline(), 20)
            assert banner.startswith(b"tailing"), banner
            sent = [_request(model), _request(model)]
            for rec in sent:
                await nc.publish(subjects.TELEMETRY_REQUESTS, encode(rec))
            await nc.publish(subjects.TELEMETRY_SCALE, encode(_scale(model, 1)))  # filtered
            await nc.flush()
            # Each line arrives on its own (flushed per record): our two requests and
            # the real telemetry service's next summary with our model, which may come
            # between them when the service summarised after the first.
            lines = [json.loads(await asyncio.wait_for(proc.stdout.readline(), 10))
                     for _ in range(3)]  # fmt: skip
            assert await asyncio.wait_for(proc.wait(), 10) == 0  # --limit 3 reached
        finally:
            with suppress(ProcessLookupError):  # it may have ended on its own
                proc.kill()
            await proc.wait()
    first = [x for x in lines if x["kind"] == "request"]
    assert [x["request_id"] for x in first] == [r.request_id for r in sent]
    (third,) = [x for x in lines if x["kind"] == "summary"]
    assert [m["model"] for m in third["models"]] == [model]
    assert 1 <= third["models"][0]["requests"] <= 2  # a summary may fall between the two


async def test_a_bad_duration_or_kind_is_a_usage_error(nats_server):
    rc, lines, err = await _cli(nats_server.url, "replay", "--since", "ten minutes")
    assert rc == 2 and "bad duration" in err and lines == []
    rc, _, err = await _cli(nats_server.url, "tail", "--kind", "heartbeat")
    assert rc == 2 and "unknown kind" in err


async def test_the_documented_nats_py_consumer_reads_the_stream(nats_server, nc, tmp_path):
    """docs/telemetry.md's example, run as written (only the server address changed)."""
    text = (REPO / "docs" / "telemetry.md").read_text()
    (example,) = re.findall(r"```python\n(.*?)```", text, flags=re.S)
    assert '"nats://127.0.0.1:4222"' in example
    script = tmp_path / "consumer.py"
    script.write_text(example.replace('"nats://127.0.0.1:4222"', repr(nats_server.url)))
    model = _model()
    bad, good = _request(model, status=429), _request(model)
    want = [f"failed {bad.request_id} 429", f"ok {model}"]  # what the example prints
    async with running_telemetry(nats_server.url):
        await _publish_all(nc, [(subjects.TELEMETRY_REQUESTS, bad),
                                (subjects.TELEMETRY_REQUESTS, good)])
        proc = await asyncio.create_subprocess_exec(
            sys.executable, str(script), cwd=REPO, stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE)
        try:
            # The last 10 minutes of this shared server hold other tests' records too.
            found = []
            while len(found) < len(want):
                line = (await asyncio.wait_for(proc.stdout.readline(), 20)).decode()
                assert line, (await proc.stderr.read()).decode()
                found += [w for w in want if line.startswith(w)]
        finally:
            with suppress(ProcessLookupError):  # it may have ended on its own
                proc.kill()
            await proc.wait()
    assert found == want  # in the order they were published


async def test_replay_without_the_stream_says_why(tmp_path):
    with NatsServer(tmp_path) as bare:  # JetStream, but no telemetry service ever ran
        rc, lines, err = await _cli(bare.url, "replay", "--since", "1m", timeout=20)
    assert rc == 1 and lines == [] and "no TELEMETRY stream" in err


async def test_no_nats_server_is_a_clear_error_not_a_hang():
    url = f"nats://127.0.0.1:{free_port()}"
    rc, lines, err = await _cli(url, "replay", "--since", "1m", timeout=20)
    assert rc == 1 and lines == [] and f"cannot reach NATS at {url}" in err


@pytest.mark.parametrize("text,seconds", [("90s", 90), ("10m", 600), ("2h", 7200),
                                          ("1h30m", 5400), ("45", 45), ("0.5s", 0.5)])
def test_durations(text, seconds):
    assert parse_duration(text) == seconds
