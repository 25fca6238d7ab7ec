"""Request priority: which lane a request's work waits in at the scheduler.

Two lanes, and a request can only choose the lower one:

- interactive (the default): dispatched at once to the least-loaded ready worker,
  admitted by the work ahead of it and its deadline (shared.admission).
- batch: work that may wait. A scheduler dispatches it only to a worker with idle
  capacity (fewer requests outstanding than its batch size or decode slots), after
  every interactive request it holds, and never refuses it for the work ahead or
  its deadline; it waits in the scheduler's batch lane instead
  (services.scheduler.lane). The batch runner marks every line it sends.

A request asks for the batch lane with the header `Tensorbus-Priority: batch` (NATS
or HTTP). Any client may lower its own request this way: it only gives up capacity.
Nothing raises a request above interactive, so the header grants no right a client
could abuse. On the internal wire the lane is `EmbedWork.priority` /
`GenerateWork.priority` (an int, default INTERACTIVE: older messages decode as
interactive).
"""

from __future__ import annotations

from shared.errors import bad_request

HEADER = "Tensorbus-Priority"
INTERACTIVE = 0
BATCH = 1  # a larger number waits behind a smaller one
NAMES = {"interactive": INTERACTIVE, "batch": BATCH}


def parse(raw: str | None) -> int:
    """The lane a request's `Tensorbus-Priority` header asks for (absent: interactive);
    any other value is a 400 naming the header and its values."""
    if not raw:
        return INTERACTIVE
    lane = NAMES.get(raw.strip().lower())
    if lane is None:
        raise bad_request(f"header '{HEADER}' is '{raw[:40]}'; it may be 'interactive' (the "
                          "default) or 'batch'", code="invalid_priority")
    return lane


def name(lane: int) -> str:
    """`interactive` or `batch`: the label a lane's metrics and logs carry."""
    return "batch" if lane >= BATCH else "interactive"
