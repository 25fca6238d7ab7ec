"""A request's life in the gateway, after its endpoint has prepared it: dispatch to
the scheduler, and what the gateway holds for it meanwhile.

  1. `Call.open` (services.gateway.call) gives the request its ids and its
     `deadline`; the endpoint's pipeline decodes and validates the body and asks the
     gateway's admission (`self.admission`, services.gateway.admission) before and
     around tokenizing; a large body is tokenized off the loop (`tokenize`).
  2. `call` (one answer) or `dispatched` + `submit` (a stream): open the request's
     queue in the reply inbox, count it as waiting, and publish its WorkRequest to
     the scheduler (to the one holding its reservation, if any) with the inbox as
     the reply; a gateway cut off from the bus says so at once (503).
  3. The answers are read off that queue (services.gateway.inbox: results, hold
     notices, refusals, the deadline's 504 and its Cancel).
  4. `record`: one RequestRecord to telemetry when the request ends, with its
     latency breakdown and time held for a cold start.
Also here: the model list (`GET /v1/models`), built from what the gateway has heard.
"""

from __future__ import annotations

import asyncio
import os
import re
import time
from contextlib import contextmanager

from nats.aio.client import Client

from services.fleet import Fleet
from services.gateway.admission import GatewayAdmission
from services.gateway.inbox import NoScheduler, PathLost, ReplyInbox
from services.gateway.schedulers import NO_SCHEDULER_TRIES, SchedulerLinks
from services.gateway.models import ModelTable
from services.gateway.outcome import Outcome
from services.gateway.recorder import Recorder
from services.gateway.structured_limits import Compiler, SchemaLimits
from shared import subjects
from shared.bus import Links
from shared.api_models import ModelList
from shared.config import Config
from shared.errors import deadline_exceeded, too_large, unavailable
from shared.logging import get_logger
from shared.messages import ModelStatus, encode
from shared.scaling import LiveDecisions
from shared.telemetry import RequestRecord
from shared.telemetry import encode as encode_record

log = get_logger("gateway")


def new_request_id() -> str:
    """32 random hex digits, as uuid4().hex but without building a UUID object."""
    return os.urandom(16).hex()


_UNSAFE = re.compile(r"[^A-Za-z0-9_-]")
INLINE_TOKENIZE = 2_048  # bodies up to this many bytes are tokenized on the event loop
# (a 6 KB body of eight long inputs takes the tokenizer about a millisecond: on the
# loop, a burst's first admitted requests would hold every refusal behind them)
MAX_SUBMITS = 3  # a retryable call is sent again at most this many times after a lost path
USER_HEADER = "Tensorbus-User"  # sticky canary key for clients that cannot set `user`
MAX_USER = 256


def user_key(body_user: str | None, header: str | None) -> str:
    """Whom a request is for, for a sticky canary draw: OpenAI's `user` field, else
    the Tensorbus-User header, else "" (an independent draw)."""
    return (body_user or header or "")[:MAX_USER]


def wire_id(client_id: str | None) -> str:
    """The id a request travels under: unique, and a single NATS subject token.

    A client's X-Request-Id stays the id of logs and telemetry, but it may repeat
    (two requests would share one inbox and scheduler entry) or hold characters a
    subject cannot (dots, spaces, wildcards). The wire id starts with its safe
    characters, so worker logs still show it."""
    unique = new_request_id()
    if not client_id:
        return unique
    return f"{_UNSAFE.sub('_', client_id)[:40]}-{unique[:16]}"


class Frontend:
    def __init__(self, nc: Client, config: Config, fleet: Fleet | None = None,
                 models: ModelTable | None = None) -> None:
        self.nc = nc
        self.config = config
        self.fleet = fleet or Fleet(expiry_s=config.worker_expiry_s)
        self.models = models or ModelTable(self.fleet)
        self.inbox = ReplyInbox(nc)
        self.links = Links(nc)  # a dropped connection: retryable requests ask again
        self.links.on_drop.append(self.inbox.path_lost)
        self.recorder = Recorder(nc, self.links)  # request records, acked when stored
        self.retried = 0  # calls submitted again after their (or a scheduler's) path dropped
        self.resumed = 0  # streams resumed after their path broke or their worker was lost
        self.given_up = 0  # generations ended at the re-dispatch cap (TENSORBUS_MAX_REDISPATCH)
        self.schedulers = SchedulerLinks(lambda: self.inbox.path_lost(own=False),
                                         config.worker_expiry_s)
        self.admission = GatewayAdmission(nc, config, self.fleet, self.inbox.cancel)
        self._tokenizing = asyncio.Semaphore(2)  # large inputs tokenized at once
        self.grammars = Compiler(SchemaLimits(config.max_schema_bytes, config.max_schema_depth,
                                              config.max_schema_compile_s))
        self.decisions = LiveDecisions()  # the schedulers' scale decisions (model cards)
        self.statuses: dict[str, ModelStatus] = {}  # the orchestrator's view, per model

    async def start(self) -> None:
        await self.inbox.start()
        await self.admission.start()
        self.recorder.start()

    async def stop(self) -> None:
        await self.recorder.stop()
        await self.inbox.stop()
        await self.admission.stop()
        await self.models.stop()
        self.grammars.close()

    def deadline(self, timeout_s: float | None = None) -> float:
        """When a request must have its answer, or (generation) its first token:
        the client's own timeout (Tensorbus-Timeout, at most the longest a request
        may take), else TENSORBUS_REQUEST_TIMEOUT_S."""
        return min(time.time() + max(self._asked(timeout_s), 0.001), self.end_by(timeout_s))

    def end_by(self, timeout_s: float | None = None) -> float:
        """When a generation must have ended, however well it goes: the client's own
        timeout, else TENSORBUS_MAX_GENERATION_S."""
        cap = self.config.max_generation_s
        return time.time() + max(min(timeout_s, cap) if timeout_s is not None else cap, 0.001)

    def _asked(self, timeout_s: float | None) -> float:
        if timeout_s is None:
            return self.config.request_timeout_s
        return min(timeout_s, max(self.config.max_generation_s, self.config.request_timeout_s))

    async def tokenize(self, fn, *args):
        """`fn(*args)` off the event loop, for a body above INLINE_TOKENIZE: an
        adversarial 1 MB input takes the tokenizer seconds, and it releases the GIL
        meanwhile. Count the request as `preparing` around it."""
        async with self._tokenizing:
            return await asyncio.to_thread(fn, *args)

    def observe_status(self, status) -> None:
        """The orchestrator's FleetStatus: model cards show it; a failed model is a 503."""
        self.statuses = {m.model: m for m in status.models}
        self.admission.observe_status(status)

    def check_size(self, body: bytes, limit: int = 0) -> None:
        limit = limit or self.config.max_payload
        if len(body) > limit:
            raise too_large(f"the request body is {len(body)} bytes; the limit is {limit}")

    def bus_limit(self) -> int:
        """The largest message the bus carries now: what the connected nats-server
        announced (a reconnect may land on another), else TENSORBUS_MAX_PAYLOAD."""
        bus = self.nc.max_payload
        return bus if bus > 0 else self.config.max_payload

    # ------------------------------------------------------------------ models
    def model_list(self) -> ModelList:
        """Every model this gateway knows that is served, with its workers' state."""
        self.decisions.expire(time.monotonic())
        names = set(self.models.known()) | set(self.decisions.models()) | set(self.statuses)
        served = sorted(n for n in names if self.config.fleet_bounds(n)[1] > 0)
        return ModelList(data=[self.models.card(n, self.decisions, self.statuses.get(n))
                               for n in served])

    # ---------------------------------------------------------------- dispatch
    @contextmanager
    def dispatched(self, work, path_lost: bool = False):
        """The request's inbox (a GenerateWork's: its deadline, then its stall and
        end bounds), open (and counted as waiting) while it is out; with `path_lost`,
        a `PathLost` joins its queue when this gateway's connection drops."""
        reply, q = self.inbox.open(work.request_id, work.deadline, work.stall_s, work.end_by,
                                   retry=path_lost)
        waiting = self.admission.waiting
        waiting[work.model] += 1
        try:
            yield reply, q
        finally:
            waiting[work.model] -= 1
            self.inbox.close(work.request_id)

    async def submit(self, work, reply: str) -> None:
        if not self.nc.is_connected:
            # A request (HTTP) while the bus is down: say so now, not at its deadline.
            # Requests already waiting keep waiting: an answer published while the
            # client's own connection is reconnecting would be lost; a 504 later is not.
            raise unavailable("the gateway is reconnecting to the message bus; retry shortly")
        work.reply, work.group = reply, self.inbox.group
        subject = subjects.SCHED_SUBMIT
        if work.reserved:  # to the scheduler holding its room
            subject = subjects.sched_submit(work.reserved)
        await self.nc.publish(subject, encode(work), reply=reply)
        # request_id (bound by the transport) is the client's; wire_id is what the
        # scheduler's and worker's lines call request_id (the same when the client sent none).
        log.debug("request_submitted", wire_id=work.request_id, model=work.model)

    async def call(self, work, deadline: float, out: Outcome | None = None):
        """Submit work and wait for its single answer (`dispatched`, inlined: this is
        every embeddings request's path).

        The work is idempotent (an embedding is the same whoever computes it, however
        often): a call made while the bus is reconnecting waits for it (within its
        deadline), and one whose connection drops while it is out, or whose scheduler
        may have lost it (a scheduler's `reconnects` rose), is submitted once more
        after the reconnection, under the same id; one that found no scheduler while
        a scheduler was heard just now waits for its next report and is submitted
        again. The first answer is the one the client gets; a second finds its queue
        closed and is dropped (docs/decisions/0053-node-loss.md)."""
        rid, model = work.request_id, work.model
        reply, q = self.inbox.open(rid, deadline, retry=True)
        waiting = self.admission.waiting
        waiting[model] += 1
        try:
            if not self.nc.is_connected:
                await self.reconnected(deadline)
            await self.submit(work, reply)
            lost = absent = 0  # submissions sent again after a lost path, after none heard
            while True:
                try:
                    return await self.inbox.next_result(q, rid, out)
                except PathLost:  # this gateway's path, or its scheduler's, dropped
                    if lost == MAX_SUBMITS:
                        raise
                    lost += 1
                    await self.reconnected(deadline)
                    why = "connection_lost"
                except NoScheduler:  # none subscribed: one between servers comes back?
                    # Nobody received it, so sending it again duplicates nothing: at
                    # each report of a scheduler within the deadline, a few times (its
                    # interest may reach this gateway's server after its report).
                    if absent == NO_SCHEDULER_TRIES or not await self.schedulers.back(deadline):
                        raise
                    absent += 1
                    why = "no_scheduler"
                log.warning("request_retried", wire_id=rid, reason=why)
                self.retried += 1
                await self.submit(work, reply)
        finally:
            waiting[model] -= 1
            self.inbox.close(rid)

    async def reconnected(self, deadline: float) -> None:
        if not await self.links.wait_up(deadline):
            raise deadline_exceeded()

    # --------------------------------------------------------------- telemetry
    def _site_of(self, worker_id: str) -> str:
        """The site the answering worker's heartbeats announce ("" unknown or one site)."""
        view = self.fleet.workers.get(worker_id) if worker_id else None
        return view.hb.site if view is not None else ""

    async def record(self, rid: str, out: Outcome, started: float, wire: str = "") -> None:
        t = out.timing
        # TTFT as a client sees it: from this gateway's receipt (tokenizing, both hops
        # and any cold-start hold included) to the first chunk reaching it.
        ttft = out.first_token_at - started if out.first_token_at else 0.0
        rec = RequestRecord(
            request_id=rid, endpoint=out.endpoint, model=out.model, version=out.version,
            worker_id=out.worker_id, status=out.status, error_code=out.error_code,
            total_s=time.perf_counter() - started, queue_s=t.queue, batch_wait_s=t.batch_wait,
            compute_s=t.compute, prompt_tokens=out.prompt_tokens,
            completion_tokens=out.completion_tokens, ttft_s=ttft, itl_s=t.itl_mean,
            batch_size=t.batch_size, finished_at=time.time(), hold_s=out.hold_s,
            worker_ttft_s=t.ttft, itl_counts=t.itl_counts, site=self._site_of(out.worker_id))
        log.debug("request_finished", request_id=rid, status=out.status, version=out.version,
                  worker=out.worker_id, total_s=round(rec.total_s, 6), hold_s=out.hold_s)
        self.recorder.put(wire or new_request_id(), encode_record(rec))
