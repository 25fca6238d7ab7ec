"""One request's `Outcome`: what telemetry needs to know about it, filled in on its way
through the gateway (the front end, the reply inbox, the call) and published as its
RequestRecord at the end."""

from __future__ import annotations

from dataclasses import dataclass, field

from shared.messages import Timing


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
