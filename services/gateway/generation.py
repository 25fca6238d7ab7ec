"""Completions and chat completions: prompts in, tokens streamed back.

  1. Decode the request, resolve a decoder model, render chat messages with the
     model's chat template, tokenize, check the context limit, `n` and `stop`.
  2. Submit one GenerateWork (a completions `prompt` that is a list of prompts: one
     per prompt, all checked and admitted together, answered as one:
     services.gateway.fanout); the worker streams GenChunks (per choice) and ends
     with a GenDone carrying usage. They reach this request's queue through the
     gateway's inbox (services.gateway.inbox), one `Results` message per decode step
     for all of this gateway's requests on that worker.
  3. Non-streaming (`whole`): assemble the choices. Streaming (`chunks`): the worker
     messages already queued for the request are read together; the chunks of one
     choice among them become one OpenAI chunk (text joined, tokens summed), so a
     reader that fell behind (a slow HTTP client) sends fewer, larger chunks. A
     reasoning model's chat text is split into `reasoning_content` and `content`
     first (services.gateway.reasoning), then read for tool calls. The
     transport sends them on — on NATS one message per chunk to the reply subject,
     then `[DONE]`; on HTTP one SSE event each, those ready together in one write,
     then `data: [DONE]`. The worker's first message names the version
     generating the request: every NATS reply and chunk carries it in
     `Tensorbus-Model-Version`, and an HTTP response starts, with that header, only
     when it has arrived.
  4. A client that goes away (HTTP) or a deadline that passes sends a Cancel, which
     frees the worker's slot within one step. The deadline bounds the wait for the
     first token; every chunk that arrives restarts the stall timeout, and the
     request's `end_by` bounds the rest (the inbox's clock; docs/protocol.md).
"""

from __future__ import annotations

import functools
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, AsyncGenerator, AsyncIterator, cast

import msgspec

from services.gateway import codec, fanout, params, reasoning, tool_formats, tools
from services.gateway.frontend import INLINE_TOKENIZE, user_key
from services.gateway import continuity
from services.gateway.chat_prompt import chat_prompt_of, chat_template
from services.gateway.echo import Echo, joined, prompt_top
from services.gateway.logprobs import Logprobs
from services.gateway.models import ModelEntry, split_name
from services.gateway import structured_limits
from shared.api import ChatCompletionRequest, CompletionRequest, Usage, ignored_fields
from shared.api_replies import (
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionResponse,
    ChatDelta,
    CompletionChoice,
    CompletionChunk,
    CompletionResponse,
    ResponseMessage,
)
from shared.errors import bad_request
from shared.logging import get_logger
from shared.messages import GenChunk, GenDone, GenerateWork, TokenLogprob

if TYPE_CHECKING:
    from services.gateway.call import Call
    from services.gateway.tools import ToolPlan

log = get_logger("gateway")


@dataclass
class Prepared:
    req: CompletionRequest | ChatCompletionRequest
    chat: bool
    work: GenerateWork
    model: str  # as the client named it
    created: int
    include_usage: bool
    continuous_usage: bool = False  # usage so far on every chunk (vLLM's stream option)
    tokenizer: object = None  # engine.tokenizer.Tokenizer: logprobs' token texts
    tools: ToolPlan | None = None  # chat with tools
    thinking: reasoning.Plan | None = None  # chat with a reasoning model: its split

    @property
    def logprobs(self) -> bool:
        return self.work.sampling.logprobs >= 0

    @property
    def stream(self) -> bool:
        return self.work.stream


class Generation:
    """The completions pipeline, or with `chat` the chat completions one
    (services.gateway.pipeline.Pipeline)."""

    def __init__(self, front, chat: bool) -> None:
        self.front = front
        self.config = front.config
        self.chat = chat
        self.name = "chat.completions" if chat else "completions"
        self._request_type = ChatCompletionRequest if chat else CompletionRequest

    # ---------------------------------------------------------------- prepare
    async def prepare(self, body: bytes, call: Call) -> Prepared | fanout.Fanned:
        self.front.check_size(body)
        chat, out, rid, deadline = self.chat, call.out, call.wire, call.deadline
        req = codec.decode(body, self._request_type, call.msgpack)
        # schemas' size and depth before anything else; their grammars off the loop
        shaped = structured_limits.check(req, self.front.grammars.limits)
        if isinstance(req.best_of, int) and req.best_of > req.n:
            raise bad_request(f"'best_of' is {req.best_of}: sampling more candidates than 'n' "
                              f"({req.n}) to return the best is not supported; leave it out")
        call.ignored = ignored_fields(req)
        if call.ignored:  # accepted as OpenAI documents them, named back (docs/protocol.md)
            log.info("request_fields_ignored", request_id=call.rid, fields=call.ignored)
        name, version = split_name(req.model)
        out.model = name
        user = user_key(req.user, call.user)
        entry, version = await self.front.models.choose(name, version, user)
        if entry.info.kind != "decoder":
            raise bad_request(f"model '{name}' is a cross-encoder (reranker); use the rerank or "
                              f"score endpoints" if entry.task == "score" else
                              f"model '{name}' is an embedding model; use the embeddings endpoint")
        # one request per prompt: a completions list is several (services.gateway.fanout)
        reqs = [req] if chat else fanout.per_prompt(req)
        self.front.admission.check_served(name)
        self.front.admission.shed(name, requests=len(reqs))
        if chat and req.top_logprobs is not None and not req.logprobs:
            raise bad_request("'top_logprobs' needs 'logprobs': true")
        if req.stream_options is not None and not req.stream:
            raise bad_request("'stream_options' is only allowed when 'stream' is true")
        if req.n > self.config.max_n:
            raise bad_request(f"'n' is {req.n}; at most {self.config.max_n} choices per request")
        if chat and req.chat_template is not None and not self.config.trust_request_chat_template:
            raise bad_request("'chat_template' is refused: this server runs only its models' "
                              "own templates (TENSORBUS_TRUST_REQUEST_CHAT_TEMPLATE=1 allows "
                              "a request's)")  # fmt: skip
        # the template in use teaches the calls' form
        fmt = (tool_formats.detect(chat_template(entry.info.path).source if req.chat_template
                                   is None else req.chat_template)
               if chat and req.tools else "json")
        structure = functools.partial(tools.structure, req, fmt, chat)
        tp, grammar = await self.front.grammars.compile(req, structure) if shaped else structure()
        render = functools.partial(chat_prompt_of, tp=tp) if chat else self._prompt
        limit = min(entry.info.max_tokens, self.config.max_context)
        tokenized = functools.partial(self._tokenized, reqs, render, entry, name, limit)
        reserved = ""
        if len(body) <= INLINE_TOKENIZE:
            prompts = tokenized()
        else:  # in a thread: counted as waiting meanwhile (the count bound)
            with self.front.admission.preparing(name, 1, 0):
                # admitted by a scheduler before the wait, so never refused after it
                # (a batch request reserves nothing: its lane admits it on arrival)
                reserved = "" if call.batch else await self.front.admission.reserve(
                    rid, name, version, req.n * len(reqs), 0, deadline, generate=True)
                try:
                    prompts = await self.front.tokenize(tokenized)
                except BaseException:
                    if reserved:
                        self.front.admission.unreserve(rid)
                    raise
                if reserved and len(reqs) > 1:  # a list's parts go out under ids of their own
                    self.front.admission.unreserve(rid)
                    reserved = ""
        max_tokens = []
        for i, (r, prompt) in enumerate(zip(reqs, prompts)):
            with fanout.naming(i, len(reqs)):
                max_tokens.append(params.max_tokens(r, chat, len(prompt), limit))
        stop = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
        sampling = params.sampling(req, params.generation_defaults(entry.info.path),
                                   params.top_logprobs(req, chat),
                                   grammar)
        think = self._reasoning(name, entry, prompts[0], bool(sampling.grammar)) if chat else None
        if sampling.grammar and req.ignore_eos:
            raise bad_request("'ignore_eos' cannot be used with 'response_format': a "
                              "structured output ends at its grammar's end")
        params.check_tokens(sampling, entry.tokenizer.vocab_size)
        ids = [rid]
        if len(reqs) > 1 and not call.batch:  # every prompt checked; admitted as its sum
            self.front.admission.shed_list(name, deadline, req.n, [len(p) for p in prompts],
                                           max_tokens)
            ids, user = fanout.part_ids(rid, len(reqs)), user or rid  # one canary draw
        out.prompt_tokens = sum(map(len, prompts))
        opts, created = req.stream_options, int(time.time())
        preps = [Prepared(r, chat, GenerateWork(
            pid, name, version, prompt, budget, sampling, stop, req.n, req.stream, deadline, "",
            ignore_eos=req.ignore_eos, user=user, reserved=reserved,
            # Batch work pauses for interactive work (services.worker.decode.scheduler
            # rule 6): a pause is no stall, and its whole time bounds it.
            stall_s=0.0 if call.priority else self.config.stall_timeout_s, end_by=call.end_by,
            prompt_logprobs=_prompt_logprobs(req, chat),
            skip_special_tokens=req.skip_special_tokens,
            include_stop_str_in_output=req.include_stop_str_in_output,
            priority=call.priority),
            req.model, created, bool(opts and opts.include_usage),
            bool(opts and opts.continuous_usage_stats), entry.tokenizer, tp, think)
            for pid, r, prompt, budget in zip(ids, reqs, prompts, max_tokens)]
        if len(preps) == 1:
            return preps[0]
        log.debug("completions_fanned_out", request_id=call.rid, prompts=len(preps))
        return fanout.Fanned(preps, rid)

    def _reasoning(self, name: str, entry: ModelEntry, prompt: list[int],
                   shaped: bool) -> reasoning.Plan | None:
        """How a chat reply of `name` splits (services.gateway.reasoning), or None: not
        at all. Whether the prompt leaves a think open is read from its last tokens'
        text; a reply a grammar shapes (`shaped`) starts outside any think."""
        if not reasoning.on(self.config.reasoning_parser, name,
                            chat_template(entry.info.path).source):
            return None  # (the setting's values are checked at start: services.gateway)
        tail = "" if shaped else entry.tokenizer.decode(prompt[-reasoning.PROMPT_TAIL:],
                                                        skip_special_tokens=False)
        return reasoning.Plan(reasoning.opens(tail))

    def _tokenized(self, reqs: list, render, entry: ModelEntry, name: str,
                   limit: int) -> list[list[int]]:
        """Each request's prompt tokenized, truncated as it asks and checked against the
        context: every prompt of a list before any runs, a bad one named (`prompt[i]`)."""
        prompts = []
        for i, r in enumerate(reqs):
            with fanout.naming(i, len(reqs)):
                prompts.append(self._fits(_truncated(render(r, entry), r.truncate_prompt_tokens,
                                                     limit), name, limit))
        return prompts

    @staticmethod
    def _fits(prompt: list[int], name: str, limit: int) -> list[int]:
        """The prompt, or a 400 when it leaves no room to generate."""
        if len(prompt) > limit - 1:
            raise bad_request(
                f"the prompt has {len(prompt)} tokens; model '{name}' has a context of {limit} "
                f"tokens, at least one of which must be left to generate",
                code="context_length_exceeded")
        return prompt

    def _prompt(self, req: CompletionRequest, entry: ModelEntry) -> list[int]:
        """One prompt's tokens (`req.prompt` a string or token ids: fanout.per_prompt)."""
        p = req.prompt
        if isinstance(p, list):
            return self._check_ids(cast("list[int]", p), entry)  # one prompt: its ids
        return entry.tokenizer.encode(p)

    def _check_ids(self, ids: list[int], entry: ModelEntry) -> list[int]:
        vocab = entry.tokenizer.vocab_size
        bad = next((t for t in ids if t >= vocab), None)
        if bad is not None:
            raise bad_request(f"token id {bad} is outside the vocabulary of {vocab} tokens")
        if not ids:
            raise bad_request("'prompt' is empty")
        return list(ids)

    # ---------------------------------------------------------------- events
    async def events(self, prep: Prepared, call: Call) -> AsyncIterator[list[GenChunk | GenDone]]:
        """The worker's messages for this request, as lists of those already queued
        together (one decode step's, or several when this reader fell behind), each
        once and in order, a broken path resumed or ended clearly
        (services.gateway.continuity); `out.version` is set from the first."""
        async for batch in continuity.events(self.front, prep.work, call.out):
            yield batch

    async def whole(self, prep: Prepared | fanout.Fanned, call: Call):
        if isinstance(prep, fanout.Fanned):  # several prompts: one answer of them all
            return await fanout.whole(self, prep, call)
        out = call.out
        texts: list[list[str]] = [[] for _ in range(prep.work.n)]
        lps: list[list[TokenLogprob]] = [[] for _ in range(prep.work.n)]
        heads: list[list[TokenLogprob]] = [[] for _ in range(prep.work.n)]
        finish: list[str | None] = [None] * prep.work.n
        done = None
        async for batch in self.events(prep, call):
            for ev in batch:
                if isinstance(ev, GenChunk):
                    texts[ev.index].append(ev.text)
                    lps[ev.index] += ev.logprobs
                    heads[ev.index] += ev.prompt_logprobs  # on its first chunk, if asked
                    finish[ev.index] = ev.finish_reason or finish[ev.index]
                else:
                    done = ev
        self._account(out, done)
        usage = _usage(done)
        render = Logprobs(prep.tokenizer, prep.work.n, prep.logprobs)
        if prep.chat:
            choices = [ChatChoice(i, *_message(prep, "".join(t), _reason(finish[i])),
                                  render.chat(lps[i]))
                       for i, t in enumerate(texts)]
            scored = (render.prompt_maps(max(heads, key=len)) if prep.work.prompt_logprobs >= 0
                      else msgspec.UNSET)  # every choice's first chunk has the prompt's
            return ChatCompletionResponse(id=f"chatcmpl-{prep.work.request_id}", created=prep.created,
                                          model=prep.model, choices=choices, usage=usage,
                                          prompt_logprobs=scored)
        req = cast(CompletionRequest, prep.req)  # not chat
        echo = Echo(req, prep.work.prompt, prep.tokenizer)  # and prompt_logprobs
        completions = [CompletionChoice(
            i, echo.text + "".join(t), _reason(finish[i]),
            joined(echo.logprobs(render, i, heads[i]), render.completion(i, lps[i])),
            echo.maps(render, heads[i])) for i, t in enumerate(texts)]
        return CompletionResponse(id=f"cmpl-{prep.work.request_id}", created=prep.created,
                                  model=prep.model, choices=completions, usage=usage)

    def chunks(self, prep: Prepared | fanout.Fanned,
               call: Call) -> AsyncGenerator[list[object], None]:
        """A streaming request's chunks (`_chunks`); several prompts' merged into one
        stream (services.gateway.fanout)."""
        if isinstance(prep, fanout.Fanned):
            return fanout.chunks(self, prep, call)
        return self._chunks(prep, call)

    async def _chunks(self, prep: Prepared, call: Call) -> AsyncGenerator[list[object], None]:
        """OpenAI chunk objects, in order, for a streaming request, as lists of those
        ready together: a transport may send a list in one write. Chunks of one choice
        already queued together become one (`coalesced`), so a reader that fell
        behind catches up in one chunk rather than many. Nothing is yielded before the
        worker's first message, so `out.version` is known at the first."""
        rid, model, created, out = prep.work.request_id, prep.model, prep.created, call.out
        cid = f"chatcmpl-{rid}" if prep.chat else f"cmpl-{rid}"
        started = False
        prompt, generated = len(prep.work.prompt), 0
        render = Logprobs(prep.tokenizer, prep.work.n, prep.logprobs)
        calls = tools.ToolStream(prep.tools, prep.work.n) if prep.tools else None
        splits = prep.thinking.streams(prep.work.n) if prep.thinking else None
        echo = Echo(None if prep.chat else cast(CompletionRequest, prep.req), prep.work.prompt,
                    prep.tokenizer)
        scored = prep.chat and prep.work.prompt_logprobs >= 0  # chat's prompt_logprobs: unsent
        head = None  # ... as the worker sent them (each choice's first chunk has them)
        async for batch in self.events(prep, call):
            ready: list[object] = []
            if prep.chat and not started:
                ready += [ChatCompletionChunk(cid, created, model, [
                    ChatChunkChoice(i, ChatDelta(role="assistant", content=""))])
                    for i in range(prep.work.n)]
            started = True
            if scored:  # on the stream's first chunk (vLLM refuses them streamed)
                head = head if head is not None else next(
                    (ev.prompt_logprobs for ev in batch if isinstance(ev, GenChunk)
                     and (ev.prompt_logprobs or len(prep.work.prompt) < 2)), None)
                if head is not None and ready:  # ready[0]: the stream's first chunk (chat)
                    first = cast(ChatCompletionChunk, ready[0])
                    first.prompt_logprobs, scored = render.prompt_maps(head), False
            for ev in coalesced(batch):
                if isinstance(ev, GenDone):
                    self._account(out, ev)
                    if prep.include_usage:
                        cls = ChatCompletionChunk if prep.chat else CompletionChunk
                        ready.append(cls(cid, created, model, [], usage=_usage(ev)))
                    continue
                reason = _reason(ev.finish_reason) if ev.finish_reason else None
                generated += ev.tokens
                usage = Usage(prompt_tokens=prompt, completion_tokens=generated,
                              total_tokens=prompt + generated) if prep.continuous_usage else None
                if prep.chat:
                    thought, text = "", ev.text
                    if splits is not None:  # reasoning, then content (services.gateway.reasoning)
                        thought, text = splits[ev.index].feed(text, ev.finish_reason is not None)
                    delta = ChatDelta(content=text) if text else None
                    if calls is not None:  # content and tool-call deltas
                        delta, reason = calls.feed(ev.index, text, reason)
                    if thought:
                        delta = msgspec.structs.replace(delta or ChatDelta(),
                                                        reasoning_content=thought)
                    split = calls is not None or splits is not None
                    if delta is None and split and reason is None and not ev.logprobs:
                        continue  # nothing to say yet (text held: a tag's start, perhaps)
                    delta = delta or ChatDelta()
                    choice = ChatChunkChoice(ev.index, delta, reason, render.chat(ev.logprobs))
                    ready.append(ChatCompletionChunk(cid, created, model, [choice], usage=usage))
                else:
                    leads = echo.first(ev)  # echo, prompt_logprobs: in front of its first
                    lp = joined(echo.logprobs(render, ev.index, ev.prompt_logprobs) if leads
                                else None, render.completion(ev.index, ev.logprobs))
                    completion = CompletionChoice(
                        ev.index, echo.text + ev.text if leads else ev.text, reason, lp,
                        echo.maps(render, ev.prompt_logprobs) if leads else msgspec.UNSET)
                    ready.append(CompletionChunk(cid, created, model, [completion], usage=usage))
            if ready:
                yield ready

    def _account(self, out, done: GenDone | None) -> None:
        if done is None:
            return
        out.version, out.worker_id, out.timing = done.version, done.worker_id, done.timing
        out.completion_tokens = done.completion_tokens


def _message(prep: Prepared, text: str,
             finish: str | None) -> tuple[ResponseMessage, str | None]:
    """(ResponseMessage, finish_reason) of a whole chat choice: its reasoning apart
    (when the model's replies are split and it reasoned), the rest read for tool calls."""
    thought = None
    if prep.thinking is not None:
        thought, text = prep.thinking.split(text)
    message, finish = tools.message(prep.tools, text, finish)
    if thought:
        message.reasoning_content = thought
    return message, finish


def coalesced(batch: list[GenChunk | GenDone]) -> list[GenChunk | GenDone]:
    """One GenChunk per choice for the chunks of `batch` (text joined in order,
    `tokens` summed, the finish reason of the last), each where its choice first
    appears; a GenDone stays last."""
    out: list[GenChunk | GenDone] = []
    at: dict[int, int] = {}  # choice -> its chunk's position in out
    for ev in batch:
        i = at.get(ev.index) if isinstance(ev, GenChunk) else None
        if i is None:
            if isinstance(ev, GenChunk):
                at[ev.index] = len(out)
            out.append(ev)
            continue
        # i is not None: ev is a chunk, and out holds its choice's chunk at i
        ev, have = cast(GenChunk, ev), cast(GenChunk, out[i])
        out[i] = GenChunk(ev.request_id, ev.index, have.text + ev.text, have.tokens + ev.tokens,
                          ev.finish_reason or have.finish_reason, ev.attempt, ev.version,
                          have.logprobs + ev.logprobs, have.prompt_logprobs + ev.prompt_logprobs)
    return out


def _prompt_logprobs(req, chat: bool) -> int:
    """Top alternatives per prompt token chat's `prompt_logprobs`, or a completions
    `echo` with `logprobs` or `prompt_logprobs` (services/gateway/echo.py), wants;
    -1: none."""
    if chat:
        return req.prompt_logprobs if req.prompt_logprobs is not None else -1
    return prompt_top(req)


def _reason(reason: str | None) -> str | None:
    return "stop" if reason in ("stop", "cancelled", "error") else reason


def _usage(done: GenDone | None) -> Usage | None:
    if done is None:
        return None
    return Usage(prompt_tokens=done.prompt_tokens, completion_tokens=done.completion_tokens,
                 total_tokens=done.prompt_tokens + done.completion_tokens)


def _truncated(prompt: list[int], keep: int | None, limit: int) -> list[int]:
    """`truncate_prompt_tokens`: the prompt's last `keep` tokens (-1: as many as leave
    one token of the context to generate); None: the prompt whole."""
    if keep is None:
        return prompt
    if keep == 0:
        raise bad_request("'truncate_prompt_tokens' is 0: a prompt needs a token")
    return prompt[-(limit - 1 if keep < 0 else keep):]
