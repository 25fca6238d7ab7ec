"""A worker is dropped for its own silence, not for time the scheduler itself lost."""
from __future__ import annotations

from services.fleet import Fleet
from shared.telemetry import Heartbeat


def _hb(worker_id: str) -> Heartbeat:
    return Heartbeat(worker_id=worker_id, model="m", kind="decoder", state="ready",
                     versions=["local"], queue_depth=0, in_flight=0, max_batch=8,
                     batch_occupancy=0.0, steps=0, rss_bytes=0, device="cpu",
                     sent_at=0.0)


def test_a_silent_worker_expires_after_its_window():
    fleet = Fleet(expiry_s=1.0)
    fleet.observe(_hb("a"), now=10.0)
    assert fleet.expire(now=10.9) == []
    assert [w.worker_id for w in fleet.expire(now=11.1)] == ["a"]
    assert fleet.workers == {}


def test_time_the_scheduler_stalled_does_not_count_as_silence():
    """A loaded machine holds the scheduler's loop up in a row of pauses; the
    heartbeats sent meanwhile wait unread. The worker is still there."""
    fleet = Fleet(expiry_s=1.0)
    fleet.observe(_hb("a"), now=10.0)
    fleet.excuse(0.7)  # two pauses, each under the window, over it together
    fleet.excuse(0.6)
    assert fleet.expire(now=11.5) == []
    fleet.observe(_hb("a"), now=11.6)  # its heartbeats arrive
    assert fleet.expire(now=12.5) == []
    # Silence on time still counts: no heartbeat for a whole window.
    assert [w.worker_id for w in fleet.expire(now=12.7)] == ["a"]
