"""Load generators that keep the outcome of every request (fault, overload and soak runs;
the tests and bench/ both use them).

`ClosedLoop`: N clients, each sending its next request when its last one returns.
`OpenLoop`: requests at a fixed rate whatever the answers (overload is only real when
the sender does not slow down with the server).

Each request ends as one `Outcome`: a status (200, or the contract's error code), or
`lost` when no answer came before the client's own timeout, which is the request's
deadline plus a margin (a lost request is one the system dropped silently).
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from dataclasses import dataclass

from nats.errors import NoRespondersError

from shared.errors import HEADER_CODE, HEADER_RETRY_AFTER
from bench.support.stats import pct_ms

LOST = "lost"


@dataclass
class Outcome:
    sent: float  # monotonic
    took: float  # seconds until the answer (or the client's timeout)
    status: int | str  # HTTP-like status, or LOST, or a client-side error name
    retry_after: float | None = None


async def one(nc, subject: str, body: bytes, timeout: float, headers: dict | None = None) -> Outcome:
    t0 = time.monotonic()
    try:
        msg = await nc.request(subject, body, timeout=timeout, headers=headers)
    except TimeoutError:
        return Outcome(t0, time.monotonic() - t0, LOST)
    except NoRespondersError:
        # nats-server's own 503: nobody subscribes to the subject right now (a gateway
        # that has not resubscribed after a bus restart yet). A clear answer, not a loss.
        return Outcome(t0, time.monotonic() - t0, 503)
    except Exception as exc:  # noqa: BLE001 - reported, e.g. no responders
        return Outcome(t0, time.monotonic() - t0, type(exc).__name__)
    h = msg.headers or {}
    ra = h.get(HEADER_RETRY_AFTER)
    return Outcome(t0, time.monotonic() - t0, int(h.get(HEADER_CODE, 200)),
                   float(ra) if ra else None)


class ClosedLoop:
    """`clients` concurrent clients cycling through `bodies` until `stop()`."""

    def __init__(self, nc, subject: str, bodies: list[bytes], clients: int, timeout: float,
                 headers: dict | None = None) -> None:
        self.nc, self.subject, self.bodies = nc, subject, bodies
        self.clients, self.timeout, self.headers = clients, timeout, headers
        self.outcomes: list[Outcome] = []
        self._stop = asyncio.Event()
        self._tasks: list[asyncio.Task] = []

    def start(self) -> "ClosedLoop":
        self._tasks = [asyncio.create_task(self._client(i)) for i in range(self.clients)]
        return self

    async def _client(self, i: int) -> None:
        k = i
        while not self._stop.is_set():
            body = self.bodies[k % len(self.bodies)]
            self.outcomes.append(await one(self.nc, self.subject, body, self.timeout, self.headers))
            k += self.clients

    async def wait_for(self, n: int, timeout: float = 60.0) -> None:
        """Until at least `n` requests have finished (progress, not a fixed sleep)."""
        end = time.monotonic() + timeout
        while len(self.outcomes) < n:
            if time.monotonic() > end:
                raise TimeoutError(f"only {len(self.outcomes)} of {n} requests finished")
            await asyncio.sleep(0.01)

    async def stop(self) -> list[Outcome]:
        """Stop sending; wait for the requests in flight (each ends by its timeout)."""
        self._stop.set()
        await asyncio.gather(*self._tasks)
        return self.outcomes


async def open_loop(nc, subject: str, bodies: list[bytes], rate: float, seconds: float,
                    timeout: float, headers: dict | None = None) -> list[Outcome]:
    """`rate` requests per second for `seconds`, each in its own task."""
    tasks = []
    t0 = time.monotonic()
    n = int(rate * seconds)
    for i in range(n):
        due = t0 + i / rate
        delay = due - time.monotonic()
        if delay > 0:
            await asyncio.sleep(delay)
        tasks.append(asyncio.create_task(one(nc, subject, bodies[i % len(bodies)], timeout, headers)))
    return list(await asyncio.gather(*tasks))


def summary(outcomes: list[Outcome]) -> dict:
    """Counts by outcome and latency percentiles (ms) of the successes and refusals."""
    by = Counter(str(o.status) for o in outcomes)
    ok = [o.took for o in outcomes if o.status == 200]
    refused = [o.took for o in outcomes if o.status == 429]
    return {"sent": len(outcomes), "succeeded": by.pop("200", 0), "lost": by.pop(LOST, 0),
            "failed": dict(sorted(by.items())), **_pct("ok", ok), **_pct("429", refused)}


def _pct(name: str, lat: list[float]) -> dict:
    if not lat:
        return {}
    return {f"{name}_p50_ms": pct_ms(lat, 50), f"{name}_p99_ms": pct_ms(lat, 99),
            f"{name}_max_ms": pct_ms(lat, 100)}
