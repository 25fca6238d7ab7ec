"""OpenAI's Responses API (`POST /v1/responses`) over the chat completions pipeline.

  1. prepare: the request (shared.api_responses.ResponsesRequest) becomes a chat
     completions request: `instructions` a system message first, then the stored
     conversation of `previous_response_id` (services.gateway.response_store), then
     `input` (a string: one user message; or items: messages, the model's
     `function_call`s as an assistant message's `tool_calls`, each
     `function_call_output` a `tool` message); flat function `tools` and
     `tool_choice` in chat's nested form; `text.format` as `response_format`;
     `max_output_tokens` as `max_completion_tokens`. The chat pipeline
     (services.gateway.generation) then checks, tokenizes and admits it as its own.
  2. whole: the chat reply becomes a `response`: a `message` item with one
     `output_text` part (when the model wrote text), a `function_call` item per tool
     call, a `reasoning` item first when a reasoning model's thinking was split off;
     `incomplete` (reason `max_output_tokens`) when cut by length.
  3. chunks: the chat chunks become the documented events
     (services.gateway.response_events): created,
     in_progress, then per output item added / its deltas / done, then completed
     (or incomplete) with the whole response; a failure after the first event is a
     `response.failed` event. Over HTTP each is an SSE event named by its `type`.
  4. With `store` (the default) the response and its conversation are kept for
     `GET` / `DELETE /v1/responses/{id}` and follow-ups, with the items it was made
     from for `GET /v1/responses/{id}/input_items` (services.gateway.response_items).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, AsyncIterator, Mapping, cast

from services.gateway import codec, response_items
from services.gateway.generation import Generation
from services.gateway.response_events import Events, finished, new_id, response_usage
from services.gateway.response_store import ResponseStore, not_found
from shared.api import (
    ChatCompletionRequest,
    ChatMessage,
    ChatRole,
    ContentPart,
    FunctionCall,
    FunctionDef,
    FunctionRef,
    JsonSchemaFormat,
    NamedToolChoice,
    ResponseFormat,
    StreamOptions,
    Tool,
    ToolCall,
)
from shared.api_responses import (
    Deleted,
    EchoedChoice,
    EchoedTool,
    FunctionCallItem,
    InputItem,
    InputItemList,
    ListedItem,
    MessageItem,
    OutputText,
    ReasoningItem,
    ReasoningText,
    Response,
    ResponsesRequest,
    Stored,
    TextConfig,
    ignored_fields,
)
from shared.errors import ServiceError, bad_request

if TYPE_CHECKING:
    from services.gateway import fanout, generation
    from services.gateway.call import Call
    from shared.api_responses import ToolChoiceFunction

ROLES = ("user", "system", "developer", "assistant")
TEXT_PARTS = ("input_text", "output_text", "text")


@dataclass
class Prepared:
    req: ResponsesRequest
    inner: generation.Prepared | fanout.Fanned  # the chat request's (never fanned out)
    conversation: list[ChatMessage]  # earlier + this input (instructions left out)
    response: Response  # the response so far: its echoed fields, no output
    items: list[ListedItem]  # earlier + this input, as input_items lists them

    @property
    def stream(self) -> bool:
        return self.req.stream


class Responses:
    """The `/v1/responses` pipeline (services.gateway.pipeline.Pipeline)."""

    name = "responses"
    sse_done = False  # an SSE stream ends with its `response.completed` event

    def __init__(self, front) -> None:
        self.front = front
        self.chat = Generation(front, chat=True)
        self.store = ResponseStore(front.nc)

    async def prepare(self, body: bytes, call: Call) -> Prepared:
        self.front.check_size(body)
        req = codec.decode(body, ResponsesRequest, call.msgpack)
        _refused(req)
        earlier: list[ChatMessage] = []
        items: list[ListedItem] = []
        if req.previous_response_id is not None:
            stored = await self.store.get(req.previous_response_id)
            if stored is None:
                raise bad_request(f"'previous_response_id': no stored response has id "
                                  f"'{req.previous_response_id}'",
                                  code="previous_response_not_found")
            earlier = stored.messages
            items = stored.items + response_items.of_output(stored.response.output)
        conversation = earlier + input_messages(req.input, earlier)
        system = [ChatMessage(role="system", content=req.instructions)] if req.instructions else []
        chat = chat_request(req, system + conversation)
        inner = await self.chat.prepare(codec.encode(chat, call.msgpack), call)
        call.ignored = ignored_fields(req)
        return Prepared(req, inner, conversation, skeleton(req, int(time.time())),
                        items + response_items.listed(req.input))

    async def whole(self, prep: Prepared, call: Call) -> Response:
        reply = await self.chat.whole(prep.inner, call)
        choice = reply.choices[0]
        message = choice.message
        output: list = []
        thought = message.reasoning_content
        if isinstance(thought, str) and thought:
            output.append(ReasoningItem(id=new_id("rs"), content=[ReasoningText(text=thought)]))
        cut = choice.finish_reason == "length"
        status = "incomplete" if cut else "completed"
        if message.content or not message.tool_calls:
            output.append(MessageItem(id=new_id("msg"), status=status,
                                      content=[OutputText(text=message.content or "")]))
        for c in message.tool_calls or ():
            output.append(FunctionCallItem(id=new_id("fc"), call_id=c.id, name=c.function.name,
                                           arguments=c.function.arguments, status=status))
        u = reply.usage
        used = response_usage(u.prompt_tokens, u.completion_tokens) if u else None
        resp = finished(prep.response, output, cut, used)
        await self._keep(prep, resp)
        return resp

    async def chunks(self, prep: Prepared, call: Call) -> AsyncIterator[list[object]]:
        events = Events(prep.response)
        started = False
        try:
            async for ready in self.chat.chunks(prep.inner, call):
                out = [] if started else events.start()
                started = True
                for chunk in ready:
                    out += events.feed(chunk)
                if out:
                    yield out
            final = events.finish()
            await self._keep(prep, final[-1].response)
            yield final
        except ServiceError as err:
            if not started:
                raise  # before the first event: the transport's error status
            call.fail(err)
            yield [events.failed(err)]

    async def _keep(self, prep: Prepared, resp: Response) -> None:
        if resp.store and not await self.store.put(
                Stored(response=resp, messages=prep.conversation + [reply_message(resp)],
                       items=prep.items)):
            resp.store = False  # said in the response itself: a follow-up cannot use it

    # ------------------------------------------------ GET / DELETE /v1/responses/{id}
    async def retrieve(self, rid: str) -> Response:
        stored = await self.store.get(rid)
        if stored is None:
            raise not_found(rid)
        return stored.response

    async def input_items(self, rid: str, query: Mapping[str, str]) -> InputItemList:
        """GET /v1/responses/{id}/input_items: a page of the items it was made from."""
        stored = await self.store.get(rid)
        if stored is None:
            raise not_found(rid)
        return response_items.page(stored.items, query)

    async def delete(self, rid: str) -> Deleted:
        if not await self.store.delete(rid):
            raise not_found(rid)
        return Deleted(id=rid)


# -------------------------------------------------------------------- requests
def _refused(req: ResponsesRequest) -> None:
    for name, asked in (("background", req.background), ("conversation", req.conversation),
                        ("prompt", req.prompt)):
        if asked:
            raise bad_request(f"'{name}' is not supported by this server; leave it out")


def input_messages(given: str | list[InputItem], earlier: list[ChatMessage]) -> list[ChatMessage]:
    """`input` as chat messages; a wrong item is a 400 naming it (`input[i].field`)."""
    if isinstance(given, str):
        return [ChatMessage(role="user", content=given)]
    if not given:
        raise bad_request("'input' is empty: send a string or at least one item")
    calls = {c.id for m in earlier for c in m.tool_calls or ()}
    out: list[ChatMessage] = []
    for i, item in enumerate(given):
        at = f"input[{i}]"
        if item.type == "message":
            if item.role not in ROLES:
                raise bad_request(f"'{at}.role' must be one of {', '.join(ROLES)}"
                                  if item.role else f"'{at}.role' is required")
            if item.content is None:
                raise bad_request(f"'{at}.content' is required")
            role = cast(ChatRole, item.role)  # one of ROLES
            out.append(ChatMessage(role=role, content=_text(item.content, f"{at}.content")))
        elif item.type == "function_call":
            for field in ("call_id", "name", "arguments"):
                if not getattr(item, field):
                    raise bad_request(f"'{at}.{field}' is required for a function_call item")
            assert item.call_id is not None and item.name is not None and item.arguments is not None
            call = ToolCall(id=item.call_id, function=FunctionCall(name=item.name,
                                                                   arguments=item.arguments))
            calls.add(item.call_id)
            last = out[-1] if out else None
            if last is not None and last.role == "assistant":  # one turn: text and calls
                last.tool_calls = [*(last.tool_calls or ()), call]
            else:
                out.append(ChatMessage(role="assistant", tool_calls=[call]))
        elif item.type == "function_call_output":
            if not item.call_id:
                raise bad_request(f"'{at}.call_id' is required for a function_call_output item")
            if item.call_id not in calls:
                raise bad_request(f"'{at}.call_id': no function_call with call_id "
                                  f"'{item.call_id}' comes before it in the conversation")
            if item.output is None:
                raise bad_request(f"'{at}.output' is required for a function_call_output item")
            out.append(ChatMessage(role="tool", tool_call_id=item.call_id,
                                   content=_text(item.output, f"{at}.output")))
        elif item.type != "reasoning":  # a replayed reasoning item: not sent to the model
            raise bad_request(f"'{at}.type' '{item.type}' is not supported; items are "
                              f"message, function_call, function_call_output or reasoning")
    return out


def _text(content, at: str) -> str | list[ContentPart]:
    if isinstance(content, str):
        return content
    parts = []
    for j, part in enumerate(content):
        if part.type not in TEXT_PARTS and part.type != "refusal":
            raise bad_request(f"'{at}[{j}].type' '{part.type}' is not supported; only text "
                              f"parts (input_text, output_text) are")
        if part.text is None:
            raise bad_request(f"'{at}[{j}].text' is required")
        parts.append(ContentPart(type="text", text=part.text))
    return parts


def chat_request(req: ResponsesRequest, messages: list[ChatMessage]) -> ChatCompletionRequest:
    """The chat completions request that answers `req` (every field a check of the
    chat pipeline's own reads again when it decodes it)."""
    tools = None
    if req.tools is not None:
        tools = []
        for i, t in enumerate(req.tools):
            if t.type != "function":
                raise bad_request(f"'tools[{i}].type' '{t.type}' is not supported; only "
                                  f"'function' tools are")
            if not t.name:
                raise bad_request(f"'tools[{i}].name' is required")
            tools.append(Tool(type="function", function=FunctionDef(
                name=t.name, description=t.description, parameters=t.parameters,
                strict=t.strict)))
    choice: str | ToolChoiceFunction | NamedToolChoice | None
    choice = req.tool_choice  # (assigned apart: the declaration would not narrow it)
    if choice is not None and not isinstance(choice, str):
        if choice.type != "function":
            raise bad_request(f"'tool_choice.type' '{choice.type}' is not supported; a "
                              f"function by name, or none, auto or required")
        if not choice.name:
            raise bad_request("'tool_choice.name' is required")
        choice = NamedToolChoice(type="function", function=FunctionRef(name=choice.name))
    return ChatCompletionRequest(
        model=req.model, messages=messages, max_completion_tokens=req.max_output_tokens,
        temperature=req.temperature, top_p=req.top_p, tools=tools, tool_choice=choice,
        parallel_tool_calls=req.parallel_tool_calls, response_format=_format(req.text),
        stream=req.stream, user=req.user,
        stream_options=StreamOptions(include_usage=True) if req.stream else None)


def _format(text: TextConfig | None) -> ResponseFormat | None:
    fmt = text.format if text is not None else None
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_object":
        return ResponseFormat(type="json_object")
    if not fmt.name:
        raise bad_request("'text.format.name' is required for a json_schema format")
    if fmt.schema is None:
        raise bad_request("'text.format.schema' is required for a json_schema format")
    return ResponseFormat(type="json_schema", json_schema=JsonSchemaFormat(
        name=fmt.name, description=fmt.description, schema=fmt.schema, strict=fmt.strict))


# ------------------------------------------------------------------- responses
def skeleton(req: ResponsesRequest, created: int) -> Response:
    """The response with what it echoes of the request, before any output."""
    choice: str | ToolChoiceFunction | EchoedChoice | None = req.tool_choice
    if choice is None:
        choice = "auto" if req.tools else "none"
    elif not isinstance(choice, str):
        choice = EchoedChoice(name=choice.name or "")
    tools = [EchoedTool(name=t.name or "", parameters=t.parameters, strict=t.strict,
                        description=t.description) for t in req.tools or ()]
    return Response(
        id=new_id("resp"), created_at=created, model=req.model, output=[],
        status="in_progress", instructions=req.instructions,
        max_output_tokens=req.max_output_tokens, metadata=dict(req.metadata or {}),
        parallel_tool_calls=req.parallel_tool_calls is not False,
        previous_response_id=req.previous_response_id, store=req.store is not False,
        temperature=req.temperature, top_p=req.top_p, text=req.text or TextConfig(),
        tool_choice=choice, tools=tools, user=req.user)


def reply_message(resp: Response) -> ChatMessage:
    """The response's output as the assistant's turn of the conversation."""
    text = "".join(p.text for item in resp.output if isinstance(item, MessageItem)
                   for p in item.content)
    calls = [ToolCall(id=item.call_id, function=FunctionCall(name=item.name,
                                                             arguments=item.arguments))
             for item in resp.output if isinstance(item, FunctionCallItem)]
    return ChatMessage(role="assistant", content=text or None, tool_calls=calls or None)
