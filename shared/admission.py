"""Admission by work: how much compute a model's queue holds, and whether one more
request fits in it before its own deadline.

Work is estimated compute: tokens x the model's cost per token. Used by the scheduler
(the exact decision, with its own live tally) and the gateway (a refusal before
tokenizing when the queue is already full without the request). The flow:

  1. Cost: every finished encoder batch reports its engine seconds and its tokens
     (`WorkDone.compute_s`, `.tokens`); `CostBook` fits, per model, seconds = per
     batch + per token x tokens over moving averages of recent batches, so work is
     tokens x cost per token plus the batches they fill x cost per batch. Until the
     first batch finishes, the estimate starts from the workers' warm-up (two
     batches timed; `Heartbeat.cost_per_token`, `.cost_per_batch`).
  2. Load: every scheduler publishes what it has dispatched and not seen finish, per
     model, every heartbeat interval and within 20 ms of a change (`SchedLoad` on
     `tensorbus.v1.sched.load`, with its cost estimate); `LoadBoard` keeps the latest
     report of each live scheduler. A scheduler adds the others' reports to its own
     tally, so several schedulers share one bound, exceeded by at most the arrivals
     of one report's delay.
  3. `check_served()` comes first, on both sides: a model that will never get a
     worker (`MODEL=0:0`, or `failed`) is a 503 with the reason, never a 429.
  4. `check()` refuses with 429 and a Retry-After, in this order:
     a. the count bound (`max_queue_per_worker` x ready workers): state stays bounded
        whatever the cost;
     b. no batch of the model timed yet: at most two batches of inputs per ready
        worker (one computing, one waiting), Retry-After 1 s;
     c. the queue bound: the work ahead plus this request's, spread over the ready
        workers, above `max_queue_s`; Retry-After = the excess, which drains first;
     d. the deadline: that same finish time above `DEADLINE_HEADROOM` of the time the
        request has left. Admitted, it would end in a 504 having taken queue space;
        Retry-After = when the work ahead will have drained enough for it to fit.
  5. Generation (`check_generation`) is bounded by the same count, then by the work
     ahead of its prompt: a decoder's cost (`GenCost`) is prefill (per chunk + per
     prompt token) and decode (per step + per sequence in it, one step shared by the
     sequences it advances), timed by each decoder worker at warm-up and refitted
     from its iterations (`GenCostBook`), carried in its heartbeats (`gen_cost`).
     The prompts ahead not computed yet, the decode steps between their chunks, and
     a slot's wait when all are taken (the sequences ahead generating their
     max_tokens x the share of it recent ones used: `prompt_wait`), plus its own
     prompt, must fit in `max_queue_s` and in DEADLINE_HEADROOM of the time it has
     left; Retry-After is the excess, in seconds. What it generates afterwards is
     not bounded here. No worker's cost known: the count bound alone. A
     completions list (several prompts, one work each) is judged as a whole by the
     gateway: as its last prompt with the others ahead of it, counted as one
     request per prompt (`listed`).
  At zero ready workers none of this applies: the cold-start hold rule does.

Who calls it: the gateway (`services.gateway.admission`, before tokenizing, from the
reports) and the scheduler (`services.scheduler.admission`, the exact decision).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from shared.errors import overloaded, unavailable

DEADLINE_HEADROOM = 0.5  # admit only what the estimate finishes in half the time left:
# the estimate counts engine time only (not the host work between batches) and a
# shared machine's speed moves; a request refused here is answered in milliseconds.
COST_WEIGHT = 0.2  # moving-average weight of the newest batch
OUTLIER = 1.5  # a batch counts as at most this many times (at least this fraction of)
# what the fit predicts for its tokens: one batch that ran while other processes took
# the cores (2.5x its usual time, in a burst's first half-second) moved the estimate
# +50 %, and the scheduler then refused what it had just admitted (decisions/0018).
# A lasting change still moves it, by up to 10 % a batch.
SETTLED = 3  # batches timed before the fit judges one against its prediction
UNMEASURED_BATCHES = 2  # batches of inputs per ready worker before any batch was timed
LENGTH_WEIGHT = 0.05  # weight of the newest finished sequence in a decoder's generated share
MIN_LENGTH = 0.01  # the share is never taken as less (a run of cancelled sequences)
FAILED = "its worker exited on an invalid configuration"  # a failed model with no reason given


@dataclass
class Tally:
    """Work dispatched and not yet finished (or held), for one model. Generation:
    `inputs` are sequences (choices), `tokens` prompt tokens, `decode` the tokens they
    may generate (max_tokens x choices)."""

    requests: int = 0
    inputs: int = 0
    tokens: int = 0
    decode: int = 0

    def add(self, inputs: int, tokens: int, sign: int = 1, decode: int = 0) -> None:
        self.requests += sign
        self.inputs += sign * inputs
        self.tokens += sign * tokens
        self.decode += sign * decode

    def __add__(self, other: "Tally") -> "Tally":
        return Tally(self.requests + other.requests, self.inputs + other.inputs,
                     self.tokens + other.tokens, self.decode + other.decode)

    def less(self, other: "Tally") -> "Tally":
        """This without `other` (none below zero)."""
        return Tally(max(0, self.requests - other.requests), max(0, self.inputs - other.inputs),
                     max(0, self.tokens - other.tokens), max(0, self.decode - other.decode))

    def least(self, other: "Tally") -> "Tally":
        """The smaller of the two, in each count: of two bounds on the same work, the
        tighter."""
        return Tally(min(self.requests, other.requests), min(self.inputs, other.inputs),
                     min(self.tokens, other.tokens), min(self.decode, other.decode))


@dataclass(frozen=True)
class Cost:
    """A model's engine time: `per_batch` + `per_token` x tokens, per engine call."""

    per_batch: float
    per_token: float

    def seconds(self, inputs: int, tokens: float, max_batch: int) -> float:
        """Engine time of `inputs` inputs holding `tokens`, in full batches."""
        batches = math.ceil(inputs / max(max_batch, 1)) if inputs else 0
        return batches * self.per_batch + tokens * self.per_token


class CostBook:
    """Each model's `Cost`, fitted to its finished batches (engine seconds against
    tokens, moving averages): an accelerator's batch costs nearly the same whatever
    it holds, a CPU's grows with its tokens; both are what the fit finds."""

    def __init__(self) -> None:
        self._m: dict[str, list[float]] = {}  # model -> [n, E t, E c, E t^2, E t c]
        self._prior: dict[str, Cost] = {}  # model -> the estimate `learn` started it from

    def observe(self, model: str, compute_s: float, tokens: float) -> None:
        if compute_s <= 0 or tokens <= 0:
            return
        t, c = float(tokens), compute_s
        m = self._m.get(model)
        if m is None:
            self._m[model] = [1, t, c, t * t, t * c]
            return
        cost = self.cost(model)
        if m[0] >= SETTLED and cost is not None:  # an outlier counts, but only as far as OUTLIER
            expected = cost.per_batch + cost.per_token * t
            if expected > 0:
                c = min(max(c, expected / OUTLIER), expected * OUTLIER)
        w = max(COST_WEIGHT, 1 / (m[0] + 1))  # plain mean until there are enough batches
        m[0] += 1
        for i, x in enumerate((t, c, t * t, t * c), start=1):
            m[i] += w * (x - m[i])

    def cost(self, model: str) -> Cost | None:
        m = self._m.get(model)
        if m is None:
            return None
        _, et, ec, ett, etc = m
        var = ett - et * et
        if var > (0.1 * et) ** 2:  # batch sizes vary enough to tell the two parts apart
            b = (etc - et * ec) / var
            a = ec - b * et
            if b >= 0 and a >= 0:
                return Cost(a, b)
            if b < 0:
                return Cost(ec, 0.0)
        prior = self._prior.get(model)
        if prior is not None and prior.per_batch + prior.per_token * et > 0:
            # All one size (a decoder whose prompts are cached but their last tokens):
            # the learned estimate's split, scaled to what these cost.
            k = ec / (prior.per_batch + prior.per_token * et)
            return Cost(prior.per_batch * k, prior.per_token * k)
        return Cost(0.0, ec / et)  # all one size: charge it per token

    def models(self) -> list[str]:
        return list(self._m)

    def per_token(self, model: str) -> float | None:
        """Mean engine seconds per token of the recent batches (reports, docs)."""
        m = self._m.get(model)
        return m[2] / m[1] if m else None

    def learn(self, model: str, cost: Cost) -> None:
        """An estimate from elsewhere (another scheduler's report, a worker's warm-up),
        for a model not timed here yet."""
        if model in self._m or (cost.per_batch <= 0 and cost.per_token <= 0):
            return
        self._prior[model] = cost
        t = 64.0  # a synthetic pair of batches that the fit turns back into `cost`
        c1, c2 = cost.per_batch + cost.per_token * t, cost.per_batch + cost.per_token * 2 * t
        self._m[model] = [1, 1.5 * t, (c1 + c2) / 2, 2.5 * t * t, (t * c1 + 2 * t * c2) / 2]


@dataclass(frozen=True)
class GenCost:
    """A decoder's engine time. `prefill`: per prompt chunk (an engine call) + per
    prompt token; `decode`: per decode step (`per_batch`) + per sequence in it
    (`per_token`), so one step's time is shared by the sequences it advances.
    `length`: tokens a sequence generates per token of its max_tokens, as the
    recent ones did (1 until any finished: max_tokens is the upper bound)."""

    prefill: Cost
    decode: Cost
    length: float = 1.0

    def prefill_s(self, prompts: float, tokens: float, chunk: int) -> float:
        """Engine time of `prompts` prompts holding `tokens`, in chunks of `chunk`."""
        calls = prompts + tokens // max(chunk, 1)
        return calls * self.prefill.per_batch + tokens * self.prefill.per_token

    def step_s(self, rows: float) -> float:
        """One decode step advancing `rows` sequences (at least one)."""
        return self.decode.per_batch + self.decode.per_token * max(rows, 1)

    def decode_s(self, tokens: float, concurrency: float) -> float:
        """Engine time of generating `tokens` while `concurrency` sequences share each
        step: every token pays its share of one step."""
        b = max(concurrency, 1)
        return tokens * self.step_s(b) / b


class GenCostBook:
    """A decoder worker's `GenCost`, fitted to its runner's iterations (each: engine
    seconds, prompt tokens and chunks computed, sequences stepped), starting from the
    cost its warm-up timed. An iteration without prompt work times the step; one with
    it times its chunks, less the step the fit predicts."""

    KEY = "decoder"

    def __init__(self) -> None:
        self._prefill = CostBook()  # per chunk + per prompt token
        self._decode = CostBook()  # per step + per sequence stepped
        self._generated = self._budget = 0.0  # decaying sums over finished sequences

    def learn(self, cost: GenCost) -> None:
        """A cost from warm-up: counts until iterations are timed."""
        self._prefill.learn(self.KEY, cost.prefill)
        self._decode.learn(self.KEY, cost.decode)

    def observe(self, seconds: float, prompt_tokens: int, chunks: int, rows: int) -> None:
        if seconds <= 0:
            return
        if not prompt_tokens:
            if rows:
                self._decode.observe(self.KEY, seconds, rows)
            return
        step = self._decode.cost(self.KEY)
        if rows and step is not None:
            seconds -= step.per_batch + step.per_token * rows
        if seconds > 0 and chunks:
            self._prefill.observe(self.KEY, seconds / chunks, prompt_tokens / chunks)

    def finished(self, generated: int, max_tokens: int) -> None:
        """A sequence left its slot (at its end, a stop, or cancelled) having
        generated `generated` of its `max_tokens`."""
        if max_tokens > 0:
            keep = 1 - LENGTH_WEIGHT
            self._generated = keep * self._generated + min(generated, max_tokens)
            self._budget = keep * self._budget + max_tokens

    def cost(self) -> GenCost | None:
        prefill, decode = self._prefill.cost(self.KEY), self._decode.cost(self.KEY)
        length = self._generated / self._budget if self._budget else 1.0
        return GenCost(prefill, decode, max(length, MIN_LENGTH)) if prefill and decode else None


def gen_cost(heartbeats) -> GenCost | None:
    """The mean `GenCost` the decoder workers' heartbeats (`shared.telemetry.Heartbeat`)
    carry; None when none carries one (not timed: the count bound alone applies)."""
    costs = [(hb.prefill_per_chunk, hb.prefill_per_token, hb.decode_per_step, hb.decode_per_row,
              hb.decode_length or 1.0)
             for hb in heartbeats if hb.decode_per_step > 0 or hb.decode_per_row > 0]
    if not costs:
        return None
    a, b, c, d, e = (sum(x) / len(costs) for x in zip(*costs))
    return GenCost(Cost(a, b), Cost(c, d), e)


@dataclass
class Report:
    """One scheduler's last load report of one model."""

    tally: Tally
    cost: Cost  # its estimate; zeros = not measured


class LoadBoard:
    """The latest load report of every other live scheduler, per model."""

    def __init__(self, own_id: str = "", expiry_s: float = 2.0) -> None:
        self.own_id = own_id
        self.expiry_s = expiry_s
        self._by: dict[str, tuple[float, dict[str, Report]]] = {}  # id -> (received, model -> report)

    def observe(self, load, now: float) -> None:
        """A `shared.messages.SchedLoad`; a scheduler's own report is ignored."""
        if load.scheduler_id == self.own_id:
            return
        self._by[load.scheduler_id] = (now, {
            m.model: Report(Tally(m.requests, m.inputs, m.tokens, m.decode),
                            Cost(m.cost_per_batch, m.cost_per_token))
            for m in load.models})

    def others(self, model: str, now: float) -> list[tuple[float, Report]]:
        """(received, report) of each live scheduler that reported work for `model`."""
        for sid in [s for s, (at, _) in self._by.items() if now - at > self.expiry_s]:
            del self._by[sid]  # silent: stopped or crashed (its work went with it)
        return [(at, r[model]) for at, r in self._by.values() if model in r]

    def total(self, model: str, now: float) -> Tally:
        out = Tally()
        for _, r in self.others(model, now):
            out = out + r.tally
        return out


def check_served(model: str, max_workers: int, failed: str | None) -> None:
    """503 at once for a model that will not get a worker: not served (`max_workers`
    0, `TENSORBUS_FLEET MODEL=0:0`) or failed (`failed`: why, from `failed_models`;
    None = not failed)."""
    if max_workers == 0:
        raise unavailable(f"model '{model}' is not served here (TENSORBUS_FLEET "
                          f"{model}=0:0)", retry_after=None)
    if failed is not None:
        raise unavailable(f"model '{model}' cannot start: {failed or FAILED}", retry_after=None)


def failed_models(status) -> dict[str, str]:
    """model -> why, for each model a `shared.messages.FleetStatus` says is `failed`."""
    return {m.model: m.reason or FAILED for m in status.models if m.state == "failed"}


def check_count(model: str, queued: int, n_ready: int, max_queue_per_worker: int,
                requests: int = 1) -> None:
    """The count bound: 429 when `queued` requests and this one's `requests` (a
    completions list: one per prompt) exceed `max_queue_per_worker` x the ready
    workers (at least one)."""
    if queued + requests > max_queue_per_worker * max(n_ready, 1):
        listed = f", and this list of {requests} prompts counts as {requests}" \
            if requests > 1 else ""  # fmt: skip
        raise overloaded(f"model '{model}' is at capacity ({queued} requests queued{listed}); "
                         "retry after the hinted delay", retry_after=1.0)


def check(model: str, ahead: Tally, inputs: int, tokens: int, n_ready: int, max_batch: int,
          cost: Cost | None, left_s: float, max_queue_per_worker: int,
          max_queue_s: float, by_work: bool = True, size_unknown: bool = False) -> None:
    """Raise 429 unless one more request (`inputs`, `tokens`) fits behind `ahead`.

    `by_work=False` (a completion's reservation, before its size is known) applies
    the count bound alone; a generation's submit is `check_generation`'s. `size_unknown` (the
    gateway, before tokenizing, passing 0 and 0): the decision counts no work of its
    own, and Retry-After assumes it is the size of an average request ahead."""
    n = max(n_ready, 1)
    check_count(model, ahead.requests, n, max_queue_per_worker)
    if not by_work:
        return
    if cost is None:
        if ahead.inputs + inputs > UNMEASURED_BATCHES * max(max_batch, 1) * n and ahead.requests:
            raise overloaded(f"model '{model}' is at capacity ({ahead.requests} requests queued, "
                             "its cost not measured yet); retry after the hinted delay",
                             retry_after=1.0)
        return
    # When its batch would be done: the work ahead and its own, spread over the workers.
    finish_s = cost.seconds(ahead.inputs + inputs, ahead.tokens + tokens, max_batch) / n
    hint_s = finish_s  # the same, for Retry-After, with a typical size when its own is unknown
    if size_unknown and ahead.requests:
        hint_s = cost.seconds(ahead.inputs + ahead.inputs // ahead.requests,
                              ahead.tokens + ahead.tokens // ahead.requests, max_batch) / n
    if finish_s > max_queue_s and ahead.requests:
        raise overloaded(
            f"model '{model}' is at capacity ({ahead.requests} requests queued, about "
            f"{finish_s:.1f} s of work per worker); retry after the hinted delay",
            retry_after=retry_after(hint_s - max_queue_s))
    if finish_s > left_s * DEADLINE_HEADROOM:
        raise overloaded(
            f"model '{model}' cannot finish this request before its deadline: about "
            f"{finish_s:.1f} s of work is ahead of it per worker and it has {max(left_s, 0):.1f} s; "
            "retry after the hinted delay", retry_after=retry_after(hint_s - left_s * DEADLINE_HEADROOM))


def prompt_wait(ahead: Tally, n: int, n_ready: int, slots: int, running: int, cost: GenCost,
                chunk: int) -> float:
    """Engine seconds, per ready worker, before a new generation's prompt (`n`
    choices) starts computing behind `ahead`: the prompts ahead not computed yet (the
    sequences beyond the `running` ones the workers' heartbeats report), the decode
    steps run between their chunks, and, when every one of the `slots` per worker is
    taken, the waves of sequences ahead that generate to their end (their max_tokens
    x the share of it recent sequences generated) before a slot frees."""
    seqs = ahead.inputs
    if seqs <= 0:
        return 0.0
    w, slots = max(n_ready, 1), max(slots, 1)
    share = max(0, seqs - running) / seqs
    tokens, prompts = ahead.tokens * share / w, ahead.requests * share / w
    b = min(seqs / w, slots)  # the sequences each step advances
    wait = cost.prefill_s(prompts, tokens, chunk) + math.ceil(tokens / max(chunk, 1)) * cost.step_s(b)
    over = seqs + n - slots * w  # sequences beyond the slots, its own last
    if over > 0:
        waves = math.ceil(over / (slots * w))
        per_seq = ahead.decode * cost.length / seqs  # tokens a sequence ahead will generate
        wait += waves * cost.decode_s(per_seq * slots, slots)  # a wave: every slot's, to its end
    return wait


def check_generation(model: str, ahead: Tally, n: int, prompt: int, n_ready: int, slots: int,
                     running: int, cost: GenCost | None, left_s: float,
                     max_queue_per_worker: int, max_queue_s: float, chunk: int,
                     listed: int = 1) -> None:
    """Raise 429 unless a generation of `n` choices of a `prompt`-token prompt fits
    behind `ahead`: the count bound, then (with `cost`) the work ahead of its prompt
    plus the prompt's own, per worker, within `max_queue_s` and within
    DEADLINE_HEADROOM of the time it has left. What it generates after its first
    token is not bounded here: the sequences in a step share it, and a healthy
    generation runs to its end (only the work ahead of a new prompt delays it).

    A completions list of `listed` prompts is judged as its last prompt (`n`,
    `prompt`) with the list's other prompts in `ahead` (their prompt tokens, their
    choices, their max_tokens x n): the work its last first token waits for, as a
    scheduler sees it once the others are dispatched; the count bound counts the
    list as `listed` requests."""
    w = max(n_ready, 1)
    check_count(model, ahead.requests - (listed - 1), w, max_queue_per_worker, listed)
    if cost is None:
        return  # no decoder worker timed yet: the count bound alone
    wait_s = prompt_wait(ahead, n, w, slots, running, cost, chunk)
    b = min(ahead.inputs / w, slots)
    own_s = cost.prefill_s(1, prompt, chunk) + (
        math.ceil(prompt / max(chunk, 1)) * cost.step_s(b) if ahead.inputs else 0.0)
    first_s = wait_s + own_s  # when its prompt is computed: its first token
    if first_s > max_queue_s and ahead.requests:
        raise overloaded(
            f"model '{model}' is at capacity ({ahead.requests} requests queued, about "
            f"{wait_s:.1f} s of work ahead of a new prompt per worker); retry after the "
            "hinted delay", retry_after=retry_after(first_s - max_queue_s))
    if first_s > left_s * DEADLINE_HEADROOM:
        raise overloaded(
            f"model '{model}' cannot compute this request's prompt before its deadline: "
            f"about {wait_s:.1f} s of work is ahead of it per worker, its prompt takes about "
            f"{own_s:.1f} s, and it has {max(left_s, 0):.1f} s; retry after the hinted delay",
            retry_after=retry_after(first_s - left_s * DEADLINE_HEADROOM))


def retry_after(seconds: float) -> float:
    """A hint in tenths of a second, at least 0.1 s."""
    return max(0.1, math.ceil(seconds * 10 - 1e-6) / 10)


def drained(ahead: Tally, cost: Cost | None, max_batch: int, n_ready: int,
            elapsed_s: float) -> Tally:
    """`ahead` as its scheduler will count it `elapsed_s` later if nothing new arrives
    (the gateway's view of reports that may be an interval old): the ready workers keep
    computing meanwhile, and a scheduler's count drops by whole batches, when a worker
    says one is done. Only the batches surely done by then are taken off: drained
    continuously, the view would show room a fraction of a batch early, which the
    scheduler then refuses (a burst at the bound asked it in vain, a round trip each)."""
    if cost is None or elapsed_s <= 0 or ahead.tokens <= 0 or ahead.inputs <= 0:
        return ahead
    batch = max(max_batch, 1)
    batch_s = cost.seconds(min(batch, ahead.inputs),
                           ahead.tokens * min(batch, ahead.inputs) / ahead.inputs, batch)
    if batch_s <= 0:
        return ahead
    done = math.floor(elapsed_s * max(n_ready, 1) / batch_s) * batch  # inputs computed
    if done <= 0:
        return ahead
    share = max(0.0, 1 - done / ahead.inputs)
    return Tally(math.ceil(ahead.requests * share), math.ceil(ahead.inputs * share),
                 math.ceil(ahead.tokens * share))
