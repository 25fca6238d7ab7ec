"""Fault scenarios against real processes under steady load, with their figures.

tests/reliability/test_faults.py asserts on them; bench/faults.py runs them longer
and keeps the figures. Each scenario runs nats-server, gateway, scheduler and two
encoder workers as separate processes (services/supervisor.py), keeps closed-loop
clients busy over NATS, injects one fault and reports the outcome of every request:

  1. kill:    SIGKILL one worker while it holds work; the scheduler expires it and
              re-dispatches what it held to the other worker.
  2. restart: stop nats-server and start it again on the same port and store; every
              service reconnects by itself.
  3. drain:   SIGTERM one worker (a rolling update): it drains and exits 0.

Each returns one JSON-ready dict: requests sent, succeeded, failed by code, lost (no
answer by the deadline plus a margin) and recovery time.
"""

from __future__ import annotations

import asyncio
import json
import signal
import time
from contextlib import asynccontextmanager
from pathlib import Path

import msgspec

from services.supervisor import Supervisor, wait_ready
from shared import catalog, subjects
from shared.bus import connect
from shared.telemetry import heartbeat_decoder
from bench.support.load import LOST, ClosedLoop, Outcome, one, summary
from bench.support.workload import embed_body, short_inputs

REPO = Path(__file__).resolve().parents[2]
MODEL = catalog.ENCODER
DEADLINE_S = 3.0  # each request's deadline (Tensorbus-Timeout)
MARGIN_S = 2.0  # the client waits this much longer before calling a request lost
ENV = {
    "TENSORBUS_BATCH_BUCKETS": "1,4,16", "TENSORBUS_SEQ_BUCKETS": "16,64,256",
    "TENSORBUS_MAX_BATCH": "16", "TENSORBUS_HEARTBEAT_S": "0.2",
    "TENSORBUS_WORKER_EXPIRY_S": "1.0", "TENSORBUS_HTTP_PORT": "-1", "TENSORBUS_METRICS_PORT": "0",
    "TENSORBUS_DATA_DIR": str(REPO / ".data" / "test-data"),  # compiled buckets cached here
    "TENSORBUS_MODEL_DIR": str(catalog.bundled_dir(MODEL)),  # version "local", no download
    "TENSORBUS_LOG_LEVEL": "info",
    # A decoder compiles the shapes a test does not run where first needed, not on a
    # background thread that would share the cores with the test's own streams.
    "TENSORBUS_COMPILE_AHEAD": "lazy",
}


# ----------------------------------------------------------------- the stack
@asynccontextmanager
async def running(workdir: Path, workers: tuple[str, ...] = ("w1", "w2"), **env: str):
    """(supervisor, client) with gateway, scheduler and `workers` ready."""
    with Supervisor(workdir, env={**ENV, **env}) as sup:
        sup.start_nats()
        sup.start("gateway", "services.gateway")
        sup.start("scheduler", "services.scheduler")
        for wid in workers:
            sup.start(wid, "services.worker", TENSORBUS_WORKER_ID=wid)
        nc = await connect(sup.nats_url, "bench-client")
        try:
            await wait_ready(nc, MODEL, len(workers), timeout=300)
            yield sup, nc
        finally:
            await nc.close()


def load(nc, clients: int) -> ClosedLoop:
    bodies = [embed_body(MODEL, t) for t in short_inputs(256)]
    return ClosedLoop(nc, subjects.EMBEDDINGS, bodies, clients, DEADLINE_S + MARGIN_S,
                      headers={"Tensorbus-Timeout": f"{DEADLINE_S:g}"})


def log_events(sup: Supervisor, name: str, event: str) -> list[dict]:
    """The JSON log lines of one process with `event`."""
    out = []
    for line in (sup.workdir / f"{name}.log").read_text(errors="replace").splitlines():
        try:
            rec = json.loads(line)
        except ValueError:
            continue
        if isinstance(rec, dict) and rec.get("event") == event:
            out.append(rec)
    return out


async def busy_heartbeat(nc, worker_id: str, timeout: float = 30.0) -> None:
    """Until a heartbeat shows `worker_id` holding work."""
    seen = asyncio.Event()

    async def cb(msg) -> None:
        try:
            hb = heartbeat_decoder.decode(msg.data)
        except msgspec.DecodeError:
            return
        if hb.worker_id == worker_id and hb.in_flight + hb.queue_depth > 0:
            seen.set()

    sub = await nc.subscribe(subjects.TELEMETRY_WORKERS, cb=cb)
    try:
        await asyncio.wait_for(seen.wait(), timeout)
    finally:
        await sub.unsubscribe()


async def first_success(nc, timeout: float = 60.0) -> float:
    """When a fresh request (one at a time, sent after the fault) first succeeds."""
    body = embed_body(MODEL, "are you back")
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        o = await one(nc, subjects.EMBEDDINGS, body, 1.0, {"Tensorbus-Timeout": "1"})
        if o.status == 200:
            return o.sent + o.took
        await asyncio.sleep(0.02)
    raise TimeoutError("no request succeeded after the fault")


def in_flight_at(outcomes: list[Outcome], t: float) -> list[Outcome]:
    return [o for o in outcomes if o.sent <= t < o.sent + o.took]


def figures(name: str, outcomes: list[Outcome], started: float, **extra) -> dict:
    took = max(o.sent + o.took for o in outcomes) - started
    return {"scenario": name, **summary(outcomes), "rps": round(len(outcomes) / took, 1), **extra}


# ---------------------------------------------------------------- scenarios
async def kill_worker(sup: Supervisor, nc, victim: str = "w1", clients: int = 16,
                      before: int = 50, after: int = 150) -> dict:
    """SIGKILL `victim` while it holds work; the rest of the fleet answers for it."""
    lg = load(nc, clients).start()
    started = time.monotonic()
    await lg.wait_for(before)
    await busy_heartbeat(nc, victim)
    t_kill = time.monotonic()
    sup.procs[victim].signal(signal.SIGKILL)
    await asyncio.to_thread(sup.procs[victim].wait, 10)
    await lg.wait_for(len(lg.outcomes) + after)
    outcomes = await lg.stop()
    held = in_flight_at(outcomes, t_kill)
    redispatched = sum(r.get("requests", 0) for r in log_events(sup, "scheduler", "redispatching")
                       if r.get("worker_id") == victim)
    expired = log_events(sup, "scheduler", "worker_expired")
    return figures("kill", outcomes, started, clients=clients, in_flight_at_kill=len(held),
                   redispatched=redispatched, victim_expired=any(
                       r.get("worker_id") == victim for r in expired),
                   # until every request in flight at the kill was answered
                   recovery_s=round(max(o.sent + o.took for o in held) - t_kill, 3) if held else 0.0)


async def restart_nats(sup: Supervisor, nc, clients: int = 8, before: int = 50,
                       after: int = 150) -> dict:
    """Stop nats-server under load and start it again on the same port and store."""
    lg = load(nc, clients).start()
    started = time.monotonic()
    await lg.wait_for(before)
    t_down = time.monotonic()
    sup.nats.stop()
    await asyncio.to_thread(sup.nats.start)  # returns once it listens
    t_up = time.monotonic()
    back = await first_success(nc)
    n = len(lg.outcomes)
    await lg.wait_for(n + after, timeout=120)
    outcomes = await lg.stop()
    alive = {name: p.alive() for name, p in sup.procs.items()}
    reconnected = {name: bool(log_events(sup, name, "nats_reconnected")) for name in sup.procs}
    # The bus is at-most-once: a request in the dying server's hands reaches no one,
    # and only its client's timeout ends it. No request sent after the restart may.
    lost_after = sum(1 for o in outcomes if o.status == LOST and o.sent >= t_up)
    return figures("restart", outcomes, started, clients=clients,
                   outage_s=round(t_up - t_down, 3), alive=alive, reconnected=reconnected,
                   lost_sent_after_restart=lost_after,
                   # from the server listening again to the first success of a fresh request
                   recovery_s=round(back - t_up, 3),
                   slowest_answer_s=round(max(o.took for o in outcomes if o.status != LOST), 3))


async def drain_worker(sup: Supervisor, nc, victim: str = "w2", clients: int = 16,
                       before: int = 50, after: int = 100) -> dict:
    """SIGTERM `victim` under load (a rolling update with the other worker up)."""
    lg = load(nc, clients).start()
    started = time.monotonic()
    await lg.wait_for(before)
    await busy_heartbeat(nc, victim)
    t_term = time.monotonic()
    sup.procs[victim].signal(signal.SIGTERM)
    code = await asyncio.to_thread(sup.procs[victim].wait, 60)
    t_exit = time.monotonic()
    await lg.wait_for(len(lg.outcomes) + after)
    outcomes = await lg.stop()
    return figures("drain", outcomes, started, clients=clients, exit_code=code,
                   drain_s=round(t_exit - t_term, 3),
                   stopped_logged=bool(log_events(sup, victim, "stopped")))
