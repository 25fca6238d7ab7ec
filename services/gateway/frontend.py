"""The gateway's transport-free core: one method per endpoint, shared by NATS and HTTP.

  1. Decode the body into the endpoint's Struct (JSON or msgpack); 400 on any error.
  2. Resolve the model (404 if unknown), tokenize, check limits (400 / 413).
  3. A model that is not served (`MODEL=0:0`) or `failed` (the orchestrator's
     FleetStatus) is a 503 at once, with the reason. A model whose queue is already
     full, or whose work ahead cannot finish before this request's deadline, as the
     schedulers' load reports say (`shed`), is a 429 before tokenizing. Otherwise publish a WorkRequest
     to the scheduler with this gateway's per-request inbox as the reply; the NATS
     "no responders" status becomes a 503 at once.
  4. Wait for the worker's answer until the request's deadline (504 after it, and a
     Cancel goes out so the worker frees whatever it holds). A request the scheduler
     holds for a cold start is told so (`Held`), and released with the time it was
     held (`Accepted`): that time is the record's `hold_s`.
  5. Build the OpenAI-shaped reply; publish one RequestRecord to telemetry.
"""

from __future__ import annotations

import asyncio
import os
import re
import time
from collections import Counter
from contextlib import contextmanager
from dataclasses import dataclass, field

from nats.aio.client import Client
from nats.errors import ConnectionClosedError, NoRespondersError
from nats.errors import TimeoutError as NatsTimeout

from services.fleet import Fleet
from services.gateway.inbox import EXPIRED, ReplyInbox
from services.gateway.models import ModelTable
from shared import admission, subjects
from shared.api import ModelList
from shared.bus import close, connect
from shared.config import Config
from shared.errors import ServiceError, deadline_exceeded, overloaded, too_large, unavailable
from shared.logging import get_logger
from shared.messages import (
    Accepted,
    Cancel,
    Held,
    ModelStatus,
    Reserve,
    Reserved,
    SchedLoad,
    Timing,
    WorkError,
    encode,
    reserve_reply_decoder,
)
from shared.scaling import LiveDecisions
from shared.telemetry import RequestRecord
from shared.telemetry import encode as encode_record

log = get_logger("gateway")


@dataclass
class Outcome:
    """What telemetry needs to know about one finished request."""

    endpoint: str
    model: str = ""
    version: str = ""
    worker_id: str = ""
    status: int = 200
    error_code: str = ""
    timing: Timing = field(default_factory=Timing)
    prompt_tokens: int = 0
    completion_tokens: int = 0
    held_at: float = 0.0  # perf_counter when the scheduler said it holds the request
    hold_s: float = 0.0  # time held for a cold start
    first_token_at: float = 0.0  # perf_counter when the first generated chunk arrived here


def new_request_id() -> str:
    """32 random hex digits, as uuid4().hex but without building a UUID object."""
    return os.urandom(16).hex()


_UNSAFE = re.compile(r"[^A-Za-z0-9_-]")
INLINE_TOKENIZE = 2_048  # bodies up to this many bytes are tokenized on the event loop
# (a 6 KB body of eight long inputs takes the tokenizer about a millisecond: on the
# loop, a burst's first admitted requests would hold every refusal behind them)
CHARS_PER_TOKEN = 4.0  # a text's tokens before its first tokenizing: chars / this
RESERVE_TIMEOUT_S = 1.0  # a scheduler that does not answer a Reserve by then: submit unreserved
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
        self._tokenizing = asyncio.Semaphore(2)  # large inputs tokenized at once
        self.waiting: Counter[str] = Counter()  # model -> requests submitted, unanswered
        self.decisions = LiveDecisions()  # the schedulers' scale decisions (model cards)
        self.statuses: dict[str, ModelStatus] = {}  # the orchestrator's view, per model
        self.loads = admission.LoadBoard(expiry_s=config.worker_expiry_s)  # every scheduler's work
        self.sent_work: dict[str, admission.Tally] = {}  # model -> embeddings submitted, unanswered
        # model -> embeddings this gateway saw computed since the last load report
        self.done_since: dict[str, admission.Tally] = {}
        self.chars_per_token: dict[str, float] = {}  # model -> what its tokenizer has shown
        self._unreserving: set[asyncio.Task] = set()
        self.control = nc  # the connection reservations take (start() opens its own)

    async def start(self) -> None:
        await self.inbox.start()
        # Reservations on a connection of their own: in a burst this connection's
        # socket holds megabytes of requests, and a scheduler's answer behind them
        # would be read only after all of them were handled.
        self.control = await connect(self.config.nats_url, f"{self.nc.options['name']}-control")

    async def stop(self) -> None:
        await self.inbox.stop()
        if self.control is not self.nc:
            await close(self.control)

    def deadline(self, timeout_s: float | None = None) -> float:
        t = self.config.request_timeout_s if timeout_s is None else min(
            timeout_s, self.config.request_timeout_s * 10)
        return time.time() + max(t, 0.001)

    async def tokenize(self, fn, *args):
        """`fn(*args)` off the event loop, for a body above INLINE_TOKENIZE: an
        adversarial 1 MB input takes the tokenizer seconds, and it releases the GIL
        meanwhile. Count the request as `preparing` around it."""
        async with self._tokenizing:
            return await asyncio.to_thread(fn, *args)

    def estimate_tokens(self, model: str, texts: list[str], limit: int) -> int:
        """Tokens `texts` will hold, before tokenizing them: their characters over the
        ratio this model's tokenizer has shown here (4 until it has tokenized once),
        plus two special tokens each; at most `limit` each (a longer input is a 400
        once tokenized, never work a queue must make room for)."""
        ratio = self.chars_per_token.get(model, CHARS_PER_TOKEN)
        return sum(min(int(len(t) / ratio) + 2, limit) for t in texts)

    def learn_tokens(self, model: str, texts: list[str], tokens: int) -> None:
        """What tokenizing `texts` gave: `tokens`, special tokens included."""
        chars, tokens = sum(map(len, texts)), tokens - 2 * len(texts)
        if chars > 0 and tokens > 0:
            r = self.chars_per_token.get(model)
            seen = chars / tokens
            self.chars_per_token[model] = seen if r is None else 0.8 * r + 0.2 * seen

    @contextmanager
    def preparing(self, model: str, inputs: int, tokens: int):
        """Count an admitted request while it is tokenized, before it is submitted, as
        waiting and as estimated work: tokenizing can take a thread and the loop meanwhile
        reads the requests behind it, which must see it ahead of them (a burst would
        otherwise pass the gateway's check whole while its first requests tokenize)."""
        sent = self.sent_work.setdefault(model, admission.Tally())
        self.waiting[model] += 1
        sent.add(inputs, tokens)
        try:
            yield
        finally:
            self.waiting[model] -= 1
            sent.add(inputs, tokens, sign=-1)

    async def reserve(self, rid: str, model: str, version: str, inputs: int, tokens: int,
                      deadline: float, generate: bool = False) -> str:
        """Room for a large request at a scheduler before it is tokenized, by its
        estimated size, or by count for a completion (`generate`; see
        `shared.messages.Reserve`): every gateway's requests meet one bound there
        before their tokenizing, so none is refused after it. Returns the
        scheduler's id (submit there), or "" (no ready worker, or no answer: the
        submit is decided on arrival as any other); a refusal is raised."""
        msg = Reserve(rid, model, version, inputs, tokens, deadline, generate)
        wait = min(RESERVE_TIMEOUT_S, max(deadline - time.time(), 0.001))
        try:
            reply = await self.control.request(subjects.SCHED_RESERVE, encode(msg), timeout=wait)
        except (NoRespondersError, NatsTimeout, ConnectionClosedError):
            return ""  # no scheduler, or none answering: the submit decides
        res = reserve_reply_decoder.decode(reply.data)
        if isinstance(res, WorkError):
            raise as_service_error(res)
        return res.scheduler_id if isinstance(res, Reserved) else ""

    def unreserve(self, rid: str) -> None:
        """A reserved request that will not be submitted: its room back, now."""
        task = asyncio.ensure_future(self.cancel(rid, "not submitted"))
        self._unreserving.add(task)
        task.add_done_callback(self._unreserving.discard)

    def check_served(self, model: str) -> None:
        """503 at once for a model that will not get a worker: not served, or failed."""
        if self.config.fleet_bounds(model)[1] == 0:
            raise unavailable(f"model '{model}' is not served here (TENSORBUS_FLEET "
                              f"{model}=0:0)", retry_after=None)
        status = self.statuses.get(model)
        if status is not None and status.state == "failed":
            why = status.reason or "its worker exited on an invalid configuration"
            raise unavailable(f"model '{model}' cannot start: {why}", retry_after=None)

    def shed(self, model: str, deadline: float | None = None, inputs: int = 0,
             tokens: int = 0) -> None:
        """429 before any work when this gateway alone already waits on as many of the
        model's requests as the whole fleet may queue. The scheduler's admission stays
        the exact one (it sees every gateway); this spares a request it would refuse
        the tokenizing and two hops, which under ten times capacity made refusals take
        a second instead of milliseconds. Counted here, so never stale."""
        ready = len(self.fleet.ready(model))
        if not ready:
            return  # held during a cold start, or a 503: the scheduler's call
        waiting = self.waiting[model]
        if waiting >= self.config.max_queue_per_worker * ready:
            raise overloaded(f"model '{model}' is at capacity ({waiting} requests queued); "
                             "retry after the hinted delay", retry_after=1.0)
        if deadline is not None:
            self.shed_by_work(model, deadline, inputs, tokens)

    def shed_by_work(self, model: str, deadline: float, inputs: int = 0, tokens: int = 0) -> None:
        """429 before tokenizing when the work ahead already fills the queue or outlasts
        the deadline without this request's own work (with it, when `tokens` gives an
        estimate of its size: a large body, whose tokenizing waits). The work ahead is
        what the schedulers reported, less what the workers computed since, or what
        this gateway itself has submitted and not seen answered if that is more: a
        burst outruns the reports (one interval old), never this gateway's own count."""
        now = time.monotonic()
        reports = self.loads.others(model, now)
        cost = next((r.cost for _, r in reports if r.cost.per_token or r.cost.per_batch), None)
        if cost is None:
            return  # not timed yet: the scheduler's call
        workers = self.fleet.available(model)
        max_batch = max((w.hb.max_batch for w in workers), default=1)
        reported = admission.Tally()
        for _, r in reports:
            reported = reported + r.tally
        ahead = admission.drained(reported, cost, max_batch, len(workers),
                                  now - max(at for at, _ in reports))
        done = self.done_since.get(model)
        if done is not None and done.requests:  # its own, seen computed since
            ahead = ahead.least(reported.less(done))
        own = self.sent_work.get(model)
        if own is not None and own.tokens > ahead.tokens:
            ahead = own
        admission.check(model, ahead, inputs, tokens, len(workers), max_batch, cost,
                        deadline - time.time(), self.config.max_queue_per_worker,
                        self.config.max_queue_s, size_unknown=not tokens)

    def observe_load(self, load: SchedLoad) -> None:
        """A scheduler's load report: counted in `shed_by_work`, from now on without
        what this gateway had seen computed before it."""
        self.loads.observe(load, time.monotonic())
        for m in load.models:
            self.done_since.pop(m.model, None)

    def computed(self, model: str, inputs: int, tokens: int) -> None:
        """One of this gateway's requests computed: the schedulers' reports still count
        it until their next one (an overload's last report would otherwise refuse the
        first requests after it, for up to an interval)."""
        self.done_since.setdefault(model, admission.Tally()).add(inputs, tokens)

    def check_size(self, body: bytes) -> None:
        if len(body) > self.config.max_payload:
            raise too_large(f"the request body is {len(body)} bytes; "
                            f"the limit is {self.config.max_payload}")

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
    def dispatched(self, work):
        """The request's inbox, open (and counted as waiting) while it is out."""
        reply, q = self.inbox.open(work.request_id, work.deadline)
        self.waiting[work.model] += 1
        try:
            yield reply, q
        finally:
            self.waiting[work.model] -= 1
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

    async def next_result(self, q: asyncio.Queue, rid: str, out: Outcome | None = None):
        """The next result for a request; errors raised as ServiceError.

        Hold notices are taken in passing: `Held` starts the cold-start clock, and
        `Accepted` (a held request released to a worker) sets `out.hold_s`."""
        while True:
            res = _taken(await self._next(q, rid, out), out)
            if res is not None:
                return res

    def ready_results(self, q: asyncio.Queue, out: Outcome | None = None
                      ) -> tuple[list, ServiceError | None]:
        """The results already queued for a request, without waiting, and the error
        that stopped the reading if one came (the results before it still count)."""
        got = []
        while not q.empty():
            item = q.get_nowait()
            if item is EXPIRED:
                q.put_nowait(item)  # the next wait reports it
                break
            try:
                res = _taken(item, out)
            except ServiceError as err:
                return got, err
            if res is not None:
                got.append(res)
        return got, None

    async def _next(self, q: asyncio.Queue, rid: str, out: Outcome | None):
        """The request's next queued item; at its deadline (`EXPIRED`, queued by the
        inbox's timer) a Cancel goes out and 504 is raised."""
        item = q.get_nowait() if not q.empty() else await q.get()
        if item is not EXPIRED:
            return item
        await self.cancel(rid, "deadline")
        if out is not None and out.held_at:  # still waiting for a worker to start
            out.hold_s = time.perf_counter() - out.held_at
            raise deadline_exceeded(
                f"no worker of model '{out.model}' became ready before the request's "
                f"deadline (held {out.hold_s:.1f} s for a cold start)")
        raise deadline_exceeded()

    async def call(self, work, deadline: float, out: Outcome | None = None):
        """Submit work and wait for its single answer (`dispatched`, inlined: this is
        every embeddings request's path)."""
        rid, model = work.request_id, work.model
        reply, q = self.inbox.open(rid, deadline)
        self.waiting[model] += 1
        try:
            await self.submit(work, reply)
            return await self.next_result(q, rid, out)
        finally:
            self.waiting[model] -= 1
            self.inbox.close(rid)

    async def cancel(self, rid: str, reason: str) -> None:
        await self.nc.publish(subjects.CANCEL, encode(Cancel(rid, reason)))

    # --------------------------------------------------------------- telemetry
    async def record(self, rid: str, out: Outcome, started: float) -> None:
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
            worker_ttft_s=t.ttft, itl_counts=t.itl_counts)
        log.debug("request_finished", request_id=rid, status=out.status, version=out.version,
                  worker=out.worker_id, total_s=round(rec.total_s, 6), hold_s=out.hold_s)
        try:
            await self.nc.publish(subjects.TELEMETRY_REQUESTS, encode_record(rec))
        except Exception as exc:  # noqa: BLE001 - telemetry never fails a request
            log.warning("telemetry_publish_failed", error=str(exc))


def as_service_error(err: WorkError) -> ServiceError:
    """A scheduler's or worker's WorkError as the error the client gets."""
    return ServiceError(err.status, err.message, code=err.code or None,
                        retry_after=err.retry_after)


def _taken(item, out: Outcome | None):
    """A queued item (services.gateway.inbox) as a result: None for a hold notice
    (noted in `out`), an error raised as ServiceError."""
    if isinstance(item, ServiceError):
        raise item
    if isinstance(item, WorkError):
        if out is not None and item.version:  # a version's failure counts against it
            out.version, out.worker_id = item.version, item.worker_id
        raise as_service_error(item)
    if isinstance(item, Held):
        if out is not None:
            out.held_at = time.perf_counter()
        return None
    if isinstance(item, Accepted):
        if out is not None:
            out.hold_s, out.held_at = item.hold_s, 0.0
        return None
    return item
