"""A completions request of several prompts (services.gateway.fanout): the `prompt`
field read into prompts or refused with a 400 naming the problem, the parts' answers
and streams merged in OpenAI's order with usage summed, a failing part failing the
request and stopping the others, and the list admitted as its sum
(shared.admission's `listed`)."""

from __future__ import annotations

import asyncio
import time
from types import SimpleNamespace

import pytest

from services.gateway import fanout
from services.gateway.call import Call
from services.gateway.generation import Prepared
from services.gateway.outcome import Outcome
from shared import admission
from shared.admission import Tally
from shared.costs import Cost, GenCost
from shared.api import MAX_PROMPTS, CompletionRequest, Usage
from shared.api_replies import CompletionChoice, CompletionChunk, CompletionResponse
from shared.errors import ServiceError, bad_request, overloaded
from shared.messages import GenerateWork, Sampling, Timing


# ------------------------------------------------------------------- split
@pytest.mark.parametrize("prompt,want", [
    ("a b", ["a b"]),
    ([5, 6, 7], [[5, 6, 7]]),
    (["a", "bb", "c"], ["a", "bb", "c"]),
    ([[1], [2, 3]], [[1], [2, 3]]),
    (["only"], ["only"]),
])
def test_the_prompt_field_is_read_as_prompts(prompt, want):
    assert fanout.prompts(prompt) == want


@pytest.mark.parametrize("prompt,needle", [
    ("", "'prompt' is empty"),
    ([], "empty list"),
    (["a", 5], "mixes strings and token ids"),
    ([[1, 2], 3], "mixes token ids and token-id lists"),
    (["a", "", "b"], "'prompt[1]' is empty"),
    ([[1], []], "'prompt[1]' is empty"),
    (["x"] * (MAX_PROMPTS + 1), f"at most {MAX_PROMPTS}"),
])
def test_a_bad_prompt_field_is_a_400_naming_the_problem(prompt, needle):
    with pytest.raises(ServiceError) as err:
        fanout.prompts(prompt)
    assert err.value.status == 400 and needle in err.value.message


def test_one_request_per_prompt_holds_its_prompt_alone():
    req = CompletionRequest(model="m", prompt=["a", "b"], n=2, echo=True, max_tokens=3)
    parts = fanout.per_prompt(req)
    assert [p.prompt for p in parts] == ["a", "b"]
    assert all(p.n == 2 and p.echo and p.max_tokens == 3 for p in parts)


def test_a_prompts_error_names_it_only_in_a_list():
    with pytest.raises(ServiceError) as err, fanout.naming(2, 3):
        raise bad_request("token id 999 is outside the vocabulary of 512 tokens")
    assert err.value.status == 400
    assert err.value.message == "'prompt[2]': token id 999 is outside the vocabulary of 512 tokens"
    with pytest.raises(ServiceError) as err, fanout.naming(0, 1):
        raise bad_request("the prompt has 200 tokens")
    assert err.value.message == "the prompt has 200 tokens"


# ------------------------------------------------------------------- merge
N = 2


def prepared(i: int, prompt: int, stream: bool = False, usage: bool = False) -> Prepared:
    work = GenerateWork(f"w-{i}", "m", "", [1] * prompt, 4, Sampling(), [], N, stream, 0.0, "")
    return Prepared(None, False, work, "m", 100, include_usage=usage)


class Cancels:
    def __init__(self) -> None:
        self.sent: list[str] = []

    async def cancel(self, rid: str, reason: str) -> None:
        self.sent.append(rid)


def a_call() -> Call:
    front = SimpleNamespace(inbox=Cancels())
    return Call(front, "client-id", "w", time.time() + 30, Outcome("completions", model="m"))


class Parts:
    """The single-prompt path as the merge sees it: part i answers `N` choices whose
    texts name it, after `delay[i]` seconds; part `fail` raises a 429 instead, and a
    part that is stopped notes it."""

    def __init__(self, delay: dict[int, float] | None = None, fail: int | None = None):
        self.delay = delay or {}
        self.fail = fail
        self.stopped: list[int] = []

    async def _wait(self, i: int) -> None:
        try:
            await asyncio.sleep(self.delay.get(i, 0.0))
        except asyncio.CancelledError:
            self.stopped.append(i)
            raise
        if i == self.fail:
            raise overloaded("model 'm' is at capacity", retry_after=1.0)

    async def whole(self, prep, call):
        i = int(prep.work.request_id.rsplit("-", 1)[1])
        await self._wait(i)
        call.out.version, call.out.completion_tokens = "1", 3 * N
        call.out.timing = Timing(compute=0.1 * (i + 1), itl_counts=[1, 2])
        return CompletionResponse(
            f"cmpl-{prep.work.request_id}", 100, "m",
            [CompletionChoice(j, f"p{i}c{j}", "length") for j in range(N)],
            Usage(prompt_tokens=len(prep.work.prompt), completion_tokens=3 * N,
                  total_tokens=len(prep.work.prompt) + 3 * N))

    async def chunks(self, prep, call):
        i = int(prep.work.request_id.rsplit("-", 1)[1])
        await self._wait(i)
        call.out.version = "1"
        for t in range(3):
            yield [CompletionChunk(f"cmpl-{prep.work.request_id}", 100, "m",
                                   [CompletionChoice(j, f"p{i}c{j}t{t} ", None)])
                   for j in range(N)]
        call.out.completion_tokens = 3 * N
        if prep.include_usage:
            yield [CompletionChunk("x", 100, "m", [], usage=Usage(
                prompt_tokens=len(prep.work.prompt), completion_tokens=3 * N,
                total_tokens=len(prep.work.prompt) + 3 * N))]


async def test_whole_answers_are_joined_in_prompt_then_choice_order():
    fan = fanout.Fanned([prepared(i, 3 + i) for i in range(3)], "w")
    call = a_call()
    reply = await fanout.whole(Parts(delay={0: 0.05}), fan, call)  # the first ends last
    assert [c.index for c in reply.choices] == list(range(3 * N))
    assert [c.text for c in reply.choices] == [f"p{i}c{j}" for i in range(3) for j in range(N)]
    assert reply.id == "cmpl-w"
    assert reply.usage == Usage(prompt_tokens=3 + 4 + 5, completion_tokens=9 * N,
                                total_tokens=12 + 9 * N)
    out = call.out
    assert (out.prompt_tokens, out.completion_tokens, out.version) == (12, 9 * N, "1")
    assert out.timing.compute == pytest.approx(0.3) and out.timing.itl_counts == [3, 6]
    assert call.parts == ["w-0", "w-1", "w-2"]


async def test_a_failing_part_fails_the_request_and_stops_the_others():
    fan = fanout.Fanned([prepared(i, 3) for i in range(3)], "w")
    call = a_call()
    parts = Parts(delay={0: 30.0, 2: 30.0}, fail=1)
    with pytest.raises(ServiceError) as err:
        await fanout.whole(parts, fan, call)
    assert err.value.status == 429
    assert sorted(parts.stopped) == [0, 2]
    assert sorted(call.front.inbox.sent) == ["w-0", "w-2"]


async def test_streams_merge_reindexed_under_one_id_with_one_usage_chunk():
    fan = fanout.Fanned([prepared(i, 3 + i, stream=True, usage=True) for i in range(3)], "w")
    call = a_call()
    texts: dict[int, str] = {}
    usages = []
    async for ready in fanout.chunks(Parts(delay={1: 0.02}), fan, call):
        for chunk in ready:
            assert chunk.id == "cmpl-w"
            if not chunk.choices:
                usages.append(chunk.usage)
            for c in chunk.choices:
                texts[c.index] = texts.get(c.index, "") + c.text
    assert texts == {i * N + j: "".join(f"p{i}c{j}t{t} " for t in range(3))
                     for i in range(3) for j in range(N)}
    assert usages == [Usage(prompt_tokens=12, completion_tokens=9 * N, total_tokens=12 + 9 * N)]
    assert call.out.completion_tokens == 9 * N and call.front.inbox.sent == []


async def test_a_failing_stream_ends_the_request_and_cancels_the_parts_still_running():
    fan = fanout.Fanned([prepared(i, 3, stream=True) for i in range(3)], "w")
    call = a_call()
    parts = Parts(delay={1: 0.2, 2: 30.0}, fail=1)  # part 0 ends first
    with pytest.raises(ServiceError) as err:
        async for _ in fanout.chunks(parts, fan, call):
            pass
    assert err.value.status == 429
    assert parts.stopped == [2]
    assert sorted(call.front.inbox.sent) == ["w-1", "w-2"]  # part 0 had ended


# -------------------------------------------------------------- admission
COST = GenCost(Cost(0.0, 1e-3), Cost(0.05, 0.0))


def test_a_list_counts_as_one_request_per_prompt():
    admission.check_count("m", 5, 1, 8, requests=3)
    with pytest.raises(ServiceError) as err:
        admission.check_count("m", 6, 1, 8, requests=3)
    assert err.value.status == 429 and "this list of 3 prompts counts as 3" in err.value.message


def test_a_list_is_judged_as_its_last_prompt_behind_the_others():
    """Three prompts of 1000 tokens, nothing else queued: the last one's first token
    waits for the others' prompts, so a deadline one prompt would meet is a 429."""
    kw = dict(n_ready=1, slots=4, running=0, cost=COST, max_queue_per_worker=256,
              max_queue_s=30.0, chunk=512)
    admission.check_generation("m", Tally(), 1, 1000, left_s=3.0, **kw)  # one prompt: ~1 s
    others = Tally(2, 2, 2000, 2 * 16)
    with pytest.raises(ServiceError) as err:
        admission.check_generation("m", others, 1, 1000, left_s=3.0, listed=3, **kw)
    assert err.value.status == 429 and "before its deadline" in err.value.message
    admission.check_generation("m", others, 1, 1000, left_s=30.0, listed=3, **kw)
