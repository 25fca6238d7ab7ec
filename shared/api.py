"""The public request and response shapes: OpenAI's, as msgspec Structs (the
generation replies in shared/api_replies.py, model cards and the tokenizer endpoints'
in shared/api_models.py, structured outputs' `structured_bounds` in
shared/api_structured.py).

Requests are decoded once at the edge (gateway) with typed decoders; past that no
code sees dicts. Hard limits live here as `Meta` constraints; limits an operator can
change (inputs per request, tokens per input) are checked against `shared.config`.
Unknown fields are refused so that a typo is a 400, not a silently ignored option.
Fields OpenAI documents that tensorbus does not act on (`metadata`, `store`,
`service_tier`, ...) are accepted and named back: each request type's `IGNORED`, read
by `ignored_fields`, which the gateway lists in its `Tensorbus-Ignored-Fields` header
and its log, as vLLM warns of them.
"""

from __future__ import annotations

from typing import Annotated, Any, ClassVar, Literal

import msgspec
from msgspec import UNSET, Meta, UnsetType

from shared.api_structured import StructuredBounds

# Hard ceilings. Operators lower them through config; nothing raises them.
MAX_STRING = 1_000_000
MAX_LIST = 4096
MAX_STOP = 4
MAX_PROMPTS = 64  # prompts in one completions request's list (the gateway checks it)

Text = Annotated[str, Meta(max_length=MAX_STRING)]
TokenId = Annotated[int, Meta(ge=0, le=2**31 - 1)]
TokenList = Annotated[list[TokenId], Meta(max_length=MAX_LIST * 4)]


class _Request(msgspec.Struct, forbid_unknown_fields=True, omit_defaults=True, kw_only=True):
    pass


# ----------------------------------------------------------------- embeddings
class EmbeddingRequest(_Request, kw_only=True):
    model: Annotated[str, Meta(min_length=1, max_length=256)]
    # A string, or a list of strings, token ids, or token-id lists. msgspec unions
    # hold one list type, so homogeneity is checked by the gateway.
    input: Text | Annotated[list[Text | TokenId | TokenList], Meta(max_length=MAX_LIST * 4)]
    encoding_format: Literal["float", "base64"] = "float"
    # Matryoshka truncation: only for models that declare it (their config.json's
    # `matryoshka_dimensions`, or `is_matryoshka`); otherwise the full width or a 400.
    dimensions: Annotated[int, Meta(ge=1)] | None = None
    # vLLM's opt-in truncation of over-long inputs: k tokens (special tokens
    # included) or -1 for the model's own limit. Unset, an over-long input is a 400.
    truncate_prompt_tokens: Annotated[int, Meta(ge=-1)] | None = None
    # vLLM's: special tokens' text in the answer (default: left out), and the stop
    # string that ended it kept at its end (default: cut, as OpenAI does).
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    # vLLM's: EOS and `stop_token_ids` cannot end a choice before this many tokens.
    min_tokens: Annotated[int, Meta(ge=0)] = 0
    # The model's sentence-transformers prompt prepended to text inputs, by name
    # (`prompt_name`, as in SentenceTransformer.encode) or by role (`input_type`:
    # "query" or "document"); unset: the model's default prompt, if it has one.
    prompt_name: Annotated[str, Meta(min_length=1, max_length=256)] | None = None
    input_type: Literal["query", "document"] | None = None
    user: Annotated[str, Meta(max_length=256)] | None = None


class Usage(msgspec.Struct, omit_defaults=True):
    """`completion_tokens` is left out for embeddings, as in OpenAI's shape."""

    prompt_tokens: int
    total_tokens: int
    completion_tokens: int | None = None


class Embedding(msgspec.Struct):
    index: int
    embedding: list[float] | str
    object: str = "embedding"


class EmbeddingResponse(msgspec.Struct):
    data: list[Embedding]
    model: str
    usage: Usage
    object: str = "list"


# ------------------------------------------------------------ rerank / score
class DocumentIn(_Request, kw_only=True):
    """A document as an object (Cohere's and Jina's clients send `{"text": ...}`)."""

    text: Text


class RerankRequest(_Request, kw_only=True):
    """The Cohere / Jina shape that vLLM and infinity serve. `top_n` past the
    number of documents returns them all; `return_documents` (Cohere's default:
    off) puts each document's text beside its score. A document is a string or an
    object with its `text`."""

    model: Annotated[str, Meta(min_length=1, max_length=256)]
    query: Text
    documents: Annotated[list[Text | DocumentIn], Meta(max_length=MAX_LIST * 4)]
    top_n: Annotated[int, Meta(ge=1)] | None = None
    return_documents: bool = False
    user: Annotated[str, Meta(max_length=256)] | None = None


class RerankDocument(msgspec.Struct):
    text: str


class RerankResult(msgspec.Struct, omit_defaults=True):
    index: int  # the document's place in the request
    relevance_score: float
    document: RerankDocument | None = None


class RerankResponse(msgspec.Struct):
    id: str
    model: str
    results: list[RerankResult]  # best first
    usage: Usage


class ScoreRequest(_Request, kw_only=True):
    """vLLM's shape: `text_1` one text scored against every `text_2`, or a list as
    long as `text_2`, scored pair by pair."""

    model: Annotated[str, Meta(min_length=1, max_length=256)]
    text_1: Text | Annotated[list[Text], Meta(max_length=MAX_LIST * 4)]
    text_2: Text | Annotated[list[Text], Meta(max_length=MAX_LIST * 4)]
    user: Annotated[str, Meta(max_length=256)] | None = None


class ScoreData(msgspec.Struct):
    index: int
    score: float
    object: str = "score"


class ScoreResponse(msgspec.Struct):
    id: str
    created: int
    model: str
    data: list[ScoreData]  # in pair order
    usage: Usage
    object: str = "list"


# ---------------------------------------------------------------- generation
class StreamOptions(_Request, kw_only=True):
    include_usage: bool = False
    continuous_usage_stats: bool = False  # vLLM's extension: usage so far on every chunk
    include_obfuscation: bool | UnsetType = UNSET  # OpenAI's padding of chunks: not done


Temperature = Annotated[float, Meta(ge=0.0, le=2.0)]
TopP = Annotated[float, Meta(gt=0.0, le=1.0)]
Stop = Annotated[str, Meta(min_length=1, max_length=256)]
Penalty = Annotated[float, Meta(ge=-2.0, le=2.0)]
Bias = Annotated[float, Meta(ge=-100.0, le=100.0)]
MAX_LOGIT_BIAS = 300  # entries, as OpenAI allows (engine.decoder.kvcache.MAX_BIAS)
MAX_STOP_TOKENS = 64
MAX_TOP_LOGPROBS = 20  # as OpenAI allows (engine.decoder.sampling.MAX_LOGPROBS)


Pattern = Annotated[str, Meta(min_length=1, max_length=MAX_STRING)]
Choices = Annotated[list[Annotated[str, Meta(min_length=1, max_length=MAX_STRING)]],
                    Meta(min_length=1, max_length=MAX_LIST)]


class _Sampling(_Request, kw_only=True):
    model: Annotated[str, Meta(min_length=1, max_length=256)]
    max_tokens: Annotated[int, Meta(ge=1)] | None = None
    # None = the model's generation_config.json default, else OpenAI's (1, 1, off).
    temperature: Temperature | None = None
    top_p: TopP | None = None
    top_k: Annotated[int, Meta(ge=-1, le=2**31 - 1)] | None = None  # -1, 0 or >= vocabulary = off
    seed: Annotated[int, Meta(ge=0, le=2**63 - 1)] | None = None
    stop: Stop | Annotated[list[Stop], Meta(max_length=MAX_STOP)] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: Annotated[int, Meta(ge=1)] = 1
    user: Annotated[str, Meta(max_length=256)] | None = None
    ignore_eos: bool = False  # vLLM's extension: generate exactly max_tokens (benchmarks)
    # Applied on the device inside the step (engine/decoder/sampling.py); None = off
    # (repetition_penalty and min_p: the model's generation_config.json, else off).
    presence_penalty: Penalty | None = None
    frequency_penalty: Penalty | None = None
    repetition_penalty: Annotated[float, Meta(gt=0.0, le=10.0)] | None = None
    min_p: Annotated[float, Meta(ge=0.0, le=1.0)] | None = None
    # token id (a string key in JSON) -> bias added to its logit
    logit_bias: Annotated[dict[TokenId, Bias], Meta(max_length=MAX_LOGIT_BIAS)] | None = None
    stop_token_ids: Annotated[list[TokenId], Meta(max_length=MAX_STOP_TOKENS)] | None = None
    response_format: "ResponseFormat | None" = None  # structured outputs
    # vLLM's structured outputs, enforced as response_format is (at most one of them):
    # the older `guided_*` fields and the newer `structured_outputs` object.
    guided_json: dict[str, Any] | Annotated[str, Meta(max_length=MAX_STRING)] | None = None
    guided_regex: Pattern | None = None
    guided_choice: Choices | None = None
    guided_grammar: Pattern | None = None  # a Lark grammar (llguidance's dialect)
    structured_outputs: "StructuredOutputs | None" = None
    # Default bounds on a JSON schema's unbounded values (shared/api_structured.py),
    # unset or true: the defaults; null or false: none.
    structured_bounds: StructuredBounds | bool | None | UnsetType = UNSET
    # vLLM's: keep the prompt's last k tokens (after the chat template; -1: as many as
    # the context leaves one to generate) instead of refusing one that is too long.
    truncate_prompt_tokens: Annotated[int, Meta(ge=-1)] | None = None
    # vLLM's: special tokens' text in the answer (default: left out), and the stop
    # string that ended it kept at its end (default: cut, as OpenAI does).
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    # vLLM's: EOS and `stop_token_ids` cannot end a choice before this many tokens.
    min_tokens: Annotated[int, Meta(ge=0)] = 0
    # Candidates sampled to return the n best: up to n it is what n does (the gateway
    # refuses more); LiteLLM and older clients send best_of: 1.
    best_of: Annotated[int, Meta(ge=1)] | None | UnsetType = UNSET


TopLogprobs = Annotated[int, Meta(ge=0, le=MAX_TOP_LOGPROBS)]


class StructuredOutputs(_Request, kw_only=True):
    """vLLM's `structured_outputs`: one of a JSON schema, a regex, choices or a Lark
    grammar."""

    json: dict[str, Any] | Annotated[str, Meta(max_length=MAX_STRING)] | None = None
    regex: Pattern | None = None
    choice: Choices | None = None
    grammar: Pattern | None = None


class JsonSchemaFormat(_Request, kw_only=True):
    """`response_format.json_schema`: OpenAI's shape. `schema` is checked by the
    gateway (services/gateway/structured.py); `strict` is accepted either way: the
    schema is always enforced."""

    name: Annotated[str, Meta(min_length=1, max_length=64)]
    description: Annotated[str, Meta(max_length=MAX_STRING)] | None = None
    schema: dict[str, Any] | bool | None = None
    strict: bool | None = None


class ResponseFormat(_Request, kw_only=True):
    """Structured outputs: `json_object` (any JSON object) or `json_schema`."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class CompletionRequest(_Sampling, kw_only=True):
    IGNORED: ClassVar[tuple[str, ...]] = ("suffix",)

    # One prompt (a string, or a list of token ids), or a list of up to MAX_PROMPTS
    # prompts (strings, or token-id lists), answered as one (services/gateway/fanout.py).
    prompt: Text | Annotated[list[Text | TokenId | TokenList], Meta(max_length=MAX_LIST * 4)] = ""
    max_tokens: Annotated[int, Meta(ge=1)] | None = 16
    echo: bool = False
    logprobs: TopLogprobs | None = None  # top logprobs per token (0: the sampled token's)
    # vLLM's: the prompt's tokens scored (each given those before it), with this many
    # top alternatives each, in each choice's `prompt_logprobs` (as chat's).
    prompt_logprobs: TopLogprobs | None = None
    suffix: Any = UNSET  # documented, not acted on (IGNORED)


class ContentPart(msgspec.Struct, kw_only=True):
    """One part of a message's `content` list. Only `text` parts are served; any
    other type (image_url, input_audio, file, ...) is refused by name, so its own
    fields are not checked here."""

    type: Annotated[str, Meta(min_length=1, max_length=64)]
    text: Text | None = None


# ------------------------------------------------------------------ tools
FunctionName = Annotated[str, Meta(min_length=1, max_length=64, pattern="^[A-Za-z0-9_.-]+$")]
MAX_TOOLS = 128


class FunctionDef(_Request, kw_only=True):
    name: FunctionName
    description: Annotated[str, Meta(max_length=MAX_STRING)] | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema (None: no arguments)
    strict: bool | None = None  # accepted; the schema is always enforced when forced


class Tool(_Request, kw_only=True):
    type: Literal["function"]
    function: FunctionDef


class FunctionRef(_Request, kw_only=True):
    name: FunctionName


class NamedToolChoice(_Request, kw_only=True):
    type: Literal["function"]
    function: FunctionRef


class FunctionCall(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    name: FunctionName
    arguments: Text  # JSON text, as the model wrote it


class ToolCall(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """A call the assistant made: in a reply, and in the messages sent back (every
    field written out: `type` too, as OpenAI's replies carry it)."""

    id: Annotated[str, Meta(max_length=256)]
    type: Literal["function"] = "function"
    function: FunctionCall


class FunctionDelta(msgspec.Struct, omit_defaults=True):
    name: str | None = None
    arguments: str | None = None


class ToolCallDelta(msgspec.Struct, omit_defaults=True):
    """A streamed piece of a tool call: the first carries id, type and name."""

    index: int
    id: str | None = None
    type: str | None = None
    function: FunctionDelta | None = None


ChatRole = Literal["system", "user", "assistant", "developer", "tool"]


class ChatMessage(_Request, kw_only=True):
    role: ChatRole
    content: Text | Annotated[list[ContentPart], Meta(max_length=MAX_LIST)] | None = None
    name: Annotated[str, Meta(max_length=256)] | None = None
    tool_calls: Annotated[list[ToolCall], Meta(max_length=MAX_TOOLS)] | None = None  # assistant
    tool_call_id: Annotated[str, Meta(max_length=256)] | None = None  # tool: the call answered


class ChatCompletionRequest(_Sampling, kw_only=True):
    # OpenAI's documented fields accepted and not acted on (`ignored_fields`).
    IGNORED: ClassVar[tuple[str, ...]] = (
        "audio", "function_call", "functions", "metadata", "modalities", "prediction",
        "prompt_cache_key", "reasoning_effort", "safety_identifier", "service_tier", "store",
        "verbosity", "web_search_options")

    messages: Annotated[list[ChatMessage], Meta(min_length=1, max_length=1024)]
    max_completion_tokens: Annotated[int, Meta(ge=1)] | None = None
    # vLLM's: a Jinja template in place of the model's (TENSORBUS_TRUST_REQUEST_CHAT_TEMPLATE),
    # extra variables for the template (`enable_thinking`, ...), and whether it ends
    # with the assistant's turn opened (default) or renders the messages only.
    chat_template: Annotated[str, Meta(min_length=1, max_length=MAX_STRING)] | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    add_generation_prompt: bool = True
    logprobs: bool = False
    top_logprobs: TopLogprobs | None = None  # needs `logprobs`
    # vLLM's: the rendered prompt's tokens scored (each given those before it), with
    # this many top alternatives each, in the reply's top-level `prompt_logprobs`.
    prompt_logprobs: TopLogprobs | None = None
    # services/gateway/tools.py: rendered, enforced (required, named) and parsed
    tools: Annotated[list[Tool], Meta(max_length=MAX_TOOLS)] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    # Documented, not acted on (IGNORED): any value a client sends is accepted.
    audio: Any = UNSET
    function_call: Any = UNSET  # the legacy function calling (use tools)
    functions: Any = UNSET
    metadata: Any = UNSET
    modalities: Any = UNSET
    prediction: Any = UNSET
    prompt_cache_key: Any = UNSET
    reasoning_effort: Any = UNSET
    safety_identifier: Any = UNSET
    service_tier: Any = UNSET
    store: Any = UNSET
    verbosity: Any = UNSET
    web_search_options: Any = UNSET


def ignored_fields(req: CompletionRequest | ChatCompletionRequest) -> list[str]:
    """The documented fields `req` carries that nothing acts on, in its type's order
    (`stream_options.include_obfuscation` included)."""
    names = [n for n in type(req).IGNORED if getattr(req, n) is not UNSET]
    if req.stream_options is not None and req.stream_options.include_obfuscation is not UNSET:
        names.append("stream_options.include_obfuscation")
    return names
