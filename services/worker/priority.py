"""The engine's threads below the serving path on a shared CPU.

A worker's engine computes on every core it can get (XLA's or torch's intra-op
threads). On a machine where the gateway, nats-server and the scheduler share those
cores (one box, a CPU engine), a burst far above capacity turns that into slow
refusals: the gateway handles each 429 in a tenth of a millisecond of CPU but waits
for the cores behind the engine's threads (docs/decisions/0014). `lower_threads`
gives every thread of this process but the caller (the event loop: heartbeats,
results) a higher nice value, so the serving processes run first when they want the
CPU and the engine keeps whatever they leave.

Linux only: a thread's nice value is its own there (`setpriority` on its thread id),
and threads a niced thread creates inherit it. Elsewhere this does nothing. An
unprivileged process cannot take it back: raising a nice value is one-way.
"""

from __future__ import annotations

import os
import threading

from shared.logging import get_logger

log = get_logger("worker.priority")


def lower_threads(nice: int) -> int:
    """Add `nice` to every other thread of this process (at most 19); returns how many
    threads it lowered."""
    if nice <= 0 or not os.path.isdir("/proc/self/task"):
        return 0
    own = threading.get_native_id()
    done = 0
    for name in os.listdir("/proc/self/task"):
        tid = int(name)
        if tid == own:
            continue
        try:
            now = os.getpriority(os.PRIO_PROCESS, tid)
            want = min(19, os.getpriority(os.PRIO_PROCESS, own) + nice)
            if now < want:
                os.setpriority(os.PRIO_PROCESS, tid, want)
                done += 1
        except OSError:  # the thread ended meanwhile, or not permitted
            continue
    log.info("engine_threads_lowered", nice=nice, threads=done)
    return done
