"""Sites: which of the ready workers a request may go to, by where they run.

Every worker announces its `TENSORBUS_SITE` in its heartbeats; a scheduler has one
too (the same setting). A request goes to a worker at the scheduler's own site while
one of them has room, and spills to the other sites only when its site has no ready
worker of the model or every one of them is at capacity. Capacity is the count bound
admission already applies (`max_queue_per_worker` requests outstanding per worker,
`shared.admission.check_count`), counted per worker the way routing counts load.
With one site (every site "") nothing is filtered. docs/decisions/0054-sites.md.
"""

from __future__ import annotations

from typing import Callable

from services.fleet import WorkerView


def at_site(ready: list[WorkerView], site: str, load: Callable[[WorkerView], int],
            capacity: int) -> list[WorkerView]:
    """The workers of `ready` to choose among: this site's with room, else all."""
    local = [w for w in ready if w.hb.site == site]
    if len(local) == len(ready):
        return ready
    roomy = [w for w in local if load(w) < capacity]
    return roomy or ready

