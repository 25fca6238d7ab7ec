"""Admission by work: how much compute a model's queue holds, and whether one more
request fits in it before its own deadline.

Work is estimated compute: tokens x the model's cost per token. Used by the scheduler
(the exact decision, with its own live tally) and the gateway (a refusal before
tokenizing when the queue is already full without the request). The flow:

  1. Cost (shared.costs): every finished encoder batch reports its engine seconds
     and its tokens (`WorkDone.compute_s`, `.tokens`); `CostBook` fits, per model,
     seconds = per batch + per token x tokens over moving averages of recent
     batches, so work is tokens x cost per token plus the batches they fill x cost
     per batch. Until the
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

from shared.costs import Cost, GenCost
from shared.errors import overloaded, unavailable

DEADLINE_HEADROOM = 0.5  # admit only what the estimate finishes in half the time left:
# the estimate counts engine time only (not the host work between batches) and a
# shared machine's speed moves; a request refused here is answered in milliseconds.
UNMEASURED_BATCHES = 2  # batches of inputs per ready worker before any batch was timed
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
