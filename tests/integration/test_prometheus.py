"""The dashboards and the autoscaler's queries, evaluated by a real Prometheus.

A running stack (gateway, scheduler, the mock encoder served as `all-MiniLM-L6-v2`, a
tiny real decoder) and the real telemetry service; Debian's Prometheus scrapes the
telemetry service's /metrics every 0.5 s. Under load, every panel of
deploy/grafana/tensorbus.json must return data, and the ScaledObjects' exact queries
in deploy/k8s/base/scaling.yaml must return the desired count KEDA then acts on.
"""

from __future__ import annotations

import asyncio
import json
import math
from contextlib import AsyncExitStack
from pathlib import Path

import msgspec
import pytest
import pytest_asyncio
import yaml

from shared import catalog, subjects
from shared.errors import HEADER_CODE
from bench.support.mock_encoder import MockEncoder
from tests.support.prometheus import running_prometheus
from tests.support.stack import running_stack
from tests.support.telemetry import running_telemetry
from tests.support.tiny_models import serve_tiny

REPO = Path(__file__).resolve().parents[2]
DASHBOARD = REPO / "deploy" / "grafana" / "tensorbus.json"
SCALING = REPO / "deploy" / "k8s" / "base" / "scaling.yaml"
ENCODER = "all-MiniLM-L6-v2"
DECODER = "tiny-gpt2"
CONTEXT = 1024  # as tests/integration/test_generation.py: its compiled buckets are reused
TARGET_QUEUE = 4  # TENSORBUS_TARGET_QUEUE_PER_REPLICA here: small, so load asks for several
IDLE_S = 1.0  # TENSORBUS_IDLE_TO_ZERO_S here (with a fleet minimum of 0)
COLD = catalog.DEMO_LM  # a catalogue model no worker serves here: its requests are held
# Grafana's variables, as a dashboard user with "All" models would have them.
VARIABLES = {"$__rate_interval": "15s", "$model": ".*"}


@pytest.fixture(scope="module")
def decoder(tmp_path_factory, jax_cache_dir):
    path = tmp_path_factory.mktemp("tiny-gpt2")
    _, engine = serve_tiny("gpt2", path, DECODER, CONTEXT)
    return engine, str(path)


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def observed(nats_server, decoder):
    """(stack, encoder engine, prometheus) with the telemetry service in between."""
    engine, path = decoder
    encoder = MockEncoder(ENCODER)
    async with AsyncExitStack() as ex:
        st = await ex.enter_async_context(running_stack(
            nats_server.url, models={DECODER: path}, max_context=CONTEXT, decode_slots=4,
            target_queue_per_replica=TARGET_QUEUE, min_workers=0, idle_to_zero_s=IDLE_S))
        await st.add_worker(encoder, "enc-1")
        await st.add_worker(engine, "dec-1", kind="decoder")
        telemetry = await ex.enter_async_context(running_telemetry(
            nats_server.url, cost_per_hour="2.5"))  # priced, so the cost panel has data
        prom = await ex.enter_async_context(
            running_prometheus([f"127.0.0.1:{telemetry.metrics_port}"], interval_s=0.5))
        try:
            yield st, encoder, prom
        finally:
            encoder.gate.set()  # never leave the engine thread parked


async def ask(nc, subject: str, payload: dict, timeout: float = 30.0, headers=None) -> int:
    msg = await nc.request(subject, msgspec.json.encode(payload), timeout=timeout,
                           headers=headers)
    return int((msg.headers or {}).get(HEADER_CODE, 200))


async def load(nc, stop: asyncio.Event) -> dict[int, int]:
    """Embeddings, generations and some failures, until `stop`; counts by status."""
    codes: dict[int, int] = {}
    i = 0
    while not stop.is_set():
        i += 1
        got = await asyncio.gather(
            ask(nc, subjects.EMBEDDINGS, {"model": ENCODER, "input": [f"text {i}", "more"]}),
            ask(nc, subjects.COMPLETIONS, {"model": DECODER, "prompt": f"the quick {i}",
                                           "max_tokens": 6}),
            ask(nc, subjects.CHAT_COMPLETIONS, {"model": DECODER, "max_tokens": 4,
                                                "messages": [{"role": "user", "content": "hi"}]}),
            ask(nc, subjects.EMBEDDINGS, {"model": ENCODER, "input": []}),  # 400
            # Held for a cold start that never comes here: 504 at its deadline.
            ask(nc, subjects.COMPLETIONS, {"model": COLD, "prompt": "hello", "max_tokens": 2},
                headers={"Tensorbus-Timeout": "0.3"}),
        )
        for code in got:
            codes[code] = codes.get(code, 0) + 1
    return codes


def panel_queries() -> list[tuple[str, str]]:
    dash = json.loads(DASHBOARD.read_text())
    out = []
    for panel in dash["panels"]:
        for target in panel["targets"]:
            expr = target["expr"]
            for name, value in VARIABLES.items():
                expr = expr.replace(name, value)
            out.append((panel["title"], expr))
    return out


def has_numbers(result: list[dict]) -> bool:
    return any(math.isfinite(float(r["value"][1])) for r in result)


async def test_every_dashboard_panel_returns_data_under_load(observed):
    st, _, prom = observed
    queries = panel_queries()
    assert len({title for title, _ in queries}) >= 12
    leftover = [expr for _, expr in queries if "$" in expr]
    assert not leftover, f"unknown dashboard variables in {leftover}"
    stop = asyncio.Event()
    loader = asyncio.create_task(load(st.client, stop))
    try:
        for title, expr in queries:
            result = await prom.wait_for(expr, has_numbers, timeout=60)
            assert result, title
    finally:
        stop.set()
        codes = await loader
    assert codes.get(200, 0) > 0 and codes.get(400, 0) > 0 and set(codes) == {200, 400, 504}
    # What a person reads off the panels: errors by their code, versions side by side.
    errors = await prom.query(dict(queries)["Errors by code (requests/s)"])
    assert {(r["metric"]["status"], r["metric"]["model"]) for r in errors} == {
        ("400", ENCODER), ("504", COLD)}
    by_version = await prom.query(dict(queries)["Canary vs prod: served requests/s by version"])
    assert {r["metric"]["model"] for r in by_version} >= {ENCODER, DECODER}
    assert all("version" in r["metric"] for r in by_version if r["metric"]["model"] == DECODER)


def keda_triggers(model: str) -> tuple[dict, list[dict]]:
    """The ScaledObject whose triggers query `model`, and those triggers."""
    for so in yaml.safe_load_all(SCALING.read_text()):
        if so and any(f'model="{model}"' in t["metadata"]["query"] for t in so["spec"]["triggers"]):
            return so, so["spec"]["triggers"]
    raise AssertionError(f"no ScaledObject for {model}")


def keda_replicas(so: dict, values: dict[str, float]) -> int:
    """What KEDA and the HPA make of the triggers' metric values (AverageValue):
    a trigger is active above its activationThreshold; with none active and
    minReplicaCount 0 the Deployment goes to zero; otherwise each trigger asks for
    ceil(value / threshold) and the HPA takes the largest, within min and max."""
    spec = so["spec"]
    asks, active = [], False
    for trig in spec["triggers"]:
        meta, value = trig["metadata"], values[trig["name"]]
        active |= value > float(meta.get("activationThreshold", "0"))
        asks.append(math.ceil(value / float(meta["threshold"])))
    if not active and spec["minReplicaCount"] == 0:
        return 0
    return min(max(max(asks), spec["minReplicaCount"], 1), spec["maxReplicaCount"])


async def keda_values(prom, triggers) -> dict[str, float]:
    out = {}
    for trig in triggers:
        result = await prom.query(trig["metadata"]["query"])
        assert len(result) <= 1, result  # KEDA wants one value
        # ignoreNullValues "false": an empty result is an error toward the fallback,
        # so the queries must return a sample whenever telemetry is scraped, idle too.
        if trig["metadata"].get("ignoreNullValues", "true") == "false":
            assert result, f"{trig['metadata']['query']} came back empty"
        out[trig["name"]] = float(result[0]["value"][1]) if result else 0.0
    return out


async def test_keda_queries_follow_load_and_go_to_zero_when_idle(observed):
    st, encoder, prom = observed
    so, triggers = keda_triggers(ENCODER)
    assert so["spec"]["minReplicaCount"] == 0
    desired_q = next(t for t in triggers if "desired_replicas" in t["metadata"]["query"])
    query = desired_q["metadata"]["query"]

    # Under load: the engine is held, so 12 single-input requests stay queued or in flight.
    outstanding = 12
    encoder.gate.clear()
    calls = [asyncio.create_task(ask(st.client, subjects.EMBEDDINGS,
                                     {"model": ENCODER, "input": [f"held {i}"]}))
             for i in range(outstanding)]
    try:
        expected = math.ceil(outstanding / TARGET_QUEUE)
        await prom.wait_for(query, lambda r: bool(r) and float(r[0]["value"][1]) == expected)
        values = await keda_values(prom, triggers)
        assert values[desired_q["name"]] == expected
        assert keda_replicas(so, values) == expected  # 3 workers for 12 queued at 4 each
    finally:
        encoder.gate.set()
    assert await asyncio.gather(*calls) == [200] * outstanding

    # Idle: with a fleet minimum of 0, the scheduler asks for 0 once the model has been
    # idle for TENSORBUS_IDLE_TO_ZERO_S, and the same query says so.
    await prom.wait_for(query, lambda r: bool(r) and float(r[0]["value"][1]) == 0)
    values = await keda_values(prom, triggers)
    assert values == {t["name"]: 0.0 for t in triggers}
    assert keda_replicas(so, values) == 0


def test_keda_formula_matches_the_documented_behaviour():
    so, _ = keda_triggers(ENCODER)
    names = [t["name"] for t in so["spec"]["triggers"]]
    at = lambda desired, queue: keda_replicas(so, dict(zip(names, (desired, queue))))  # noqa: E731
    assert at(0, 0) == 0  # idle: scaled to zero
    assert at(1, 0) == 1  # activation: one wanted, one started
    assert at(3, 5) == 3
    assert at(0, 40) == 2  # the queue backstop alone: ceil(40 / 32)
    assert at(100, 0) == so["spec"]["maxReplicaCount"]


def test_every_scaled_object_can_reach_zero_and_wake_on_the_desired_count():
    scaled = [so for so in yaml.safe_load_all(SCALING.read_text()) if so]
    assert len(scaled) == 2
    for so in scaled:
        assert so["spec"]["minReplicaCount"] == 0 and so["spec"]["cooldownPeriod"] > 0
        (desired,) = [t for t in so["spec"]["triggers"]
                      if "tensorbus_model_desired_replicas" in t["metadata"]["query"]]
        assert float(desired["metadata"]["activationThreshold"]) < 1  # one wanted wakes it
        assert float(desired["metadata"]["threshold"]) == 1  # replicas = desired
