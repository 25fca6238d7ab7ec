"""Prefixes this scheduler has sent to each worker, until the worker's heartbeats
can say so themselves.

A worker announces the prefixes it caches once a heartbeat interval, and only after
it has computed them; a conversation's next turn often comes sooner (an answer of a
few tokens, a client that replies at once). Routed by the heartbeats alone, it would
go by load and compute the conversation again elsewhere. So a prompt's keys count
as held by the worker it went to from dispatch until a few heartbeat intervals after
the request finished; by then the worker's own summary says whether it still holds
them (it may have evicted them: then they are forgotten here too). Bounded per worker.
Nothing here survives a restart: heartbeats rebuild the view.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from typing import cast

LIMIT = 4096  # keys remembered per worker, most recent kept


class Held:
    """What a worker holds, as far as routing knows: its heartbeat's keys and what
    was sent to it recently (`in` is the only operation)."""

    def __init__(self, announced: frozenset[int], sent: OrderedDict[int, float] | None,
                 now: float) -> None:
        self.announced, self.sent, self.now = announced, sent, now

    def __contains__(self, key: object) -> bool:  # object: a Container[int]
        if key in self.announced:
            return True
        return self.sent is not None and self.sent.get(cast(int, key), -1.0) > self.now


class Routed:
    def __init__(self, grace_s: float, limit: int = LIMIT) -> None:
        self.grace_s = grace_s
        self.limit = limit
        self._sent: dict[str, OrderedDict[int, float]] = {}  # worker -> key -> until

    def sent(self, worker: str, keys: list[int]) -> None:
        """`keys` went to `worker` in a request: held while it runs."""
        d = self._sent.setdefault(worker, OrderedDict())
        for k in keys:
            d[k] = math.inf
            d.move_to_end(k)
        while len(d) > self.limit:
            d.popitem(last=False)

    def finished(self, worker: str, keys: list[int], now: float) -> None:
        """That request is done: its keys count `grace_s` longer, then only heartbeats."""
        d = self._sent.get(worker)
        if d is None:
            return
        for k in keys:
            if k in d:
                d[k] = now + self.grace_s
        for k in [k for k, until in d.items() if until <= now]:
            del d[k]

    def forget(self, worker: str) -> None:
        self._sent.pop(worker, None)

    def size(self, worker: str, announced: frozenset[int]) -> int:
        """About how many blocks `worker` caches: announced, and sent not yet announced."""
        return len(announced) + len(self._sent.get(worker, ()))

    def held(self, worker: str, announced: frozenset[int], now: float) -> Held:
        return Held(announced, self._sent.get(worker), now)
