"""The gateway's budget for request bodies in memory at once.

Each HTTP body is bounded on its own (TENSORBUS_MAX_PAYLOAD, TENSORBUS_MAX_BODY);
many of them at once are bounded here, by TENSORBUS_MAX_INFLIGHT_BODY_BYTES: the
bytes of the bodies being read and parsed together. A request takes its share
before it reads (its Content-Length, when it states one) or as its chunks arrive
(a chunked body), and gives it back once its body is parsed. One that does not
fit is refused at once with a 429 naming the limit, with `Retry-After`, rather
than the gateway buffering without bound; it reads nothing more of that body.
"""

from __future__ import annotations

from prometheus_client import Gauge

from shared.errors import ServiceError, too_large

LIMIT_NAME = "TENSORBUS_MAX_INFLIGHT_BODY_BYTES"


class BodyBudget:
    """Bytes of request bodies held at once, against `limit`."""

    def __init__(self, limit: int, gauge: Gauge | None = None) -> None:
        self.limit = limit
        self.held = 0
        self._gauge = gauge

    def share(self) -> Share:
        """One request's share, empty until it takes bytes; `with` gives it back."""
        return Share(self)

    def _take(self, n: int, total: int) -> None:
        if total > self.limit:
            raise too_large(f"the request body takes {total} bytes or more; the limit of "
                            f"bodies in memory at once is {self.limit} bytes ({LIMIT_NAME})")
        if self.held + n > self.limit:
            raise ServiceError(
                429, f"the gateway is reading {self.held} bytes of request bodies; "
                f"{n} more would pass the limit of {self.limit} bytes ({LIMIT_NAME})",
                code="body_budget_exhausted", retry_after=1.0)
        self._set(self.held + n)

    def _give(self, n: int) -> None:
        self._set(self.held - n)

    def _set(self, held: int) -> None:
        self.held = held
        if self._gauge is not None:
            self._gauge.set(held)


class Share:
    """The bytes one request holds: it only grows (`hold`) until given back."""

    __slots__ = ("_budget", "bytes")

    def __init__(self, budget: BodyBudget) -> None:
        self._budget = budget
        self.bytes = 0

    def hold(self, total: int) -> None:
        """Hold `total` bytes in all (no-op when already held), or raise 429 / 413."""
        if total > self.bytes:
            self._budget._take(total - self.bytes, total)
            self.bytes = total

    def __enter__(self) -> Share:
        return self

    def __exit__(self, *exc) -> None:
        self._budget._give(self.bytes)
        self.bytes = 0
