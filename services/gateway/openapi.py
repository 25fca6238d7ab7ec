"""The gateway's OpenAPI 3.1 document, generated from the msgspec Structs it serves."""

from __future__ import annotations

import msgspec

from shared import VERSION
from shared.api import (
    ChatCompletionRequest,
    CompletionRequest,
    EmbeddingRequest,
    EmbeddingResponse,
    RerankRequest,
    RerankResponse,
    ScoreRequest,
    ScoreResponse,
)
from shared.api_replies import (ChatCompletionChunk, ChatCompletionResponse, CompletionChunk,
                                CompletionResponse)
from shared.api_models import (DetokenizeRequest, DetokenizeResponse, ModelCard, ModelList,
                               TokenizeRequest, TokenizeResponse)
from shared.api_batches import Batch, BatchList, CreateBatch, FileDeleted, FileList, FileObject
from shared.api_responses import Deleted, InputItemList, Response, ResponsesRequest
from shared.errors import ErrorBody

_ERRORS = {"400": "invalid request", "401": "missing or wrong API key", "404": "unknown model",
           "413": "body too large", "429": "over capacity (see Retry-After)",
           "503": "no ready worker", "504": "deadline exceeded", "500": "internal error"}


def _ref(name: str) -> dict:
    return {"$ref": f"#/components/schemas/{name}"}


def _op(summary: str, req: str | None, resp: str, stream: str | None = None) -> dict:
    ok: dict = {"description": "success", "content": {"application/json": {"schema": _ref(resp)}}}
    if stream:
        ok["content"]["text/event-stream"] = {
            "schema": {"type": "string", "description": f"SSE: `data: <{stream}>` events, then `data: [DONE]`"}}
    responses = {"200": ok}
    for code, why in _ERRORS.items():
        responses[code] = {"description": why,
                           "content": {"application/json": {"schema": _ref("ErrorBody")}}}
    op = {"summary": summary, "responses": responses}
    if req:
        op["requestBody"] = {"required": True,
                             "content": {"application/json": {"schema": _ref(req)}}}
    return op


def openapi_document() -> dict:
    types = [EmbeddingRequest, EmbeddingResponse, CompletionRequest, CompletionResponse,
             CompletionChunk, ChatCompletionRequest, ChatCompletionResponse, ChatCompletionChunk,
             TokenizeRequest, TokenizeResponse, DetokenizeRequest, DetokenizeResponse,
             RerankRequest, RerankResponse, ScoreRequest, ScoreResponse, ModelList, ModelCard,
             ResponsesRequest, Response, Deleted, InputItemList, ErrorBody, CreateBatch, Batch,
             BatchList, FileObject, FileList, FileDeleted]
    _, components = msgspec.json.schema_components(types, ref_template="#/components/schemas/{name}")
    plain = lambda d: {"responses": {"200": {"description": d}, "503": {"description": "not ready"}}}
    return {
        "openapi": "3.1.0",
        "info": {"title": "tensorbus", "version": VERSION,
                 "description": "OpenAI-compatible inference API served over NATS and HTTP."},
        "paths": {
            "/v1/embeddings": {"post": _op("Create embeddings", "EmbeddingRequest", "EmbeddingResponse")},
            "/v1/completions": {"post": _op("Create a completion", "CompletionRequest",
                                            "CompletionResponse", "CompletionChunk")},
            "/v1/chat/completions": {"post": _op("Create a chat completion", "ChatCompletionRequest",
                                                 "ChatCompletionResponse", "ChatCompletionChunk")},
            "/v1/rerank": {"post": _op("Rank documents by relevance to a query, with a "
                                       "cross-encoder", "RerankRequest", "RerankResponse")},
            "/v1/score": {"post": _op("Score text pairs with a cross-encoder", "ScoreRequest",
                                      "ScoreResponse")},
            "/v1/tokenize": {"post": _op("Tokenize a prompt, or chat messages through the "
                                         "model's chat template", "TokenizeRequest",
                                         "TokenizeResponse")},
            "/v1/detokenize": {"post": _op("Token ids back to text", "DetokenizeRequest",
                                           "DetokenizeResponse")},
            "/v1/responses": {"post": _op("Create a response (OpenAI's Responses API)",
                                          "ResponsesRequest", "Response")},
            "/v1/responses/{id}": {
                "get": _op("A stored response (404: unknown or expired)", None, "Response"),
                "delete": _op("Forget a stored response", None, "Deleted"),
                "parameters": [{"name": "id", "in": "path", "required": True,
                                "schema": {"type": "string"}}]},
            "/v1/responses/{id}/input_items": {"get": {
                **_op("The items a stored response was made from (404: unknown or expired)",
                      None, "InputItemList"),
                "parameters": [
                    {"name": "id", "in": "path", "required": True, "schema": {"type": "string"}},
                    {"name": "limit", "in": "query",
                     "schema": {"type": "integer", "minimum": 1, "maximum": 100, "default": 20}},
                    {"name": "order", "in": "query",
                     "schema": {"type": "string", "enum": ["asc", "desc"], "default": "desc"}},
                    {"name": "after", "in": "query", "schema": {"type": "string"}},
                    {"name": "before", "in": "query", "schema": {"type": "string"}}]}},
            **_batch_paths(),
            "/v1/models": {"get": _op("List served models, with their state", None, "ModelList")},
            "/v1/models/{model}": {"get": {
                **_op("One served model's card (404: not served)", None, "ModelCard"),
                "parameters": [{"name": "model", "in": "path", "required": True,
                                "schema": {"type": "string"}}]}},
            "/healthz": {"get": plain("alive")},
            "/health": {"get": plain("alive (vLLM's path; empty body)")},
            "/version": {"get": plain("the server's version, as {\"version\": ...}")},
            "/readyz": {"get": plain("ready: the gateway is serving and connected to the bus")},
        },
        "components": {"schemas": components},
    }


def _batch_paths() -> dict:
    """/v1/files and /v1/batches (services/gateway/batches.py)."""
    def by_id(**ops) -> dict:
        return {**ops, "parameters": [{"name": "id", "in": "path", "required": True,
                                       "schema": {"type": "string"}}]}

    upload = _op("Upload a batch input file (multipart/form-data: purpose=batch, file)",
                 None, "FileObject")
    upload["requestBody"] = {"required": True, "content": {"multipart/form-data": {
        "schema": {"type": "object", "required": ["purpose", "file"], "properties": {
            "purpose": {"type": "string", "enum": ["batch"]},
            "file": {"type": "string", "format": "binary"}}}}}}
    content = _op("A file's bytes", None, "FileObject")
    content["responses"]["200"] = {"description": "the file as stored", "content": {
        "application/octet-stream": {"schema": {"type": "string", "format": "binary"}}}}
    return {
        "/v1/files": {"post": upload, "get": _op("List files, newest first", None, "FileList")},
        "/v1/files/{id}": by_id(get=_op("A file", None, "FileObject"),
                                delete=_op("Delete a file", None, "FileDeleted")),
        "/v1/files/{id}/content": by_id(get=content),
        "/v1/batches": {"post": _op("Create a batch", "CreateBatch", "Batch"),
                        "get": _op("List batches, newest first", None, "BatchList")},
        "/v1/batches/{id}": by_id(get=_op("A batch", None, "Batch")),
        "/v1/batches/{id}/cancel": by_id(post=_op("Cancel a batch", None, "Batch")),
    }
