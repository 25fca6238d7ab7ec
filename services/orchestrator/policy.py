"""What the local orchestrator should run, decided without touching a process.

  1. `observe()` keeps the latest ScaleDecision of every scheduler per model, stamped
     with the orchestrator's own clock (`shared.scaling.LiveDecisions`); one older
     than `decision_ttl_s` has expired (its scheduler went silent) and no longer counts.
  2. `desired()` combines the live decisions (`shared.scaling.combine`). When every
     scheduler went silent the last combined count holds (a scheduler restarting is
     no reason to stop workers); before any decision, the model's minimum.
  3. `plan()` clamps each model's desire to its bounds, shares the machine budget out
     (minimums first, models with a minimum above 0 before the others, in fleet
     order; then the rest in the same order; draining workers still hold their
     slot), and returns which models get a new worker and which workers drain.
     A model in back-off after a crash waits for its retry time; a `failed` one
     (its worker exited 78) gets nothing.
  4. `exited()` classifies a worker's exit: asked to stop, invalid configuration
     (78, the model is `failed` with the reason), or a crash (restarted at once the
     first time, then after 1, 2, 4 ... `backoff_max_s` seconds; a worker that ran
     `stable_s` resets the count).

Pure: the caller passes `now` (monotonic seconds) and the processes it has, so the
tests drive it with a fake clock and fake processes.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable

from shared.config import EX_CONFIG, Config, parse_fleet
from shared.scaling import DECISION_TTL_S, LiveDecisions, combine
from shared.telemetry import ScaleDecision


@dataclass(frozen=True)
class ModelSpec:
    name: str
    min: int
    max: int


@dataclass(frozen=True)
class ProcView:
    """What the policy needs to know of one worker process."""

    name: str
    model: str
    started_at: float  # monotonic
    stopping: bool = False  # SIGTERM sent: draining, still holds its budget slot


@dataclass
class Plan:
    start: list[str] = field(default_factory=list)  # one model name per worker to start
    stop: list[str] = field(default_factory=list)  # process names to drain
    targets: dict[str, int] = field(default_factory=dict)  # workers each model should run
    notes: dict[str, str] = field(default_factory=dict)  # why a model runs fewer than it wants


@dataclass
class _History:
    crashes: int = 0  # consecutive crashes
    retry_at: float = 0.0
    last_exit: str = ""
    failed: str = ""  # reason, when a worker exited with invalid configuration


def model_specs(config: Config, catalogue: Iterable[str]) -> list[ModelSpec]:
    """The models to manage: those of the catalogue, TENSORBUS_FLEET's order first.

    Raises ValueError on a malformed TENSORBUS_FLEET."""
    fleet = parse_fleet(config.fleet)
    known = set(catalogue)
    names = [m for m in fleet if m in known] + sorted(known - set(fleet))
    return [ModelSpec(m, *config.fleet_bounds(m)) for m in names]


def threads_per_worker(cores: int, workers: int, setting: str = "shared") -> int:
    """Engine threads of each worker: "shared" (the default), every worker may use
    every core (an idle worker holds none, a busy one gets them all); "split", the
    machine's cores split evenly between the workers it runs (at least 1); or a
    number. docs/decisions/0060-worker-threads-split-or-shared.md has the figures."""
    if setting == "shared":
        return max(1, cores)
    if setting.isdigit() and int(setting) > 0:
        return int(setting)
    return max(1, cores // max(1, workers))


class Policy:
    def __init__(self, models: list[ModelSpec], budget: int, *, decision_ttl_s: float = DECISION_TTL_S,
                 backoff_s: float = 1.0, backoff_max_s: float = 30.0, stable_s: float = 60.0,
                 target_per_replica: float = 32.0) -> None:
        self.models: list[ModelSpec] = []
        self.budget = budget
        self.decision_ttl_s = decision_ttl_s
        self.backoff_s = backoff_s
        self.backoff_max_s = backoff_max_s
        self.stable_s = stable_s
        self.target_per_replica = target_per_replica
        self.history: dict[str, _History] = {}
        self.live = LiveDecisions(decision_ttl_s)
        self._last: dict[str, int] = {}  # last combined desire per model
        self.set_models(models)

    def set_models(self, models: list[ModelSpec]) -> None:
        """The catalogue changed (a model pushed to the registry); history is kept."""
        self.models = list(models)
        # Minimums above 0 first, then the written (fleet) order.
        order = sorted(self.models, key=lambda m: m.min == 0)
        self._priority = {m.name: i for i, m in enumerate(order)}

    # ------------------------------------------------------------- decisions
    def observe(self, decision: ScaleDecision, now: float) -> None:
        self.live.observe(decision, now)

    def desired(self, model: str, now: float) -> int | None:
        """Combined desire of the live schedulers (the last one when all went silent);
        None before any decision."""
        self.live.expire(now)
        latest = self.live.latest(model)
        if latest:
            self._last[model] = combine(latest, self.target_per_replica)
        return self._last.get(model)

    # ------------------------------------------------------------------ exits
    def exited(self, proc: ProcView, code: int, reason: str, now: float) -> str:
        """Record one worker's exit: "stopped", "failed" (78) or "crashed"."""
        h = self.history.setdefault(proc.model, _History())
        if proc.stopping:
            return "stopped"
        if code == EX_CONFIG:
            h.failed = reason or "invalid configuration (exit 78)"
            return "failed"
        if now - proc.started_at >= self.stable_s:
            h.crashes = 0
        h.crashes += 1
        delay = 0.0 if h.crashes == 1 else min(self.backoff_s * 2 ** (h.crashes - 2), self.backoff_max_s)
        h.retry_at = now + delay
        h.last_exit = reason
        return "crashed"

    def failed(self, model: str) -> str:
        """The reason `model` is failed, or ""."""
        h = self.history.get(model)
        return h.failed if h else ""

    def retry_at(self, model: str) -> float:
        h = self.history.get(model)
        return h.retry_at if h else 0.0

    # ------------------------------------------------------------------- plan
    def wanted(self, model: ModelSpec, now: float) -> int:
        if self.failed(model.name):
            return 0
        d = self.desired(model.name, now)
        return min(max(model.min if d is None else d, model.min), model.max)

    def targets(self, procs: list[ProcView], now: float) -> tuple[dict[str, int], dict[str, str]]:
        """Workers per model within bounds and budget, and notes on any model cut short."""
        free = self.budget - sum(1 for p in procs if p.stopping)
        want = {m.name: self.wanted(m, now) for m in self.models}
        order = sorted(self.models, key=lambda m: self._priority[m.name])
        got = dict.fromkeys(want, 0)
        for floor_only in (True, False):
            for m in order:
                cap = min(want[m.name], m.min) if floor_only else want[m.name]
                add = max(0, min(cap - got[m.name], free))
                got[m.name] += add
                free -= add
        notes = {name: f"machine budget full ({self.budget} workers, TENSORBUS_LOCAL_WORKERS)"
                 for name in want if got[name] < want[name]}
        return got, notes

    def plan(self, procs: list[ProcView], now: float) -> Plan:
        targets, notes = self.targets(procs, now)
        plan = Plan(targets=targets, notes=notes)
        for name in sorted(targets, key=lambda n: self._priority[n]):
            target = targets[name]
            live = sorted((p for p in procs if p.model == name and not p.stopping),
                          key=lambda p: p.started_at)
            if len(live) > target:  # the newest first: most likely still warming
                plan.stop += [p.name for p in reversed(live[target:])]
            elif len(live) < target:
                if now < self.retry_at(name):
                    h = self.history[name]
                    plan.notes[name] = f"restarting after {h.crashes} crashes in a row: {h.last_exit}"
                else:
                    plan.start += [name] * (target - len(live))
        # Workers of models no longer managed (removed from the catalogue) drain too.
        plan.stop += [p.name for p in procs if p.model not in targets and not p.stopping]
        # A worker told to drain now still runs until it exits: starts wait for room.
        room = max(0, self.budget - len(procs))
        for name in set(plan.start[room:]):
            plan.notes[name] = "waiting for draining workers to exit (machine budget)"
        del plan.start[room:]
        return plan


def model_state(target: int, running: int, ready: int, failed: str) -> str:
    """The state a ModelStatus reports: failed, ready, starting or scaled_to_zero."""
    if failed:
        return "failed"
    if ready > 0:
        return "ready"
    if target > 0 or running > 0:
        return "starting"
    return "scaled_to_zero"
