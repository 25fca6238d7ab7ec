"""The orchestrator's policy with a fake clock and fake processes: what it starts and
stops given bounds, decisions, the machine budget and each model's exits."""

from __future__ import annotations

import pytest

from services.orchestrator.policy import (
    ModelSpec,
    Policy,
    ProcView,
    model_specs,
    model_state,
    threads_per_worker,
)
from shared.config import EX_CONFIG, Config
from shared.telemetry import ScaleDecision

ENC, LM, CHAT = "all-MiniLM-L6-v2", "tensorbus-demo-lm", "smollm2-135m-instruct"


def decision(model: str, desired: int, sched: str = "s1", held: int = 0) -> ScaleDecision:
    return ScaleDecision(model, 0, desired, 0, 0, "test", 0.0, scheduler_id=sched, held=held)


class Fleet:
    """Fake processes: carries out each plan at once, as the orchestrator would."""

    def __init__(self, policy: Policy) -> None:
        self.policy = policy
        self.procs: dict[str, ProcView] = {}
        self.n = 0

    def step(self, now: float):
        plan = self.policy.plan(list(self.procs.values()), now)
        for model in plan.start:
            self.n += 1
            name = f"{model}.{self.n}"
            self.procs[name] = ProcView(name, model, now)
        for name in plan.stop:
            p = self.procs[name]
            self.procs[name] = ProcView(p.name, p.model, p.started_at, stopping=True)
        return plan

    def running(self, model: str) -> int:
        return sum(1 for p in self.procs.values() if p.model == model and not p.stopping)

    def exit(self, name: str, code: int, now: float, reason: str = "") -> str:
        return self.policy.exited(self.procs.pop(name), code, reason, now)

    def drained(self) -> None:
        for name in [n for n, p in self.procs.items() if p.stopping]:
            self.exit(name, 0, 0.0)

    def of(self, model: str) -> list[str]:
        return [n for n, p in self.procs.items() if p.model == model and not p.stopping]


def test_minimums_start_at_once_without_a_decision():
    fleet = Fleet(Policy([ModelSpec(ENC, 2, 4), ModelSpec(LM, 0, 1)], budget=8))
    plan = fleet.step(0.0)
    assert sorted(plan.start) == [ENC, ENC]
    assert fleet.running(LM) == 0


def test_scales_up_and_down_to_the_desired_count_within_bounds():
    policy = Policy([ModelSpec(ENC, 1, 3)], budget=8)
    fleet = Fleet(policy)
    fleet.step(0.0)
    policy.observe(decision(ENC, 2), 1.0)
    assert fleet.step(1.0).start == [ENC]
    assert fleet.running(ENC) == 2
    policy.observe(decision(ENC, 9), 2.0)  # above max: capped
    fleet.step(2.0)
    assert fleet.running(ENC) == 3
    policy.observe(decision(ENC, 0), 3.0)  # below min: floored
    plan = fleet.step(3.0)
    assert len(plan.stop) == 2 and fleet.running(ENC) == 1
    # The newest workers drain first; the oldest (surely warm) stays.
    assert fleet.of(ENC) == [f"{ENC}.1"]


def test_a_model_with_minimum_zero_starts_on_demand_and_stops_at_zero():
    policy = Policy([ModelSpec(LM, 0, 1)], budget=4)
    fleet = Fleet(policy)
    assert fleet.step(0.0).start == []
    policy.observe(decision(LM, 1), 1.0)
    assert fleet.step(1.0).start == [LM]
    policy.observe(decision(LM, 0), 5.0)
    assert len(fleet.step(5.0).stop) == 1
    assert fleet.running(LM) == 0


def test_the_budget_serves_models_with_a_minimum_first_in_fleet_order():
    config = Config.from_env({}, fleet=f"{LM}=0:2,{CHAT}=1:2,{ENC}=2:4")
    specs = model_specs(config, [ENC, LM, CHAT, "other-model"])
    assert [s.name for s in specs] == [LM, CHAT, ENC, "other-model"]  # fleet order, then the rest
    policy = Policy(specs, budget=4)
    for m in (LM, CHAT, ENC):
        policy.observe(decision(m, 2), 0.0)
    fleet = Fleet(policy)
    plan = fleet.step(0.0)
    # minimums first (chat 1, encoder 2, other 1 -> 4), nothing left for the demo LM
    assert fleet.running(CHAT) == 1 and fleet.running(ENC) == 2
    assert fleet.running("other-model") == 1 and fleet.running(LM) == 0
    assert "budget" in plan.notes[LM] and "budget" in plan.notes[CHAT]


def test_budget_extras_go_in_priority_order_and_draining_workers_hold_their_slot():
    policy = Policy([ModelSpec(ENC, 1, 4), ModelSpec(LM, 0, 2)], budget=3)
    fleet = Fleet(policy)
    policy.observe(decision(ENC, 4), 0.0)
    policy.observe(decision(LM, 2), 0.0)
    fleet.step(0.0)
    assert fleet.running(ENC) == 3 and fleet.running(LM) == 0
    # The encoder's demand drops: its surplus drains, and only once drained does the
    # demo LM get the freed slots (the machine never runs more than the budget).
    policy.observe(decision(ENC, 1), 1.0)
    plan = fleet.step(1.0)
    assert len(plan.stop) == 2 and plan.start == []
    fleet.drained()
    fleet.step(2.0)
    assert fleet.running(ENC) == 1 and fleet.running(LM) == 2
    assert len(fleet.procs) <= 3


def test_a_crashed_worker_restarts_at_once_then_with_growing_backoff():
    policy = Policy([ModelSpec(ENC, 1, 1)], budget=4, backoff_s=1.0, backoff_max_s=8.0)
    fleet = Fleet(policy)
    fleet.step(0.0)
    now, waits = 0.0, []
    for _ in range(6):
        (name,) = fleet.of(ENC)
        assert fleet.exit(name, -9, now, "killed by SIGKILL") == "crashed"
        t = now
        while not fleet.step(t).start:  # the orchestrator ticks until the retry time
            assert fleet.running(ENC) == 0
            t += 0.25
        waits.append(t - now)
        now = t
    assert waits == [0.0, 1.0, 2.0, 4.0, 8.0, 8.0]


def test_a_worker_that_ran_a_while_before_crashing_restarts_at_once():
    policy = Policy([ModelSpec(ENC, 1, 1)], budget=4, stable_s=60.0)
    fleet = Fleet(policy)
    fleet.step(0.0)
    fleet.exit(fleet.of(ENC)[0], 1, 0.5)
    fleet.step(0.5)
    fleet.exit(fleet.of(ENC)[0], 1, 1.0)  # second quick crash: back-off
    assert fleet.step(1.0).start == []
    assert fleet.step(2.0).start == [ENC]
    fleet.exit(fleet.of(ENC)[0], -9, 100.0)  # ran 98 s: the count starts again
    assert fleet.step(100.0).start == [ENC]


def test_exit_78_fails_the_model_and_it_is_not_restarted():
    policy = Policy([ModelSpec(ENC, 1, 2), ModelSpec(LM, 1, 1)], budget=4)
    fleet = Fleet(policy)
    fleet.step(0.0)
    reason = "bad configuration: TENSORBUS_ENGINE='tpu' for tensorbus-demo-lm: use one of jax, torch"
    assert fleet.exit(fleet.of(LM)[0], EX_CONFIG, 1.0, reason) == "failed"
    policy.observe(decision(LM, 1), 2.0)
    for t in (1.0, 5.0, 100.0):
        assert LM not in fleet.step(t).start
    assert policy.failed(LM) == reason
    assert fleet.running(ENC) == 1  # the other model is untouched
    assert model_state(0, 0, 0, policy.failed(LM)) == "failed"


def test_a_worker_asked_to_stop_is_not_a_crash():
    policy = Policy([ModelSpec(ENC, 0, 2)], budget=4)
    fleet = Fleet(policy)
    policy.observe(decision(ENC, 1), 0.0)
    fleet.step(0.0)
    policy.observe(decision(ENC, 0), 1.0)
    fleet.step(1.0)
    (name,) = [n for n, p in fleet.procs.items() if p.stopping]
    assert fleet.exit(name, -9, 40.0) == "stopped"  # even when the drain deadline killed it
    assert policy.retry_at(ENC) == 0.0


def test_decisions_of_a_silent_scheduler_expire():
    policy = Policy([ModelSpec(ENC, 1, 4)], budget=8, decision_ttl_s=10.0)
    fleet = Fleet(policy)
    policy.observe(decision(ENC, 3, "a"), 0.0)
    policy.observe(decision(ENC, 1, "b"), 0.0)
    fleet.step(0.0)
    assert fleet.running(ENC) == 3
    policy.observe(decision(ENC, 1, "b"), 8.0)  # b keeps talking, a went silent
    fleet.step(9.0)
    assert fleet.running(ENC) == 3
    fleet.step(11.0)
    assert fleet.running(ENC) == 1
    fleet.drained()
    # Nobody speaks any more (schedulers restarting): the last combined count holds.
    policy.observe(decision(ENC, 2, "b"), 12.0)
    fleet.step(12.0)
    fleet.step(40.0)
    assert policy.desired(ENC, 40.0) == 2 and fleet.running(ENC) == 2


def test_held_requests_of_every_live_scheduler_count():
    policy = Policy([ModelSpec(ENC, 0, 4)], budget=8, target_per_replica=32.0)
    policy.observe(decision(ENC, 1, "a", held=5), 0.0)
    policy.observe(decision(ENC, 1, "b", held=40), 0.0)
    assert policy.desired(ENC, 0.0) == 2


def test_models_leaving_the_catalogue_drain():
    policy = Policy([ModelSpec(ENC, 1, 1), ModelSpec("gone", 1, 1)], budget=4)
    fleet = Fleet(policy)
    fleet.step(0.0)
    policy.set_models([ModelSpec(ENC, 1, 1)])
    plan = fleet.step(1.0)
    assert plan.stop == ["gone.2"]


def test_a_malformed_fleet_is_refused():
    with pytest.raises(ValueError, match="MODEL=MIN:MAX"):
        model_specs(Config.from_env({}, fleet="all-MiniLM-L6-v2=2"), [ENC])


def test_states_and_core_split():
    assert model_state(1, 1, 0, "") == "starting"
    assert model_state(1, 1, 1, "") == "ready"
    assert model_state(0, 0, 0, "") == "scaled_to_zero"
    assert model_state(0, 1, 0, "") == "starting"  # draining the last one still runs
    assert threads_per_worker(16, 3, "split") == 5
    assert threads_per_worker(2, 4, "split") == 1
    assert threads_per_worker(8, 0, "split") == 8


def test_shared_threads_give_every_worker_every_core_by_default():
    # An idle worker's threads hold no core: a busy one beside it may use them all
    # (docs/decisions/0060: shared beat split on up.sh's stack where it mattered).
    assert threads_per_worker(2, 2) == 2
    assert threads_per_worker(16, 3) == 16
    assert Config.from_env({}).worker_threads == "shared"
    assert threads_per_worker(2, 2, Config.from_env({}).worker_threads) == 2
    assert threads_per_worker(16, 3, "shared") == 16
    assert threads_per_worker(16, 3, "4") == 4
    assert threads_per_worker(0, 2) == 1
