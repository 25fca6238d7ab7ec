"""The generation endpoints' replies: completions and chat completions, whole and
streamed, with their logprobs (OpenAI's shapes; the requests are in shared/api.py)."""

from __future__ import annotations

import msgspec

from shared.api import ToolCall, ToolCallDelta, Usage

# --------------------------------------------------------------- logprobs
class TopLogprob(msgspec.Struct):
    token: str
    logprob: float
    bytes: list[int] | None


class ChatTokenLogprob(msgspec.Struct):
    token: str
    logprob: float
    bytes: list[int] | None
    top_logprobs: list[TopLogprob]


class ChatLogprobs(msgspec.Struct):
    content: list[ChatTokenLogprob] | None


class PromptLogprob(msgspec.Struct):
    """vLLM's `Logprob`: one entry of `prompt_logprobs` (a prompt position's map of
    token id -> this: its own token first, then the top alternatives)."""

    logprob: float
    rank: int | None
    decoded_token: str | None


# `prompt_logprobs` (chat's at the top level, completions' per choice): the first
# prompt token's null, then one map per later token
PromptLogprobs = list[dict[int, PromptLogprob] | None]


class CompletionLogprobs(msgspec.Struct):
    tokens: list[str]
    token_logprobs: list[float | None]  # None: an echoed prompt's first token
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]


class CompletionChoice(msgspec.Struct):
    index: int
    text: str
    finish_reason: str | None
    logprobs: CompletionLogprobs | None = None
    # vLLM's, when asked (streamed: on each choice's first chunk); left out otherwise
    prompt_logprobs: PromptLogprobs | msgspec.UnsetType = msgspec.UNSET


class CompletionResponse(msgspec.Struct):
    id: str
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None
    object: str = "text_completion"
    system_fingerprint: str | None = None


class ResponseMessage(msgspec.Struct):
    role: str
    content: str | None = None
    tool_calls: list[ToolCall] | None = None
    # A reasoning model's thinking (services/gateway/reasoning.py). UNSET, left out of
    # the reply: a client that does not know the field sees nothing new.
    reasoning_content: str | msgspec.UnsetType = msgspec.UNSET


class ChatChoice(msgspec.Struct):
    index: int
    message: ResponseMessage
    finish_reason: str | None
    logprobs: ChatLogprobs | None = None


class ChatCompletionResponse(msgspec.Struct):
    id: str
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage | None = None
    object: str = "chat.completion"
    system_fingerprint: str | None = None
    prompt_logprobs: PromptLogprobs | msgspec.UnsetType = msgspec.UNSET  # vLLM's, when asked


class ChatDelta(msgspec.Struct, omit_defaults=True):
    role: str | None = None
    content: str | None = None
    tool_calls: list[ToolCallDelta] | None = None
    reasoning_content: str | None = None  # a reasoning model's thinking, as it streams


class ChatChunkChoice(msgspec.Struct):
    index: int
    delta: ChatDelta
    finish_reason: str | None = None
    logprobs: ChatLogprobs | None = None


class ChatCompletionChunk(msgspec.Struct):
    id: str
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None
    object: str = "chat.completion.chunk"
    prompt_logprobs: PromptLogprobs | msgspec.UnsetType = msgspec.UNSET  # on the first


class CompletionChunk(msgspec.Struct):
    id: str
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None
    object: str = "text_completion"


STREAM_DONE = b"[DONE]"
