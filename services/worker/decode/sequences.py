"""What a decoder worker tracks while it generates: a lane per loaded version, a
sequence per choice, a request per GenerateWork. The step scheduler
(services.worker.decode.scheduler) moves them; the output processor
(services.worker.decode.output) reads them. Host only.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from shared.messages import GenerateWork
from shared.priority import INTERACTIVE

if TYPE_CHECKING:
    from engine.interface import Decoder, PendingStep

# A batch sequence parked this long in all (seconds) is not parked again (rule 6).
MAX_PARK_S = 60.0


@dataclass(eq=False)
class Lane:
    """One loaded version's engine and the sequences in its KV slots."""

    version: str
    engine: Decoder
    eos: frozenset[int]
    max_context: int  # tokens per slot, prompt and generated together
    active: dict[int, "Sequence"] = field(default_factory=dict)  # slot -> sequence
    pending: PendingStep | None = None  # the dispatched decode step (a PendingStep), not yet read
    dispatched: int = 0  # decode steps dispatched so far (the pending one's number)
    seen: tuple[int, int] = (0, 0)  # the engine's prefix-cache queries and hits, counted
    spec_seen: tuple[int, int, int] = (0, 0, 0)  # its speculation counts, counted
    began: int = 0  # sequences begun on it so far (each one's `began` is its number)

    @classmethod
    def of(cls, version: str, engine: Decoder) -> "Lane":
        info = engine.info
        return cls(version, engine, frozenset(info.eos_token_ids), info.max_context)

    def free_slot(self) -> int | None:
        return next((s for s in range(self.engine.info.slots) if s not in self.active), None)

    def victim(self, holders: list[int]) -> int:
        """The preemption policy (`Decoder.make_room`): of the slots whose sequences
        hold cache, the one that began last; a slot the lane does not know first."""
        unknown = [s for s in holders if s not in self.active]
        if unknown:
            return unknown[-1]
        return max(holders, key=lambda s: self.active[s].began)

    @property
    def busy(self) -> bool:
        return bool(self.active) or self.pending is not None


@dataclass(eq=False)
class Sequence:
    """One choice of a request, as the scheduler sees it."""

    work: GenerateWork
    index: int  # choice index within the request
    seed: int
    arrived: float  # perf_counter
    lane: Lane | None = None
    slot: int = -1
    admitted: float = 0.0  # perf_counter of its first admission (0: never admitted)
    joined: int = 0  # number of the first decode step that includes it
    live: bool = False  # its prompt is computed: it is in decode steps
    began: int = 0  # its lane's count when it was last begun (the newest is preempted first)
    tokens: list[int] = field(default_factory=list)  # generated so far (a re-run needs them)
    finish: str | None = None  # set by the output processor (or "cancelled" here)
    parked_at: float = 0.0  # perf_counter when it was last parked (0: not parked now)
    parked_s: float = 0.0  # seconds parked before that, in all

    @property
    def batch(self) -> bool:
        """In the batch lane: it yields to interactive work (rule 6)."""
        return self.work.priority > INTERACTIVE

    def yields(self, now: float) -> bool:
        """A batch sequence that still makes way for interactive work: one parked
        for MAX_PARK_S in all does not (rule 6)."""
        parked = self.parked_s + (now - self.parked_at if self.parked_at else 0.0)
        return self.batch and parked < MAX_PARK_S


@dataclass(eq=False)
class Request:
    work: GenerateWork
    arrived: float
    remaining: int  # choices not yet retired
    version: str = ""  # fixed when its first choice is admitted
    cancelled: bool = False
    last_token: float = 0.0  # UNIX seconds of its latest token (0: none yet)
    expired: str = ""  # why it ran out of time: "deadline" | "stall" | "max_time"
