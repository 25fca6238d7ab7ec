"""What the gateway decides about admitting a request, before a scheduler sees it.

The schedulers' admission is the exact one (each sees every gateway's work); what is
decided here spares a request they would refuse the tokenizing and two hops, which
under ten times capacity made refusals take a second instead of milliseconds. Over
the same rules (`shared.admission`), in this order:

  1. `check_served`: a model not served (`MODEL=0:0`) or `failed` (the orchestrator's
     FleetStatus) is a 503 at once, with the reason.
  2. `shed`, the count bound: this gateway alone already waits on as many of the
     model's requests as the whole fleet may queue (counted here, so never stale).
  3. `shed_by_work`, the work bound, before tokenizing: the work ahead, as the
     schedulers' load reports say (`work_ahead`: drained by the batches the workers
     computed since, and never less than what this gateway itself has out), already
     fills the queue or outlasts the deadline. A large body counts its own estimated
     size (`TokenRatio`: characters over what the tokenizer has shown).
  4. A large body is then admitted by a scheduler by that estimate before it is
     tokenized (`reserve`, on a connection of its own): every gateway's requests meet
     one bound there before their tokenizing, so none is refused after it. While it
     tokenizes it counts here as waiting and as work (`preparing`), so the requests
     read behind it see it ahead of them.
  5. A completions list of several prompts (services.gateway.fanout) goes out as one
     work per prompt, each judged alone by a scheduler: `shed` counts it as that many
     requests, and once it is tokenized `shed_list` judges the list as a whole (its
     prompts' tokens, choices and max_tokens, summed), so it is refused whole, with
     the error one request of that size gets, rather than in part.
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from contextlib import contextmanager

from nats.aio.client import Client
from nats.errors import ConnectionClosedError, NoRespondersError
from nats.errors import TimeoutError as NatsTimeout

from services.fleet import Fleet
from services.gateway.inbox import as_service_error
from shared import admission, subjects
from shared.admission import LoadBoard, Report, Tally
from shared.costs import Cost, gen_cost
from shared.bus import close, connect
from shared.config import Config, prefill_chunk_on
from shared.messages import Reserve, Reserved, SchedLoad, WorkError, encode, reserve_reply_decoder

CHARS_PER_TOKEN = 4.0  # a text's tokens before its first tokenizing: chars / this
RESERVE_TIMEOUT_S = 1.0  # a scheduler that does not answer a Reserve by then: submit unreserved


def work_ahead(reports: list[tuple[float, Report]], now: float, max_batch: int,
               n_workers: int, done: Tally | None = None,
               own: Tally | None = None) -> tuple[Tally, Cost] | None:
    """The work ahead of a new request of one model, and its cost, as this gateway
    can know them; None before any scheduler has timed the model (the scheduler's call).

    `reports` are (received, report) of each scheduler (monotonic `now`); what the
    workers computed since the newest is taken off (`shared.admission.drained`), and
    so is `done`: this gateway's own requests seen computed since the last report.
    `own` is what this gateway has submitted and not seen answered: when that is
    more, it counts instead (a burst outruns the reports, never this gateway's count)."""
    cost = next((r.cost for _, r in reports if r.cost.per_token or r.cost.per_batch), None)
    if cost is None:
        return None
    reported = Tally()
    for _, r in reports:
        reported = reported + r.tally
    ahead = admission.drained(reported, cost, max_batch, n_workers,
                              now - max(at for at, _ in reports))
    if done is not None and done.requests:
        ahead = ahead.least(reported.less(done))
    if own is not None and own.tokens > ahead.tokens:
        ahead = own
    return ahead, cost


class TokenRatio:
    """Each model's characters per token, as its tokenizer has shown them here: the
    size of a large body before it is tokenized."""

    def __init__(self) -> None:
        self._ratio: dict[str, float] = {}

    def estimate(self, model: str, texts: list[str], limit: int) -> int:
        """Tokens `texts` will hold: their characters over the ratio (CHARS_PER_TOKEN
        until the model has been tokenized once), plus two special tokens each; at most
        `limit` each (a longer input is a 400 once tokenized, never queued work)."""
        ratio = self._ratio.get(model, CHARS_PER_TOKEN)
        return sum(min(int(len(t) / ratio) + 2, limit) for t in texts)

    def learn(self, model: str, texts: list[str], tokens: int) -> None:
        """What tokenizing `texts` gave: `tokens`, special tokens included."""
        chars, tokens = sum(map(len, texts)), tokens - 2 * len(texts)
        if chars > 0 and tokens > 0:
            r = self._ratio.get(model)
            seen = chars / tokens
            self._ratio[model] = seen if r is None else 0.8 * r + 0.2 * seen


class GatewayAdmission:
    """The gateway's admission state: its own counts, the schedulers' reports, the
    failed models, and the connection reservations take."""

    def __init__(self, nc: Client, config: Config, fleet: Fleet, cancel) -> None:
        self.nc = nc
        self.config = config
        self.fleet = fleet
        self._cancel = cancel  # async (request_id, reason): a Cancel to workers and schedulers
        self.waiting: Counter[str] = Counter()  # model -> requests submitted, unanswered
        self.failed: dict[str, str] = {}  # model -> why (the orchestrator's FleetStatus)
        self.loads = LoadBoard(expiry_s=config.worker_expiry_s)  # every scheduler's work
        self.sent_work: dict[str, Tally] = {}  # model -> embeddings submitted, unanswered
        self.done_since: dict[str, Tally] = {}  # model -> seen computed since the last report
        self.tokens = TokenRatio()
        self._unreserving: set[asyncio.Task] = set()
        self.control = nc  # the connection reservations take (start() opens its own)

    async def start(self) -> None:
        # Reservations on a connection of their own: in a burst the main connection's
        # socket holds megabytes of requests, and a scheduler's answer behind them
        # would be read only after all of them were handled.
        self.control = await connect(self.config.nats_url, f"{self.nc.options['name']}-control")

    async def stop(self) -> None:
        if self.control is not self.nc:
            await close(self.control)

    # ---------------------------------------------------------------- decisions
    def check_served(self, model: str) -> None:
        """503 at once for a model that will not get a worker: not served, or failed."""
        admission.check_served(model, self.config.fleet_bounds(model)[1], self.failed.get(model))

    def shed(self, model: str, deadline: float | None = None, inputs: int = 0,
             tokens: int = 0, requests: int = 1) -> None:
        """429 before any work by the count bound (a completions list: `requests`, one
        per prompt), then (with `deadline`) by work."""
        ready = len(self.fleet.ready(model))
        if not ready:
            return  # held during a cold start, or a 503: the scheduler's call
        admission.check_count(model, self.waiting[model], ready, self.config.max_queue_per_worker,
                              requests)
        if deadline is not None:
            self.shed_by_work(model, deadline, inputs, tokens)

    def shed_by_work(self, model: str, deadline: float, inputs: int = 0, tokens: int = 0) -> None:
        """429 before tokenizing when the work ahead already fills the queue or outlasts
        the deadline without this request's own work (with it, when `tokens` gives an
        estimate of its size: a large body, whose tokenizing waits)."""
        now = time.monotonic()
        workers = self.fleet.available(model)
        max_batch = max((w.hb.max_batch for w in workers), default=1)
        seen = work_ahead(self.loads.others(model, now), now, max_batch, len(workers),
                          self.done_since.get(model), self.sent_work.get(model))
        if seen is None:
            return  # not timed yet: the scheduler's call
        ahead, cost = seen
        admission.check(model, ahead, inputs, tokens, len(workers), max_batch, cost,
                        deadline - time.time(), self.config.max_queue_per_worker,
                        self.config.max_queue_s, size_unknown=not tokens)

    def shed_list(self, model: str, deadline: float, n: int, prompts: list[int],
                  max_tokens: list[int]) -> None:
        """429 unless a completions list fits as a whole, once tokenized: its prompts
        (`prompts` tokens each, `n` choices, `max_tokens` each) go out as one work
        each, and a scheduler judges each alone, so the list is judged here as the
        sum, by the schedulers' reports and the ready workers' costs
        (`shared.admission.check_generation`: the last prompt, the others ahead of
        it), and refused whole rather than in part."""
        workers = self.fleet.available(model)
        if not workers:
            return  # held during a cold start, or a 503: the scheduler's call
        hbs = [w.hb for w in workers]
        own = Tally(len(prompts) - 1, n * (len(prompts) - 1), sum(prompts[:-1]),
                    n * sum(max_tokens[:-1]))
        admission.check_generation(
            model, self.loads.total(model, time.monotonic()) + own, n, prompts[-1], len(workers),
            slots=min(hb.max_batch for hb in hbs), running=sum(hb.in_flight for hb in hbs),
            cost=gen_cost(hbs), left_s=deadline - time.time(),
            max_queue_per_worker=self.config.max_queue_per_worker,
            max_queue_s=self.config.max_queue_s,
            chunk=prefill_chunk_on(self.config.prefill_chunk, hbs[0].device),
            listed=len(prompts))

    # -------------------------------------------------------------------- counts
    def observe_load(self, load: SchedLoad) -> None:
        """A scheduler's load report: counted in `shed_by_work`, from now on without
        what this gateway had seen computed before it."""
        self.loads.observe(load, time.monotonic())
        for m in load.models:
            self.done_since.pop(m.model, None)

    def observe_status(self, status) -> None:
        """The orchestrator's FleetStatus: which models failed, and why."""
        self.failed = admission.failed_models(status)

    def computed(self, model: str, inputs: int, tokens: int) -> None:
        """One of this gateway's requests computed: the schedulers' reports still count
        it until their next one (an overload's last report would otherwise refuse the
        first requests after it, for up to an interval)."""
        self.done_since.setdefault(model, Tally()).add(inputs, tokens)

    @contextmanager
    def sent(self, model: str, inputs: int, tokens: int):
        """Count an embeddings request as work out while it is submitted."""
        out = self.sent_work.setdefault(model, Tally())
        out.add(inputs, tokens)
        try:
            yield
        finally:
            out.add(inputs, tokens, sign=-1)

    @contextmanager
    def preparing(self, model: str, inputs: int, tokens: int):
        """Count an admitted request while it is tokenized, before it is submitted, as
        waiting and as estimated work: tokenizing can take a thread and the loop meanwhile
        reads the requests behind it, which must see it ahead of them (a burst would
        otherwise pass the gateway's check whole while its first requests tokenize)."""
        self.waiting[model] += 1
        try:
            with self.sent(model, inputs, tokens):
                yield
        finally:
            self.waiting[model] -= 1

    # -------------------------------------------------------------- reservations
    async def reserve(self, rid: str, model: str, version: str, inputs: int, tokens: int,
                      deadline: float, generate: bool = False) -> str:
        """Room for a large request at a scheduler before it is tokenized, by its
        estimated size, or by count for a completion (`generate`; see
        `shared.messages.Reserve`). Returns the scheduler's id (submit there), or ""
        (no ready worker, or no answer: the submit is decided on arrival as any
        other); a refusal is raised."""
        msg = Reserve(rid, model, version, inputs, tokens, deadline, generate)
        wait = min(RESERVE_TIMEOUT_S, max(deadline - time.time(), 0.001))
        try:
            reply = await self.control.request(subjects.SCHED_RESERVE, encode(msg), timeout=wait)
        except (NoRespondersError, NatsTimeout, ConnectionClosedError):
            return ""  # no scheduler, or none answering: the submit decides
        return reserved_by(reply.data)

    def unreserve(self, rid: str) -> None:
        """A reserved request that will not be submitted: its room back, now."""
        task = asyncio.ensure_future(self._cancel(rid, "not submitted"))
        self._unreserving.add(task)
        task.add_done_callback(self._unreserving.discard)


def reserved_by(data: bytes) -> str:
    """A scheduler's answer to a Reserve: its id, "" (nothing reserved), or the
    refusal raised as the client's error."""
    res = reserve_reply_decoder.decode(data)
    if isinstance(res, WorkError):
        raise as_service_error(res)
    return res.scheduler_id if isinstance(res, Reserved) else ""

