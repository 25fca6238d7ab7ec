"""Engine time as admission estimates it: a model's cost, fitted to what its workers
report (shared.admission uses it to judge one more request).

1. `Cost`: an encoder's (or a decoder step's) engine seconds = per batch + per token
   x tokens. `CostBook` fits it per model over moving averages of the finished
   batches (`WorkDone.compute_s`, `.tokens`), starting from the workers' warm-up
   timing (`learn`); once settled, one outlying batch counts only as far as
   `OUTLIER`.
2. `GenCost`: a decoder's prefill (per chunk + per prompt token) and decode (per step
   + per sequence in it), with the share of max_tokens its recent sequences
   generated; `GenCostBook` refits it from the worker's own iterations, and
   `gen_cost` reads the ready workers' heartbeats into one.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

COST_WEIGHT = 0.2  # moving-average weight of the newest batch
OUTLIER = 1.5  # a batch counts as at most this many times (at least this fraction of)
# what the fit predicts for its tokens: one batch that ran while other processes took
# the cores (2.5x its usual time, in a burst's first half-second) moved the estimate
# +50 %, and the scheduler then refused what it had just admitted (decisions/0018).
# A lasting change still moves it, by up to 10 % a batch.
SETTLED = 3  # batches timed before the fit judges one against its prediction
LENGTH_WEIGHT = 0.05  # weight of the newest finished sequence in a decoder's generated share
MIN_LENGTH = 0.01  # the share is never taken as less (a run of cancelled sequences)


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
