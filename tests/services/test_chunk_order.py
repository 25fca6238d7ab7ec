"""A generation's chunks passed on once each and in order (services.gateway.continuity):
a duplicate is dropped, a gap or a missing last chunk ends the stream with a clear
503 `stream_broken`."""

from __future__ import annotations

import time
from contextlib import contextmanager

import pytest

from services.gateway.continuity import ChunkOrder, events
from services.gateway.outcome import Outcome
from services.gateway.inbox import PathLost, ReplyInbox
from shared.errors import ServiceError
from shared.messages import GenChunk, GenDone, GenerateWork, Sampling, Timing


def chunk(index: int, seq: int, last: bool = False) -> GenChunk:
    return GenChunk("r", index, f"{index}.{seq}", 1, "length" if last else None, seq=seq)


DONE = GenDone("r", "w", "m", "v", 3, 3, Timing())


def test_in_order_chunks_of_two_choices_pass_and_duplicates_are_dropped():
    order = ChunkOrder(2)
    got = [ev for ev in (chunk(0, 0), chunk(1, 0), chunk(0, 0), chunk(0, 1, True),
                         chunk(1, 1, True), chunk(1, 1, True), DONE) if order.take(ev)]
    assert [getattr(e, "text", "done") for e in got] == ["0.0", "1.0", "0.1", "1.1", "done"]
    assert order.dropped == 2 and order.passed == 4


def test_a_lost_chunk_ends_the_stream_clearly():
    order = ChunkOrder(1)
    assert order.take(chunk(0, 0))
    with pytest.raises(ServiceError) as err:
        order.take(chunk(0, 2))
    assert err.value.status == 503 and err.value.code == "stream_broken"
    assert "after 1 chunks" in err.value.message


def test_a_lost_last_chunk_ends_the_stream_at_its_done():
    order = ChunkOrder(1)
    assert order.take(chunk(0, 0))
    with pytest.raises(ServiceError) as err:
        order.take(DONE)
    assert err.value.code == "stream_broken"


def test_only_a_deterministic_single_choice_generation_is_resumed():
    from services.gateway.continuity import resumable
    from shared.messages import GenerateWork, Sampling

    def work(n=1, temperature=0.0, seed=None, prompt_logprobs=-1) -> GenerateWork:
        return GenerateWork("r", "m", "", [1, 2], 8, Sampling(temperature=temperature, seed=seed),
                            [], n, True, 0.0, "", prompt_logprobs=prompt_logprobs)

    assert resumable(work()) and resumable(work(temperature=0.8, seed=7))
    assert not resumable(work(temperature=0.8))  # a random draw: not the same again
    assert not resumable(work(n=2))
    assert not resumable(work(prompt_logprobs=2))


class _Front:
    """What `continuity.events` uses of the gateway's front end: a real ReplyInbox on
    a connection that never publishes; `submit` queues what the bus would bring."""

    def __init__(self, arrivals) -> None:
        from shared.config import Config

        class _Nc:
            is_connected = True

            def new_inbox(self) -> str:
                return "_INBOX.test"

        self.nc, self.config, self.retried, self.resumed = _Nc(), Config(), 0, 0
        self.inbox = ReplyInbox(self.nc)
        self.arrivals, self.submitted = arrivals, 0

    @contextmanager
    def dispatched(self, work, path_lost: bool = False):
        reply, self.q = self.inbox.open(work.request_id, work.deadline, retry=path_lost)
        try:
            yield reply, self.q
        finally:
            self.inbox.close(work.request_id)

    async def submit(self, work, reply: str) -> None:
        self.submitted += 1
        for item in self.arrivals:
            self.q.put_nowait(item)

    async def reconnected(self, deadline: float) -> None:
        pass


async def test_a_scheduler_path_lost_between_chunks_already_queued_does_not_end_the_stream():
    """A scheduler's connection drops while a stream is under way, and its notice lands
    between chunks the gateway reads in one go: the stream goes on whole (a scheduler
    is not on a running stream's path) instead of the reading failing on it."""
    lost = PathLost(own=False)
    arrivals = [chunk(0, 0), chunk(0, 1), lost, chunk(0, 2, last=True), DONE]
    front = _Front(arrivals)
    work = GenerateWork("r", "m", "", [1, 2], 3, Sampling(temperature=0), [], 1, True,
                        time.time() + 30, "", "sched")
    got = [ev async for batch in events(front, work, Outcome("chat")) for ev in batch]
    assert [ev.text for ev in got if isinstance(ev, GenChunk)] == ["0.0", "0.1", "0.2"]
    assert isinstance(got[-1], GenDone) and front.submitted == 1
