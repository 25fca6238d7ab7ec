"""The scaling decision (services/scheduler/scaling.py) and how decisions of several
schedulers combine (shared/scaling.py), on a fake monotonic clock."""

from __future__ import annotations

import os
import random
import subprocess
import sys

import pytest

from services.scheduler.scaling import Autoscaler, Demand
from shared.config import EX_CONFIG, Config
from shared.scaling import NOT_SERVED, LiveDecisions, check_settings, combine
from shared.telemetry import ScaleDecision

M = "enc"


def scaler(**kw) -> Autoscaler:
    base = dict(target_queue_per_replica=10.0, target_slots_per_replica=4.0, min_workers=1,
                max_workers=5, scale_down_s=30.0, idle_to_zero_s=0.0)
    base.update(kw)
    return Autoscaler(Config(**base), scheduler_id="s1")


def load(n: int, ready: int = 1, **kw) -> Demand:
    return Demand(M, kind="encoder", ready=ready, queue_depth=n, **kw)


def test_scales_up_within_one_decision_and_caps_at_the_maximum():
    a = scaler()
    assert a.decide(load(0), now=0).desired_replicas == 1
    d = a.decide(load(35), now=1)
    assert d.desired_replicas == 4 and "above target" in d.reason
    d = a.decide(load(500), now=2)
    assert d.desired_replicas == 5 and "maximum" in d.reason
    assert (d.min_replicas, d.max_replicas, d.scheduler_id) == (1, 5, "s1")


def test_scales_down_only_after_demand_stayed_lower_for_the_window():
    a = scaler()
    a.decide(load(40), now=0)  # 4
    assert a.decide(load(5), now=1).desired_replicas == 4
    d = a.decide(load(5), now=29)
    assert d.desired_replicas == 4 and "window" in d.reason
    # A brief rise inside the window starts it again from that rise.
    a.decide(load(25), now=29.5)  # 3
    assert a.decide(load(5), now=31).desired_replicas == 3
    assert a.decide(load(5), now=59).desired_replicas == 3
    assert a.decide(load(5), now=60).desired_replicas == 1


def test_a_fresh_scheduler_keeps_the_running_workers_for_the_window():
    a = scaler()
    assert a.decide(load(0, ready=3), now=0).desired_replicas == 3
    assert a.decide(load(0, ready=3), now=31).desired_replicas == 1


def test_zero_after_idle_and_back_up_on_demand():
    a = scaler(min_workers=0, idle_to_zero_s=60.0)
    assert a.decide(load(0, ready=0), now=0).desired_replicas == 0  # never used: nothing
    d = a.decide(load(0, ready=0, held=1), now=1)
    assert d.desired_replicas == 1 and d.reason.startswith("cold start") and d.held == 1
    assert a.decide(load(3), now=2).desired_replicas == 1
    assert a.decide(load(0), now=61).desired_replicas == 1  # idle 59 s
    d = a.decide(load(0), now=62.5)
    assert d.desired_replicas == 0 and d.reason.startswith("idle")
    assert a.decide(load(0, ready=0, held=2), now=63).desired_replicas == 1


def test_in_flight_work_is_not_idle():
    a = scaler(min_workers=0, idle_to_zero_s=10.0)
    a.decide(load(1), now=0)
    for t in range(1, 40):
        d = a.decide(Demand(M, kind="encoder", ready=1, in_flight=1), now=t)
        assert d.desired_replicas == 1


def test_min_zero_with_no_idle_period_starts_on_demand_and_never_stops():
    a = scaler(min_workers=0, idle_to_zero_s=0.0)
    assert a.decide(load(0, ready=0), now=0).desired_replicas == 0
    assert a.decide(load(0, ready=0, held=1), now=1).desired_replicas == 1
    assert a.decide(load(0), now=10_000).desired_replicas == 1


def test_fleet_bounds_per_model_and_zero_zero_is_not_served():
    a = scaler(fleet=f"{M}=2:3,other=0:0")
    assert a.decide(load(0), now=0).desired_replicas == 2
    assert a.decide(load(1000), now=1).desired_replicas == 3
    d = a.decide(Demand("other", held=5), now=1)
    assert d.desired_replicas == 0 and d.reason == NOT_SERVED


def test_decoders_scale_on_occupied_slots():
    a = scaler()
    d = a.decide(Demand(M, kind="decoder", ready=1, in_flight=8), now=0)
    assert d.desired_replicas == 2 and d.target_per_replica == 4.0
    enc = a.decide(Demand("e2", kind="encoder", ready=1, in_flight=8), now=0)
    assert enc.desired_replicas == 1


def test_the_default_decoder_target_follows_the_slots_a_worker_admits():
    """Unset, the target is three quarters of TENSORBUS_DECODE_SLOTS (48 of the
    default 64): a worker is asked for beside it when its slots are three quarters
    busy, not at 12 of its 64 (a target made for 16 slots)."""
    cfg = Config()
    a = Autoscaler(Config(min_workers=1, max_workers=8))
    assert a.target("decoder") == 0.75 * cfg.decode_slots
    busy = Demand(M, kind="decoder", ready=1, in_flight=40)
    assert a.decide(busy, now=0).desired_replicas == 1
    busy = Demand(M, kind="decoder", ready=1, in_flight=64, queue_depth=8)
    assert a.decide(busy, now=1).desired_replicas == 2
    small = Autoscaler(Config(decode_slots=16))
    assert small.target("decoder") == 12.0
    assert Autoscaler(Config(target_slots_per_replica=5.0)).target("decoder") == 5.0


def test_memory_pressured_workers_are_not_capacity():
    a = scaler()
    d = a.decide(Demand(M, kind="encoder", ready=0, pressured=1, held=1), now=0)
    assert d.desired_replicas == 2 and "memory" in d.reason and d.pressured == 1


def test_no_flapping_under_a_noisy_load():
    """Demand jitters around 2-3 workers' worth every interval for ten minutes."""
    a, rng = scaler(), random.Random(7)
    seen = []
    for i in range(300):
        seen.append(a.decide(load(rng.randint(12, 30)), now=i * 2.0).desired_replicas)
    changes = sum(1 for x, y in zip(seen, seen[1:]) if x != y)
    assert set(seen) <= {2, 3} and changes <= 2


def decision(sid: str, desired: int, held: int = 0, queued: int = 0, hi: int = 8) -> ScaleDecision:
    return ScaleDecision(model=M, ready_replicas=0, desired_replicas=desired, queue_depth=0,
                         in_flight=0, reason="", at=0.0, scheduler_id=sid, held=held,
                         queued=queued, min_replicas=0, max_replicas=hi,
                         target_per_replica=10.0)


def test_combine_sums_each_schedulers_own_work_not_the_shared_view():
    # Each holds 15 for a cold start: alone each wants 2, together they hold 30.
    assert combine([decision("a", 2, held=15), decision("b", 2, held=15)]) == 3
    # The workers' queue (the same in both views) is not counted twice.
    assert combine([decision("a", 4, queued=20), decision("b", 4, queued=20)]) == 4
    assert combine([decision("a", 1), decision("b", 0)]) == 1
    assert combine([decision("a", 8, held=500)]) == 8  # bounded by the maximum
    assert combine([]) == 0


def test_live_decisions_forget_a_silent_scheduler():
    live = LiveDecisions(ttl_s=10)
    live.observe(decision("a", 1, held=30), now=0)
    live.observe(decision("b", 1, held=30), now=5)
    assert live.desired(M) == 6 and live.held(M) == 60
    live.observe(decision("a", 3, held=30), now=2)  # the latest per scheduler
    assert live.desired(M) == 6
    assert live.expire(now=13) == {M}
    assert live.desired(M) == 3 and live.held(M) == 30


def test_workers_that_appear_get_the_idle_period_before_zero():
    a = scaler(min_workers=0, idle_to_zero_s=60.0)
    assert a.decide(load(0, ready=0), now=0).desired_replicas == 0
    assert a.decide(load(0, ready=1), now=10).desired_replicas == 1
    assert a.decide(load(0, ready=1), now=69).desired_replicas == 1
    assert a.decide(load(0, ready=1), now=70).desired_replicas == 0


@pytest.mark.parametrize("setting", [
    dict(fleet="enc=3:1"), dict(fleet="enc"), dict(memory_high=0.0), dict(memory_high=1.5),
    dict(min_workers=3, max_workers=2), dict(scale_down_s=-1.0),
    dict(target_queue_per_replica=0.0), dict(target_slots_per_replica=-1.0)])
def test_settings_that_cannot_work_exit_78(setting):
    with pytest.raises(SystemExit) as exc:
        check_settings(Config(**setting))
    assert exc.value.code == EX_CONFIG


def test_the_scheduler_process_exits_78_on_a_bad_fleet():
    env = {**os.environ, "TENSORBUS_FLEET": "all-MiniLM-L6-v2=2", "TENSORBUS_NATS_URL":
           "nats://127.0.0.1:1"}
    proc = subprocess.run([sys.executable, "-m", "services.scheduler"], env=env,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == EX_CONFIG
    assert "MODEL=MIN:MAX" in proc.stderr
