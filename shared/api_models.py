"""The public shapes about models rather than inference: the model cards of
`/v1/models`, and vLLM's tokenize / detokenize bodies (shared/api.py holds the rest)."""

from __future__ import annotations

from typing import Annotated

import msgspec
from msgspec import Meta

from shared.api import ChatMessage, Text, TokenList, _Request


# ------------------------------------------------------------------ tokenize
class TokenizeRequest(_Request, kw_only=True):
    """vLLM's shape: `prompt`, or `messages` rendered with the model's chat template."""

    model: Annotated[str, Meta(min_length=1, max_length=256)]
    prompt: Text | None = None
    messages: Annotated[list[ChatMessage], Meta(min_length=1, max_length=1024)] | None = None
    add_special_tokens: bool = True  # prompt: the tokenizer's own (BOS ...)
    add_generation_prompt: bool = True  # messages: end with the assistant's turn opening


class TokenizeResponse(msgspec.Struct):
    tokens: list[int]
    count: int
    max_model_len: int


class DetokenizeRequest(_Request, kw_only=True):
    model: Annotated[str, Meta(min_length=1, max_length=256)]
    tokens: TokenList


class DetokenizeResponse(msgspec.Struct):
    prompt: str


# -------------------------------------------------------------------- models
class ModelCard(msgspec.Struct):
    id: str
    created: int
    owned_by: str = "tensorbus"
    object: str = "model"
    # Tokens a request may hold (vLLM's field): a decoder's context (prompt and
    # answer), an encoder's longest input; null until the gateway has read the model.
    max_model_len: int | None = None
    kind: str = ""
    versions: list[str] = []
    ready_workers: int = 0
    state: str = ""  # ready | starting | scaled_to_zero | failed
    reason: str = ""  # why `failed`, or ""
    # Compiled programs over every live worker, and how many they will have (a model
    # serves once its first are compiled; the rest join as they finish).
    programs_compiled: int = 0
    programs_total: int = 0
    # Quantized decoders: compute-form measurements done over live workers, and in
    # all (each bucket's form is measured after ready when no choice was stored).
    forms_measured: int = 0
    forms_total: int = 0
    # Decoders: the stored weights and each bucket's compute form, of a ready worker
    # ("" and {} for encoders and before one is ready).
    quant: str = ""
    compute_forms: dict[str, str] = {}
    # Decoders speculating (TENSORBUS_SPECULATIVE), over live workers since they
    # started: accepted draft tokens / draft tokens, and tokens per verify pass.
    spec_decode_acceptance: float = 0.0
    spec_decode_tokens_per_step: float = 0.0


class ModelList(msgspec.Struct):
    data: list[ModelCard]
    object: str = "list"
