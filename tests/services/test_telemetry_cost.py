"""Cost per 1M input and output tokens: the real telemetry service on a real
nats-server, heartbeats and request records as the fleet publishes them, the gauges
read from its `/metrics`."""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from services.telemetry.service import TelemetryService
from shared import subjects
from shared.config import EX_CONFIG, Config
from shared.telemetry import Heartbeat, RequestRecord, encode
from tests.support.telemetry import running_telemetry

LM, ENC = "cost-lm", "cost-enc"


def heartbeat(worker: str, model: str, device: str, kind: str) -> Heartbeat:
    return Heartbeat(worker_id=worker, model=model, kind=kind, state="ready", versions=["1"],
                     queue_depth=0, in_flight=0, max_batch=8, batch_occupancy=0.0, steps=1,
                     rss_bytes=1, device=device, sent_at=time.time())


def generation(prompt: int, completion: int) -> RequestRecord:
    # Worker: 0.1 s queued, first token 0.4 s after arrival (0.3 s prefill), 1.5 s of
    # compute in all (1.2 s decode).
    return RequestRecord(request_id="r", endpoint="completions", model=LM, version="1",
                         worker_id="w", status=200, error_code="", total_s=2.0, queue_s=0.1,
                         batch_wait_s=0.0, compute_s=1.5, prompt_tokens=prompt,
                         completion_tokens=completion, ttft_s=0.6, worker_ttft_s=0.4)


def embedding(tokens: int) -> RequestRecord:
    return RequestRecord(request_id="e", endpoint="embeddings", model=ENC, version="1",
                         worker_id="e", status=200, error_code="", total_s=0.05, queue_s=0.0,
                         batch_wait_s=0.0, compute_s=0.02, prompt_tokens=tokens,
                         completion_tokens=0)


async def gauges(port: int) -> dict[tuple[str, str], float]:
    async with httpx.AsyncClient() as http:
        text = (await http.get(f"http://127.0.0.1:{port}/metrics")).text
    return {(s.name, s.labels.get("model", "")): s.value
            for fam in text_string_to_metric_families(text) for s in fam.samples
            if s.name.startswith("tensorbus_cost_per_million")}


async def test_cost_per_million_tokens_from_worker_prices_split_by_prefill_and_decode(
        nats_server, nc):
    # Two LM workers, one on a GPU priced by device kind, one on a CPU at the model's
    # own price; the encoder's worker at the default price.
    price = "0.5,cuda=4.0,cost-lm=1.0"
    async with running_telemetry(nats_server.url, cost_per_hour=price,
                                 summary_interval_s=3600.0, worker_expiry_s=3600.0) as tel:
        for hb in (heartbeat("g", LM, "cuda:0", "decoder"), heartbeat("c", LM, "cpu", "decoder"),
                   heartbeat("e", ENC, "cpu", "encoder")):
            await nc.publish(subjects.TELEMETRY_WORKERS, encode(hb))
        for _ in range(10):
            await nc.publish(subjects.TELEMETRY_REQUESTS, encode(generation(100, 40)))
            await nc.publish(subjects.TELEMETRY_REQUESTS, encode(embedding(30)))
        await nc.flush()

        def all_seen() -> bool:
            merged = tel.window.merged()
            return (len(tel.metrics.workers()) == 3
                    and all(m in merged and merged[m].requests == 10 for m in (LM, ENC)))

        end = time.monotonic() + 10
        while not all_seen():
            assert time.monotonic() < end, "the records and heartbeats never all arrived"
            await asyncio.sleep(0.05)
        await tel.publish_summary()  # the periodic one is an hour away: this one sets the gauges
        summary = tel.last_summary
        lm = next(m for m in summary.models if m.model == LM)
        enc = next(m for m in summary.models if m.model == ENC)
        hours = summary.window_s / 3600
        # The model-specific price wins over the device kind: both LM workers cost 1.0/h.
        spent = 2 * 1.0 * hours
        assert lm.cost_per_1m_tokens == pytest.approx(spent / 1400 * 1e6)
        assert lm.cost_per_1m_input_tokens == pytest.approx(spent * 0.3 / 1.5 / 1000 * 1e6)
        assert lm.cost_per_1m_output_tokens == pytest.approx(spent * 1.2 / 1.5 / 400 * 1e6)
        # An encoder's engine time is all input.
        assert enc.cost_per_1m_input_tokens == pytest.approx(0.5 * hours / 300 * 1e6)
        assert enc.cost_per_1m_output_tokens == 0.0

        g = await gauges(tel.metrics_port)
        assert g[("tensorbus_cost_per_million_input_tokens", LM)] == pytest.approx(
            lm.cost_per_1m_input_tokens)
        assert g[("tensorbus_cost_per_million_output_tokens", LM)] == pytest.approx(
            lm.cost_per_1m_output_tokens)
        assert g[("tensorbus_cost_per_million_input_tokens", ENC)] == pytest.approx(
            enc.cost_per_1m_input_tokens)
        # No output tokens: no series, rather than a claim that they cost nothing.
        assert ("tensorbus_cost_per_million_output_tokens", ENC) not in g


def test_the_device_kind_price_applies_when_the_model_has_none():
    c = Config(cost_per_hour="0.5,cuda=4.0,cost-lm=1.0")
    assert c.worker_price("other", "cuda:1") == 4.0
    assert c.worker_price("other", "cpu") == 0.5
    assert c.worker_price(LM, "cuda:0") == 1.0
    assert Config(cost_per_hour="2.5").worker_price("any", "cuda:0") == 2.5  # the plain number


@pytest.mark.parametrize("bad", ["abc", "1,gpu=x", "-1", "1,cost-lm=-2"])
async def test_a_malformed_price_stops_the_service_with_exit_78(nc, bad):
    with pytest.raises(SystemExit) as exc:
        TelemetryService(nc, Config(cost_per_hour=bad))
    assert exc.value.code == EX_CONFIG
