"""OpenAI's Responses API (`POST /v1/responses`): the request, the `response` object,
its output items and the streamed events, as msgspec Structs. The gateway serves it
through the chat completions pipeline (services/gateway/responses.py).

The request refuses unknown fields, as every request type here does (shared/api.py);
the fields OpenAI documents that nothing acts on are accepted and named back
(`IGNORED`, `ignored_fields`). Input items and their content parts are read
leniently: a client replays the output items it received, with fields such as
`annotations`, `logprobs` or `status` that a conversation does not need.
"""

from __future__ import annotations

from typing import Annotated, Any, ClassVar, Literal

import msgspec
from msgspec import UNSET, Meta, UnsetType

from shared.api import MAX_LIST, MAX_STRING, MAX_TOOLS, ChatMessage, Temperature, Text, TopP

Name = Annotated[str, Meta(min_length=1, max_length=256)]
Id = Annotated[str, Meta(max_length=256)]


class _Request(msgspec.Struct, forbid_unknown_fields=True, omit_defaults=True, kw_only=True):
    pass


class InputPart(msgspec.Struct, kw_only=True):
    """A part of an input message's content: `input_text` (or, replayed, an
    assistant's `output_text`); any other type is a 400 that names it."""

    type: Annotated[str, Meta(min_length=1, max_length=64)]
    text: Text | None = None


class InputItem(msgspec.Struct, kw_only=True):
    """One item of `input`: a message (`type` "message", or left out), a
    `function_call` the model made, its `function_call_output`, or a replayed
    `reasoning` item (skipped). One struct for all, so that a wrong item is a 400
    naming its place and field (services/gateway/responses.py)."""

    type: Annotated[str, Meta(max_length=64)] = "message"
    role: Annotated[str, Meta(max_length=64)] | None = None
    content: Text | Annotated[list[InputPart], Meta(max_length=MAX_LIST)] | None = None
    id: Id | None = None
    call_id: Id | None = None
    name: Annotated[str, Meta(max_length=64)] | None = None
    arguments: Text | None = None
    output: Text | Annotated[list[InputPart], Meta(max_length=MAX_LIST)] | None = None


class FunctionTool(msgspec.Struct, kw_only=True):
    """A tool: only `function` tools (flat, unlike chat's) are served; any other type
    (web_search, file_search, ...) is a 400 naming it, so its fields are not read."""

    type: Annotated[str, Meta(min_length=1, max_length=64)]
    name: Annotated[str, Meta(max_length=64)] | None = None
    description: Annotated[str, Meta(max_length=MAX_STRING)] | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ToolChoiceFunction(msgspec.Struct, kw_only=True):
    type: Annotated[str, Meta(min_length=1, max_length=64)]
    name: Annotated[str, Meta(max_length=64)] | None = None


class TextFormat(msgspec.Struct, kw_only=True, omit_defaults=True):
    """`text.format`: `text` (the default), `json_object`, or `json_schema` with its
    `name`, `schema`, `strict` and `description` beside `type` (flat, unlike chat's
    `response_format`)."""

    type: Literal["text", "json_object", "json_schema"] = "text"
    name: Annotated[str, Meta(min_length=1, max_length=64)] | None = None
    description: Annotated[str, Meta(max_length=MAX_STRING)] | None = None
    schema: dict[str, Any] | None = None
    strict: bool | None = None


class TextConfig(msgspec.Struct, kw_only=True, omit_defaults=True):
    format: TextFormat = msgspec.field(default_factory=TextFormat)
    verbosity: Any = UNSET  # documented, not acted on (`text.verbosity`)


class ResponsesRequest(_Request, kw_only=True):
    # OpenAI's documented fields accepted and not acted on (`ignored_fields`).
    IGNORED: ClassVar[tuple[str, ...]] = (
        "include", "max_tool_calls", "prompt_cache_key", "prompt_cache_retention", "reasoning",
        "safety_identifier", "service_tier", "stream_options", "top_logprobs", "truncation")

    model: Annotated[str, Meta(min_length=1, max_length=256)]
    input: Text | Annotated[list[InputItem], Meta(max_length=1024)]
    instructions: Text | None = None
    max_output_tokens: Annotated[int, Meta(ge=1)] | None = None
    temperature: Temperature | None = None
    top_p: TopP | None = None
    tools: Annotated[list[FunctionTool], Meta(max_length=MAX_TOOLS)] | None = None
    tool_choice: Literal["none", "auto", "required"] | ToolChoiceFunction | None = None
    parallel_tool_calls: bool | None = None
    text: TextConfig | None = None
    stream: bool = False
    store: bool | None = None  # None: true, as OpenAI's default
    previous_response_id: Id | None = None
    metadata: Annotated[dict[str, Annotated[str, Meta(max_length=512)]],
                        Meta(max_length=16)] | None = None
    user: Annotated[str, Meta(max_length=256)] | None = None
    # Refused when asked for (a 400 naming it): not served here.
    background: bool | None = None
    conversation: Any = None
    prompt: Any = None
    # Documented, not acted on (IGNORED): any value a client sends is accepted.
    include: Any = UNSET
    max_tool_calls: Any = UNSET
    prompt_cache_key: Any = UNSET
    prompt_cache_retention: Any = UNSET
    reasoning: Any = UNSET
    safety_identifier: Any = UNSET
    service_tier: Any = UNSET
    stream_options: Any = UNSET
    top_logprobs: Any = UNSET
    truncation: Literal["auto", "disabled"] | UnsetType = UNSET


def ignored_fields(req: ResponsesRequest) -> list[str]:
    names = [n for n in ResponsesRequest.IGNORED if getattr(req, n) is not UNSET]
    if req.text is not None and req.text.verbosity is not UNSET:
        names.append("text.verbosity")
    return names


# ------------------------------------------------------------------ output
class OutputText(msgspec.Struct, kw_only=True):
    text: str
    type: str = "output_text"
    annotations: list[Any] = msgspec.field(default_factory=list)
    logprobs: list[Any] = msgspec.field(default_factory=list)


class MessageItem(msgspec.Struct, kw_only=True, tag_field="type", tag="message"):
    id: str
    content: list[OutputText]
    status: str = "completed"  # in_progress | completed | incomplete
    role: str = "assistant"


class FunctionCallItem(msgspec.Struct, kw_only=True, tag_field="type", tag="function_call"):
    id: str
    call_id: str
    name: str
    arguments: str
    status: str = "completed"


class ReasoningText(msgspec.Struct, kw_only=True):
    text: str
    type: str = "reasoning_text"


class ReasoningItem(msgspec.Struct, kw_only=True, tag_field="type", tag="reasoning"):
    """A reasoning model's thinking (services/gateway/reasoning.py), whole replies only."""

    id: str
    content: list[ReasoningText]
    summary: list[Any] = msgspec.field(default_factory=list)


OutputItem = MessageItem | FunctionCallItem | ReasoningItem


class InputTokensDetails(msgspec.Struct):
    cached_tokens: int = 0


class OutputTokensDetails(msgspec.Struct):
    reasoning_tokens: int = 0


class ResponseUsage(msgspec.Struct, kw_only=True):
    input_tokens: int
    output_tokens: int
    total_tokens: int
    input_tokens_details: InputTokensDetails = msgspec.field(default_factory=InputTokensDetails)
    output_tokens_details: OutputTokensDetails = msgspec.field(
        default_factory=OutputTokensDetails)


class IncompleteDetails(msgspec.Struct):
    reason: str


class ResponseError(msgspec.Struct):
    code: str
    message: str


class EchoedTool(msgspec.Struct, kw_only=True):
    """A function tool as the response echoes it."""

    name: str
    parameters: dict[str, Any] | None = None
    strict: bool | None = None
    description: str | None = None
    type: str = "function"


class EchoedChoice(msgspec.Struct, kw_only=True):
    name: str
    type: str = "function"


class Response(msgspec.Struct, kw_only=True):
    """The `response` object (every field written, nulls included, as OpenAI's)."""

    id: str
    created_at: int
    model: str
    output: list[OutputItem]
    status: str = "completed"  # in_progress | completed | incomplete | failed
    object: str = "response"
    error: ResponseError | None = None
    incomplete_details: IncompleteDetails | None = None
    instructions: str | None = None
    max_output_tokens: int | None = None
    metadata: dict[str, str] = msgspec.field(default_factory=dict)
    parallel_tool_calls: bool = True
    previous_response_id: str | None = None
    store: bool = True
    temperature: float | None = None
    top_p: float | None = None
    text: TextConfig = msgspec.field(default_factory=TextConfig)
    tool_choice: str | EchoedChoice = "auto"
    tools: list[EchoedTool] = msgspec.field(default_factory=list)
    truncation: str = "disabled"
    usage: ResponseUsage | None = None
    user: str | None = None
    background: bool = False


class Deleted(msgspec.Struct):
    id: str
    object: str = "response"
    deleted: bool = True


class ListedPart(msgspec.Struct, kw_only=True, omit_defaults=True):
    """A content part of a listed item: `input_text`, or a reply's `output_text` (with
    its `annotations` and `logprobs`, as OpenAI writes them), or `reasoning_text`."""

    type: str
    text: str
    annotations: list[Any] | UnsetType = UNSET
    logprobs: list[Any] | UnsetType = UNSET


class ListedItem(msgspec.Struct, kw_only=True, omit_defaults=True):
    """One item a response was made from, as `GET /v1/responses/{id}/input_items`
    lists it, with its id: a `message` (role, content), a `function_call` (call_id,
    name, arguments), a `function_call_output` (call_id, output) or a `reasoning`
    item (summary, content). One struct for all, as InputItem; the fields an item's
    type has not are left out."""

    id: str
    type: str
    status: str | UnsetType = UNSET
    role: str | UnsetType = UNSET
    content: list[ListedPart] | UnsetType = UNSET
    call_id: str | UnsetType = UNSET
    name: str | UnsetType = UNSET
    arguments: str | UnsetType = UNSET
    output: str | list[ListedPart] | UnsetType = UNSET
    summary: list[Any] | UnsetType = UNSET


class InputItemList(msgspec.Struct, kw_only=True):
    """`GET /v1/responses/{id}/input_items`: one page of a response's input items."""

    data: list[ListedItem]
    first_id: str | None
    last_id: str | None
    has_more: bool
    object: str = "list"


class Stored(msgspec.Struct, kw_only=True):
    """What the response store keeps per response: the response, its whole
    conversation in chat form (the instructions left out, as a follow-up's own
    apply; the response's reply last), which a follow-up's `previous_response_id`
    continues, and the items it was made from with their ids (the earlier turns'
    inputs and outputs, then its own input), which `input_items` lists."""

    response: Response
    messages: list[ChatMessage]
    items: list[ListedItem] = msgspec.field(default_factory=list)


# ------------------------------------------------------------------ events
class ResponseEvent(msgspec.Struct, kw_only=True):
    """`response.created`, `.in_progress`, `.completed`, `.incomplete`, `.failed`."""

    type: str
    sequence_number: int
    response: Response


class ItemEvent(msgspec.Struct, kw_only=True):
    """`response.output_item.added` / `.done`."""

    type: str
    sequence_number: int
    output_index: int
    item: OutputItem


class PartEvent(msgspec.Struct, kw_only=True):
    """`response.content_part.added` / `.done`."""

    type: str
    sequence_number: int
    item_id: str
    output_index: int
    content_index: int
    part: OutputText


class TextDeltaEvent(msgspec.Struct, kw_only=True):
    type: str
    sequence_number: int
    item_id: str
    output_index: int
    content_index: int
    delta: str
    logprobs: list[Any] = msgspec.field(default_factory=list)


class TextDoneEvent(msgspec.Struct, kw_only=True):
    type: str
    sequence_number: int
    item_id: str
    output_index: int
    content_index: int
    text: str
    logprobs: list[Any] = msgspec.field(default_factory=list)


class ArgumentsDeltaEvent(msgspec.Struct, kw_only=True):
    type: str
    sequence_number: int
    item_id: str
    output_index: int
    delta: str


class ArgumentsDoneEvent(msgspec.Struct, kw_only=True):
    type: str
    sequence_number: int
    item_id: str
    output_index: int
    arguments: str
