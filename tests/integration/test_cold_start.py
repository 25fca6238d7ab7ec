"""Scaling signals and cold starts over a real nats-server, with the mock engine.

At zero workers a request is held, demand is published at once on
`telemetry.v1.scale`, and the first worker that becomes ready answers it; the
request's own deadline is the only limit. Models that will not get a worker
(`MODEL=0:0`, or `failed` per the orchestrator) are refused at once, and the model
cards say which state each model is in. A worker above the memory threshold gets no
new work until it falls back.
"""

from __future__ import annotations

import asyncio
import time

import httpx
import msgspec

from services.worker.service import Worker
from shared import subjects
from shared.errors import HEADER_CODE
from shared.messages import FleetStatus, ModelStatus, encode
from shared.telemetry import RequestRecord, ScaleDecision, record_decoder
from bench.support.mock_encoder import MockEncoder
from tests.support.stack import running_stack, wait_until

MODEL = "all-MiniLM-L6-v2"
ZERO = dict(min_workers=0, idle_to_zero_s=30.0)


def body(**kw) -> bytes:
    kw.setdefault("model", MODEL)
    kw.setdefault("input", ["hello world"])
    return msgspec.json.encode(kw)


async def ask(nc, data: bytes = b"", timeout: float = 10.0, headers=None):
    msg = await nc.request(subjects.EMBEDDINGS, data or body(), timeout=timeout, headers=headers)
    code = int((msg.headers or {}).get(HEADER_CODE, 200))
    return code, msgspec.json.decode(msg.data)


async def cards(nc) -> dict[str, dict]:
    msg = await nc.request(subjects.MODELS, b"", timeout=2)
    return {c["id"]: c for c in msgspec.json.decode(msg.data)["data"]}


async def eventually(probe, timeout: float = 10.0):
    """Poll an async probe until it returns something truthy."""
    end = time.monotonic() + timeout
    while not (got := await probe()):
        if time.monotonic() > end:
            raise TimeoutError("condition not met in time")
        await asyncio.sleep(0.02)
    return got


class Records:
    """Telemetry records of one kind, as they arrive."""

    def __init__(self, kind) -> None:
        self.kind, self.items, self.sub = kind, [], None

    async def start(self, nc, subject: str) -> "Records":
        async def cb(msg):
            rec = record_decoder.decode(msg.data)
            if isinstance(rec, self.kind):
                self.items.append(rec)

        self.sub = await nc.subscribe(subject, cb=cb)
        await nc.flush()
        return self

    def of(self, model: str) -> list:
        return [r for r in self.items if r.model == model]


async def test_a_request_at_zero_workers_is_held_until_a_worker_starts(nats_server):
    # A long interval: the decision seen below can only be the one sent at once.
    async with running_stack(nats_server.url, scale_interval_s=3600, **ZERO) as st:
        scale = await Records(ScaleDecision).start(st.client, subjects.TELEMETRY_SCALE)
        reqs = await Records(RequestRecord).start(st.client, subjects.TELEMETRY_REQUESTS)
        pending = asyncio.create_task(ask(st.client, timeout=20))
        await wait_until(lambda: any(d.held >= 1 and d.desired_replicas >= 1
                                     for d in scale.of(MODEL)), timeout=5)
        d = scale.of(MODEL)[-1]
        assert d.reason.startswith("cold start") and d.scheduler_id == st.scheduler.id
        assert not pending.done()
        await st.add_worker(MockEncoder(), "late-w1")
        code, resp = await pending
        assert code == 200 and len(resp["data"]) == 1
        await wait_until(lambda: reqs.of(MODEL), timeout=5)
        assert reqs.of(MODEL)[0].hold_s > 0 and reqs.of(MODEL)[0].status == 200


async def test_eight_concurrent_held_requests_are_all_answered(nats_server):
    async with running_stack(nats_server.url, **ZERO) as st:
        reqs = await Records(RequestRecord).start(st.client, subjects.TELEMETRY_REQUESTS)
        pending = [asyncio.create_task(ask(st.client, body(input=[f"q {i}"]), timeout=20))
                   for i in range(8)]
        await wait_until(lambda: len(st.scheduler.holds.by_model.get(MODEL, ())) == 8, timeout=5)
        await st.add_worker(MockEncoder(), "late-w8")
        assert [c for c, _ in await asyncio.gather(*pending)] == [200] * 8
        await wait_until(lambda: len(reqs.of(MODEL)) == 8, timeout=5)
        assert all(r.status == 200 and r.hold_s > 0 for r in reqs.of(MODEL))
        # The histogram's input: every record says how long it waited.
        assert max(r.hold_s for r in reqs.of(MODEL)) < 20


async def test_held_requests_count_against_the_bound_of_one_worker(nats_server):
    async with running_stack(nats_server.url, max_queue_per_worker=4, **ZERO) as st:
        pending = [asyncio.create_task(ask(st.client, body(input=[f"h {i}"]), timeout=20))
                   for i in range(4)]
        await wait_until(lambda: len(st.scheduler.holds.by_model.get(MODEL, ())) == 4, timeout=5)
        code, resp = await ask(st.client, timeout=2)
        assert code == 429 and resp["error"]["code"] == "overloaded"
        await st.add_worker(MockEncoder(), "bound-w1")
        assert [c for c, _ in await asyncio.gather(*pending)] == [200] * 4


async def test_a_held_request_whose_deadline_passes_gets_504(nats_server):
    async with running_stack(nats_server.url, **ZERO) as st:
        reqs = await Records(RequestRecord).start(st.client, subjects.TELEMETRY_REQUESTS)
        t0 = time.monotonic()
        code, resp = await ask(st.client, headers={"Tensorbus-Timeout": "0.5"})
        assert code == 504 and time.monotonic() - t0 < 3
        assert "cold start" in resp["error"]["message"]
        assert resp["error"]["code"] == "deadline_exceeded"
        await wait_until(lambda: reqs.of(MODEL), timeout=5)
        rec = reqs.of(MODEL)[0]
        # Held from the scheduler's receipt to the deadline: all of its time but the
        # trip there (a few ms quiet, ~0.1 s on a loaded machine).
        assert rec.status == 504 and 0.2 <= rec.hold_s <= rec.total_s
        await wait_until(lambda: not st.scheduler.holds.by_model, timeout=5)  # nothing left behind


async def test_a_model_that_is_not_served_is_503_at_once(nats_server):
    async with running_stack(nats_server.url, fleet=f"{MODEL}=0:0") as st:
        scale = await Records(ScaleDecision).start(st.client, subjects.TELEMETRY_SCALE)
        code, resp = await ask(st.client, timeout=2)
        assert code == 503 and "not served" in resp["error"]["message"]
        assert MODEL not in await cards(st.client)
        await wait_until(lambda: scale.of(MODEL), timeout=5)
        assert scale.of(MODEL)[-1].desired_replicas == 0


async def test_a_failed_model_is_503_with_the_reason_and_its_card_says_failed(nats_server):
    why = "TENSORBUS_ENGINE: unknown engine 'tpu'"
    async with running_stack(nats_server.url, **ZERO) as st:
        held = asyncio.create_task(ask(st.client, timeout=10))
        await wait_until(lambda: st.scheduler.holds.by_model.get(MODEL), timeout=5)
        status = FleetStatus("orch-1", [ModelStatus(MODEL, "failed", 0, 1, why)], time.time())
        await st.client.publish(subjects.ORCHESTRATOR_STATUS, encode(status))
        code, resp = await held  # the held one is refused as soon as the model fails
        assert code == 503 and why in resp["error"]["message"]
        await wait_until(lambda: MODEL in st.gateway.front.statuses, timeout=5)
        t0 = time.monotonic()
        code, resp = await ask(st.client, timeout=2)
        assert code == 503 and why in resp["error"]["message"] and time.monotonic() - t0 < 1
        card = (await cards(st.client))[MODEL]
        assert (card["state"], card["reason"], card["ready_workers"]) == ("failed", why, 0)


class PressuredWorker(Worker):
    """A worker whose heartbeats report memory at `fraction` of its limit."""

    fraction = 0.95

    def heartbeat(self):
        hb = super().heartbeat()
        return msgspec.structs.replace(hb, mem_used_bytes=int(self.fraction * 1e9),
                                       mem_limit_bytes=int(1e9), mem_source="host")


async def test_a_worker_above_memory_high_gets_no_new_work_until_it_falls_back(nats_server):
    full, roomy = MockEncoder(), MockEncoder()
    async with running_stack(nats_server.url, memory_high=0.9) as st:
        hot = await st.add_worker(full, "w-full", worker_cls=PressuredWorker)
        await st.add_worker(roomy, "w-roomy")
        results = await asyncio.gather(*(ask(st.client, body(input=[f"x{i}"])) for i in range(40)))
        assert [c for c, _ in results] == [200] * 40
        assert sum(full.batches) == 0 and sum(roomy.batches) == 40
        d = st.scheduler.scaling.decide(MODEL)
        assert d.pressured == 1 and "memory" in d.reason
        hot.fraction = 0.5
        await wait_until(lambda: not st.scheduler.fleet.pressured(
            st.scheduler.fleet.workers["w-full"]), timeout=5)
        results = await asyncio.gather(*(ask(st.client, body(input=[f"y{i}"])) for i in range(40)))
        assert [c for c, _ in results] == [200] * 40 and sum(full.batches) > 0


async def test_model_cards_follow_the_fleet_and_readyz_stays_up_at_zero(nats_server):
    async with running_stack(nats_server.url, **ZERO) as st:
        async with httpx.AsyncClient(base_url=st.http_url, timeout=10) as h:
            r = await h.get("/readyz")
            assert (r.status_code, r.json()) == (200, {"ready": True})
            models = {c["id"]: c for c in (await h.get("/v1/models")).json()["data"]}
            assert models[MODEL]["kind"] == "encoder"
        card = await eventually(lambda: _card_in(st, MODEL, "scaled_to_zero"))
        assert card["ready_workers"] == 0 and card["versions"] == []
        pending = asyncio.create_task(ask(st.client, timeout=20))
        await eventually(lambda: _card_in(st, MODEL, "starting"))
        await st.add_worker(MockEncoder(), "card-w1")
        assert (await pending)[0] == 200
        card = await eventually(lambda: _card_in(st, MODEL, "ready"))
        assert card["ready_workers"] == 1


async def _card_in(st, model: str, state: str):
    card = (await cards(st.client)).get(model)
    return card if card and card["state"] == state else None


async def test_a_registry_model_at_zero_workers_is_listed_and_served_once_one_starts(
        nats_server, tmp_path):
    from tests.integration.test_hot_swap import Built, embed, model_name, push_versions

    name = model_name()
    async with running_stack(nats_server.url, registry=True, **ZERO) as st:
        await push_versions(st.registry, tmp_path, name, 1)
        await st.registry.promote(name, "1")
        await st.scheduler.catalogue.refresh()  # rather than waiting for the next read
        card = await eventually(lambda: _card_in(st, name, "scaled_to_zero"))
        assert (card["kind"], card["ready_workers"]) == ("encoder", 0)
        pending = asyncio.create_task(embed(st.client, name, timeout=20))
        await eventually(lambda: _card_in(st, name, "starting"))
        await st.add_registry_worker(name, Built(), "reg-w1")
        reply = await pending
        assert (reply.code, reply.version) == (200, "1")
