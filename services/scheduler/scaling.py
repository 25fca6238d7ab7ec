"""How many workers a model should have: the scheduler's scaling decision, pure.

Each decision, for one model at one instant (`now`: this process's monotonic clock):

  1. Bounds: (min, max) from `Config.fleet_bounds`; `MODEL=0:0` is "not served": 0.
  2. Demand: the work this scheduler sees: held + max(dispatched here and
     unfinished, queued + in flight in the workers' heartbeats; a decoder's in flight
     are its occupied KV slots, its queued the sequences waiting for one), against
     `target_queue_per_replica` for encoders and `target_slots_per_replica` for
     decoders (unset: three quarters of `decode_slots`, the sequences a worker admits).
     need = ceil(demand / target).
  3. Floor: the minimum when it is above 0. With a minimum of 0: 0 until the model
     first has demand or a worker; then 1, and 0 again only after the model was
     idle (nothing held, queued or in flight) for `idle_to_zero_s`. `idle_to_zero_s`
     0 means "start on demand, never stop".
  4. Memory: ready workers above `memory_high` take no new work, so they are not
     capacity: they are added on top of what the demand needs.
  5. Stability: up at once; down only to the largest count recommended over the
     last `scale_down_s` (so demand must stay lower for the whole window, and a noisy
     load holds its peak instead of flapping). Idle for `idle_to_zero_s` goes to 0
     directly: the idle period is its own window.
  6. The result, clamped to max, is a ScaleDecision with its reason, this
     scheduler's id and its held and queued counts (`shared.scaling.combine` adds
     them up across schedulers).
"""

from __future__ import annotations

import math
import time
from collections import deque
from dataclasses import dataclass, field

from shared.config import Config
from shared.scaling import NOT_SERVED
from shared.telemetry import ScaleDecision


@dataclass(frozen=True)
class Demand:
    """What one scheduler knows of one model's load at one instant."""

    model: str
    kind: str = ""  # encoder | decoder | "" (unknown: treated as an encoder)
    ready: int = 0  # ready workers that take new work
    pressured: int = 0  # ready workers above memory_high
    starting: int = 0  # workers starting or warming
    held: int = 0  # requests this scheduler holds for a cold start
    queued: int = 0  # requests this scheduler dispatched and has not seen finish
    queue_depth: int = 0  # heartbeats: requests (sequences) waiting inside the workers
    in_flight: int = 0  # heartbeats: requests running (a decoder's: KV slots held)
    batch_waiting: int = 0  # batch work waiting for idle room: reported, not demand

    @property
    def workers(self) -> int:
        return self.ready + self.pressured + self.starting


@dataclass
class _Model:
    busy_at: float | None  # last instant with demand; None = never (and no workers)
    recent: deque = field(default_factory=deque)  # (now, recommended) in the window
    desired: int = 0


SLOTS_BUSY = 0.75  # default decoder target: this share of a worker's decode slots


def slots_target(decode_slots: int) -> float:
    """Busy slots per decoder worker to aim for when not set: three quarters of the
    sequences a worker admits, leaving a quarter for bursts while a new one starts."""
    return max(1.0, SLOTS_BUSY * decode_slots)


class Autoscaler:
    def __init__(self, config: Config, scheduler_id: str = "") -> None:
        self.config = config
        self.scheduler_id = scheduler_id
        self._models: dict[str, _Model] = {}

    def target(self, kind: str) -> float:
        if kind == "decoder":
            t = self.config.target_slots_per_replica or slots_target(self.config.decode_slots)
        else:
            t = self.config.target_queue_per_replica
        return max(t, 1e-9)

    def decide(self, d: Demand, now: float, at: float | None = None) -> ScaleDecision:
        lo, hi = self.config.fleet_bounds(d.model)
        st = self._models.get(d.model)
        if st is None:  # running workers get the idle period before they may go
            st = self._models[d.model] = _Model(busy_at=now if d.workers else None)
            st.recent.append((now, min(d.workers, hi)))
        if st.busy_at is None and d.workers:  # workers appeared: their idle clock starts
            st.busy_at = now
        load = d.held + max(d.queued, d.queue_depth + d.in_flight)
        if load > 0:
            st.busy_at = now
        need = math.ceil(load / self.target(d.kind)) if load else 0
        floor, idle = self._floor(st, lo, now)
        base = max(need, floor)
        recommended = min(base + d.pressured if base else 0, hi)
        if hi == 0:
            desired, reason = 0, NOT_SERVED
        elif recommended == 0:
            st.recent.clear()
            desired = 0
            reason = f"idle for {idle:.0f} s" if st.busy_at is not None else "no demand yet"
        else:
            window = self.config.scale_down_s
            while st.recent and now - st.recent[0][0] > window:
                st.recent.popleft()
            st.recent.append((now, recommended))
            desired = max(r for _, r in st.recent)
            reason = self._reason(d, need, floor, lo, hi, recommended, desired)
        st.desired = desired
        return ScaleDecision(
            model=d.model, ready_replicas=d.ready + d.pressured, desired_replicas=desired,
            queue_depth=d.queue_depth, in_flight=d.in_flight, reason=reason,
            at=time.time() if at is None else at, scheduler_id=self.scheduler_id,
            held=d.held, queued=d.queued, min_replicas=lo, max_replicas=hi, kind=d.kind,
            target_per_replica=self.target(d.kind), pressured=d.pressured,
            batch_waiting=d.batch_waiting)

    def _floor(self, st: _Model, lo: int, now: float) -> tuple[int, float]:
        """(the fewest workers now, seconds idle)."""
        idle = 0.0 if st.busy_at is None else now - st.busy_at
        if lo > 0:
            return lo, idle
        if st.busy_at is None:
            return 0, idle
        zero_after = self.config.idle_to_zero_s
        if zero_after <= 0 or idle < zero_after:
            return 1, idle
        return 0, idle

    @staticmethod
    def _reason(d: Demand, need: int, floor: int, lo: int, hi: int, recommended: int,
                desired: int) -> str:
        if desired > recommended:
            return f"demand lower ({recommended}); waiting out the scale-down window"
        if d.held and not d.ready:
            why = f"cold start: {d.held} held"
        elif need > floor:
            why = "demand above target" if need > d.ready else "demand at target"
        elif floor == lo and lo > 0:
            why = "minimum"
        else:
            why = "keeping one worker until idle" if need == 0 else "demand at target"
        if d.pressured:
            why += f"; {d.pressured} above the memory threshold"
        if desired == hi and max(need, floor) + d.pressured > hi:
            why += "; capped at the maximum"
        return why
