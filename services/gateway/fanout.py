"""Completions of several prompts in one request: `prompt` as a list of strings or of
token-id lists (OpenAI's and vLLM's batched completions), answered as one.

  1. `prompts` reads the `prompt` field: one prompt (a string, or a list of token
     ids), or a list of up to MAX_PROMPTS strings or token-id lists. An empty list,
     an empty prompt, strings mixed with token ids, or more prompts than that are a
     400 naming the problem. The completions pipeline (services.gateway.generation)
     then checks every prompt (its tokens, the context, max_tokens) before any is
     submitted: one bad prompt is the request's 400, naming it (`prompt[i]`).
  2. Admission takes the list as its sum (services.gateway.admission: `shed` counts
     one request per prompt; `shed_list` judges the prompts' tokens, choices and
     max_tokens together once they are tokenized), so a list is refused whole, with
     the error one request of its size gets, never in part.
  3. Each prompt becomes a GenerateWork of its own (`part_ids`: `<wire>-<i>`) with
     the request's sampling (a `seed` applies to each prompt as if it came alone),
     submitted together and in order, so the workers' steps carry them side by side
     as they would separate requests. They share one canary draw: without a `user`,
     the request's own id is their sticky key.
  4. `whole`: the parts' answers joined into one; choice `index` is prompt index x n
     + the choice's own (OpenAI's and vLLM's order), `usage` the sum. `chunks`: the
     parts' chunks as they come, re-indexed the same, under the request's one id;
     the parts' usage chunks become one at the end (`include_usage`), and
     `continuous_usage_stats` counts every prompt. A part that fails fails the
     request: the others are cancelled (their works too) and its error is the
     answer, or a stream's last chunk.
  5. The request keeps one Outcome (one telemetry record): the parts' tokens summed,
     the first part's version and worker, the slowest part's timing.

Both transports take the list: the NATS subject's body is the HTTP body.
"""

from __future__ import annotations

import asyncio
import dataclasses
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, AsyncGenerator, AsyncIterator, Sequence

import msgspec

from services.gateway.outcome import Outcome
from shared.api import MAX_PROMPTS, CompletionRequest, Usage
from shared.api_replies import CompletionChunk, CompletionResponse
from shared.errors import ServiceError, bad_request
from shared.logging import get_logger

if TYPE_CHECKING:
    from services.gateway.call import Call
    from services.gateway.generation import Generation, Prepared

log = get_logger("gateway")

KINDS = {str: "strings", int: "token ids", list: "token-id lists"}


# ------------------------------------------------------------------- split
def prompts(prompt: str | list) -> list[str | list[int]]:
    """The prompts a completions request's `prompt` holds, each a string or token
    ids, in order; a 400 naming what is wrong with the field."""
    if isinstance(prompt, str):
        if not prompt:
            raise bad_request("'prompt' is empty")
        return [prompt]
    if not prompt:
        raise bad_request("'prompt' is an empty list: send a prompt, or a list of prompts")
    kinds = {type(p) for p in prompt}
    if kinds == {int}:
        return [prompt]  # one prompt, as token ids
    if len(kinds) > 1:
        raise bad_request(f"'prompt' mixes {' and '.join(sorted(KINDS[k] for k in kinds))}: "
                          "send a string, a list of token ids, a list of strings, or a list "
                          "of token-id lists")
    if len(prompt) > MAX_PROMPTS:
        raise bad_request(f"'prompt' is a list of {len(prompt)} prompts; at most {MAX_PROMPTS} "
                          "per request")
    empty = next((i for i, p in enumerate(prompt) if not p), None)
    if empty is not None:
        raise bad_request(f"'prompt[{empty}]' is empty")
    return list(prompt)


def per_prompt(req: CompletionRequest) -> list[CompletionRequest]:
    """`req` as one request per prompt (`prompts`), each holding its prompt alone: a
    string or token ids, which is all the single-prompt path (and `echo`) reads."""
    return [msgspec.structs.replace(req, prompt=p) for p in prompts(req.prompt)]


@contextmanager
def naming(index: int, count: int):
    """A prompt's own 400 (its context, its token ids, its max_tokens), naming it as
    `prompt[index]` when the request holds `count` > 1 prompts."""
    try:
        yield
    except ServiceError as err:
        if count < 2:
            raise
        raise ServiceError(err.status, f"'prompt[{index}]': {err.message}", code=err.code,
                           retry_after=err.retry_after) from None


def part_ids(wire: str, count: int) -> list[str]:
    """The ids the prompts' works travel under: the request's, extended."""
    return [f"{wire}-{i}" for i in range(count)]


@dataclass
class Fanned:
    """A prepared completions request of several prompts: one Prepared
    (services.gateway.generation) per prompt, in order; `rid` the request's wire id."""

    parts: list[Prepared]
    rid: str

    @property
    def stream(self) -> bool:
        return self.parts[0].stream

    @property
    def n(self) -> int:
        return self.parts[0].work.n


# ------------------------------------------------------------------- merge
def _part_calls(call: Call, fan: Fanned) -> list[Call]:
    """One Call per part, each with an Outcome of its own (the request's is `merged`
    from them); the request's cancellation reaches every part (`call.parts`)."""
    call.parts = [p.work.request_id for p in fan.parts]
    return [dataclasses.replace(call, out=Outcome(call.out.endpoint, model=call.out.model,
                                                  prompt_tokens=len(p.work.prompt)), parts=[])
            for p in fan.parts]


def merged(out: Outcome, parts: list[Outcome]) -> None:
    """The parts' outcomes as the request's: tokens summed, the first heard part's
    version and worker, the slowest part's timing with every part's token gaps."""
    heard = [o for o in parts if o.version] or parts
    out.version, out.worker_id = heard[0].version, heard[0].worker_id
    out.prompt_tokens = sum(o.prompt_tokens for o in parts)
    out.completion_tokens = sum(o.completion_tokens for o in parts)
    firsts = [o.first_token_at for o in parts if o.first_token_at]
    out.first_token_at = min(firsts, default=0.0)
    out.hold_s = max(o.hold_s for o in parts)
    gaps = [o.timing.itl_counts for o in parts if o.timing.itl_counts]
    counts = [sum(c) for c in zip(*gaps)] if gaps else []
    slowest = max(parts, key=lambda o: o.timing.compute).timing
    out.timing = msgspec.structs.replace(slowest, itl_counts=counts)


def summed(usages: list[Usage | None]) -> Usage:
    """The parts' usages added up (a part without one yet counts nothing)."""
    prompt = sum(u.prompt_tokens for u in usages if u is not None)
    completion = sum(u.completion_tokens or 0 for u in usages if u is not None)
    return Usage(prompt_tokens=prompt, completion_tokens=completion,
                 total_tokens=prompt + completion)


async def _stopped(call: Call, tasks: Sequence[asyncio.Future[Any]], ids: list[str]) -> None:
    """The parts of `ids` stopped, each here (its task, when still running, cancelled)
    and at the workers and schedulers (a Cancel each)."""
    for t in tasks:
        t.cancel()  # a no-op when done
    await asyncio.gather(*tasks, return_exceptions=True)
    if ids:  # the line carries the request's id (services.gateway.call binds it)
        log.info("prompts_cancelled", wire_ids=ids)
    for rid in ids:
        await call.front.inbox.cancel(rid, "its request ended")  # failed, or its client left


async def whole(gen: Generation, fan: Fanned, call: Call) -> CompletionResponse:
    """The parts' whole answers, computed side by side and joined (4. above)."""
    calls = _part_calls(call, fan)
    tasks = [asyncio.ensure_future(gen.whole(p, c)) for p, c in zip(fan.parts, calls)]
    try:
        replies = await asyncio.gather(*tasks)
    except BaseException:
        running = [(t, rid) for t, rid in zip(tasks, call.parts) if not t.done()]
        await _stopped(call, [t for t, _ in running], [rid for _, rid in running])
        raise
    finally:
        merged(call.out, [c.out for c in calls])
    choices = []
    for i, reply in enumerate(replies):
        for choice in reply.choices:
            choice.index += i * fan.n
            choices.append(choice)
    first = replies[0]
    return CompletionResponse(id=f"cmpl-{fan.rid}", created=first.created, model=first.model,
                              choices=choices, usage=summed([r.usage for r in replies]))


async def _next(stream: AsyncIterator[list[object]]) -> list[object] | None:
    return await anext(stream, None)


async def chunks(gen: Generation, fan: Fanned,
                 call: Call) -> AsyncGenerator[list[object], None]:
    """The parts' chunk lists merged into one stream as they come (4. above). Each
    part has at most one list read ahead, so a reader that falls behind leaves the
    rest queued in the part, which joins it into fewer chunks (`Generation.chunks`)."""
    calls = _part_calls(call, fan)
    outs = [c.out for c in calls]
    streams = [gen.chunks(p, c) for p, c in zip(fan.parts, calls)]
    first = fan.parts[0]
    cid, created, model = f"cmpl-{fan.rid}", first.created, first.model
    finals: list[Usage | None] = [None] * len(streams)  # each part's usage chunk
    latest = [Usage(prompt_tokens=len(p.work.prompt), completion_tokens=0,
                    total_tokens=len(p.work.prompt)) for p in fan.parts]  # usage so far
    tasks = [asyncio.ensure_future(_next(s)) for s in streams]  # submitted in order
    ended = [False] * len(streams)
    try:
        while not all(ended):
            await asyncio.wait([t for t, e in zip(tasks, ended) if not e],
                               return_when=asyncio.FIRST_COMPLETED)
            ready: list[object] = []
            for i, task in enumerate(tasks):
                if ended[i] or not task.done():
                    continue
                got = task.result()  # a part's error is the request's
                if got is None:
                    ended[i] = True
                    continue
                tasks[i] = asyncio.ensure_future(_next(streams[i]))
                ready += _reindexed(got, i * fan.n, cid, finals, latest, i)
            merged(call.out, outs)
            if ready:
                yield ready
        if first.include_usage:
            yield [CompletionChunk(cid, created, model, [], usage=summed(finals))]
    finally:
        if not all(ended):  # failed, or its reader left: the parts not ended stop
            await _stopped(call, tasks, [rid for rid, e in zip(call.parts, ended) if not e])
        for stream in streams:
            await stream.aclose()
        merged(call.out, outs)


def _reindexed(ready: list, offset: int, cid: str, finals: list, latest: list,
               part: int) -> list[object]:
    """A part's chunks as the request's: its id, choice indexes moved past the earlier
    prompts' (`offset`), usage so far counted over every prompt; its usage chunk is
    kept back (`finals`) for the request's one."""
    out = []
    for chunk in ready:
        if not chunk.choices:  # the part's usage chunk (include_usage)
            finals[part] = chunk.usage
            continue
        chunk.id = cid
        for choice in chunk.choices:
            choice.index += offset
        if chunk.usage is not None:  # continuous_usage_stats
            latest[part] = chunk.usage
            chunk.usage = summed(latest)
        out.append(chunk)
    return out

