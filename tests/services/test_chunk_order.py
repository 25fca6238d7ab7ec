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


def test_only_a_deterministic_generation_is_resumed():
    from services.gateway.continuity import resumable
    from shared.messages import GenerateWork, Sampling

    def work(n=1, temperature=0.0, seed=None, prompt_logprobs=-1) -> GenerateWork:
        return GenerateWork("r", "m", "", [1, 2], 8, Sampling(temperature=temperature, seed=seed),
                            [], n, True, 0.0, "", prompt_logprobs=prompt_logprobs)

    assert resumable(work()) and resumable(work(temperature=0.8, seed=7))
    assert not resumable(work(temperature=0.8))  # a random draw: not the same again
    assert resumable(work(n=2)) and resumable(work(n=3, temperature=0.8, seed=7))
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
        self.sent: list[GenerateWork] = []
        self.inbox.cancel = self.cancel  # type: ignore[method-assign]  # nothing to tell

    @contextmanager
    def dispatched(self, work, path_lost: bool = False):
        reply, self.q = self.inbox.open(work.request_id, work.deadline, retry=path_lost)
        try:
            yield reply, self.q
        finally:
            self.inbox.close(work.request_id)

    async def submit(self, work, reply: str) -> None:
        """`arrivals`: what every submission brings, or (a dict) what each brings by
        request id."""
        self.submitted += 1
        self.sent.append(work)
        arrivals = self.arrivals
        for item in arrivals[work.request_id] if isinstance(arrivals, dict) else arrivals:
            self.q.put_nowait(item)

    async def reconnected(self, deadline: float) -> None:
        pass

    async def cancel(self, request_id: str, why: str) -> None:
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


def _lost() -> ServiceError:
    return ServiceError(503, "worker w was lost (expired)", code="worker_lost")


async def test_a_lost_worker_resumes_each_unfinished_choice_from_its_own_last_token():
    """Three choices: the first passed on whole, the second two tokens in, the third
    none, when the worker is lost. The resumption generates the second and third only,
    each from its own count, and its GenDone counts the first's tokens too."""
    first = [chunk(0, 0), chunk(0, 1, last=True), chunk(1, 0), chunk(1, 1), _lost()]
    then = [chunk(1, 0), chunk(2, 0), chunk(1, 1, last=True), chunk(2, 1, last=True),
            GenDone("r-r1", "w2", "m", "v", 2, 6, Timing())]
    front = _Front({"r": first, "r-r1": then})
    work = GenerateWork("r", "m", "", [1, 2], 4, Sampling(temperature=0.9, seed=5), [], 3,
                        True, time.time() + 30, "", "sched")
    got = [ev async for batch in events(front, work, Outcome("chat")) for ev in batch]
    assert [ev.text for ev in got if isinstance(ev, GenChunk)] == [
        "0.0", "0.1", "1.0", "1.1", "1.0", "2.0", "1.1", "2.1"]
    again = front.sent[-1]
    assert again.request_id == "r-r1" and again.choices == [1, 2] and again.skips == [2, 2, 0]
    assert again.sampling.seed == 5 and again.generated() == [1, 2]
    assert isinstance(got[-1], GenDone) and got[-1].completion_tokens == 6 + 2
    assert front.resumed == 1


async def test_choices_all_passed_on_whole_before_the_loss_end_without_a_new_request():
    """Every choice's last chunk passed on, the GenDone lost with the worker: nothing
    is generated again; the stream ends with a GenDone that counts what was passed on."""
    front = _Front({"r": [chunk(0, 0, last=True), chunk(1, 0, last=True), _lost()]})
    work = GenerateWork("r", "m", "", [1, 2], 1, Sampling(temperature=0), [], 2, False,
                        time.time() + 30, "", "sched")
    got = [ev async for batch in events(front, work, Outcome("chat")) for ev in batch]
    assert [ev.text for ev in got if isinstance(ev, GenChunk)] == ["0.0", "1.0"]
    assert isinstance(got[-1], GenDone) and got[-1].completion_tokens == 2
    assert front.submitted == 1
