"""One request's log lines, joined across gateway, scheduler and worker processes.

Real processes (services/supervisor.py) with JSON logs at debug level, the real
encoder on one small shape bucket. A client sends `X-Request-Id`; its id leads the
wire id the request travels under, so one grep finds the request in every service,
and the gateway's `wire_id` joins exactly.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid

import msgspec
import nats

from services.supervisor import Supervisor, wait_ready
from shared import catalog, subjects
from shared.errors import HEADER_CODE
from shared.natsd import free_port
from tests.support.bus import connect as bus_connect

ENCODER = catalog.ENCODER


def lines(sup: Supervisor, name: str) -> list[dict]:
    out = []
    for raw in sup.procs[name].log_path.read_text().splitlines():
        if raw.startswith("{"):
            out.append(json.loads(raw))
    return out


async def test_one_requests_lines_join_across_gateway_scheduler_and_worker(tmp_path):
    client_id = f"trace-{uuid.uuid4().hex[:8]}"
    with Supervisor(tmp_path, env={"TENSORBUS_LOG_LEVEL": "debug",
                                   "TENSORBUS_HTTP_PORT": str(free_port()),
                                   "TENSORBUS_BATCH_BUCKETS": "1",
                                   "TENSORBUS_SEQ_BUCKETS": "16",
                                   "TENSORBUS_MAX_BATCH": "1"}) as sup:
        sup.start_nats()
        sup.start("gateway", "services.gateway")
        sup.start("scheduler", "services.scheduler")
        sup.start("worker", "services.worker", TENSORBUS_WORKER_ID="w-logs",
                  TENSORBUS_MODEL_DIR=str(catalog.bundled_dir(ENCODER)))
        nc = await bus_connect(sup.nats_url)
        try:
            await wait_ready(nc, ENCODER, timeout=240)
            msg = await nc.request(subjects.EMBEDDINGS, msgspec.json.encode(
                {"model": ENCODER, "input": ["follow me"]}), timeout=30,
                headers={"X-Request-Id": client_id})
            assert (msg.headers or {}).get(HEADER_CODE) is None
        finally:
            await nc.close()

        def mine(name: str) -> list[dict]:
            return [x for x in lines(sup, name) if str(x.get("request_id", "")).startswith(client_id)]

        end = time.monotonic() + 20
        while not (mine("gateway") and mine("scheduler") and mine("worker")):
            assert time.monotonic() < end, "a service never logged the request"
            await asyncio.sleep(0.05)  # polling the log files for the lines to land

        gateway = mine("gateway")
        assert {x["service"] for x in gateway} == {"gateway"}
        assert all(x["request_id"] == client_id for x in gateway)  # the client's own id
        events = [x["event"] for x in gateway]
        assert "request_submitted" in events and "request_finished" in events
        (submitted,) = [x for x in gateway if x["event"] == "request_submitted"]
        wire = submitted["wire_id"]
        assert wire.startswith(client_id)
        (finished,) = [x for x in gateway if x["event"] == "request_finished"]
        assert finished["status"] == 200 and finished["worker"] == "w-logs"
        # The exact join: the wire id names the request in the scheduler and the worker.
        sched = [x for x in lines(sup, "scheduler") if x.get("request_id") == wire]
        worker = [x for x in lines(sup, "worker") if x.get("request_id") == wire]
        assert [(x["service"], x["event"]) for x in sched] == [("scheduler", "request_dispatched")]
        assert sched[0]["worker"] == "w-logs"
        assert ("worker", "request_received") in [(x["service"], x["event"]) for x in worker]
        # Every joined line is one JSON object with a timestamp and a level.
        for x in gateway + sched + worker:
            assert x["timestamp"].endswith("Z") and x["level"] == "debug"
