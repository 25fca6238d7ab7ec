"""The gateway's endpoints, one pipeline each, named once for both transports.

  1. prepare(body, call): decode and validate the body, resolve the model, tokenize,
     check limits and admission (400 / 404 / 413 / 429 / 503), build the work.
  2. whole(prep, call): dispatch and wait for the answer; the OpenAI-shaped reply.
  3. chunks(prep, call): dispatch a streaming request; its OpenAI chunk objects, as
     lists of those ready together (the transport may send a list in one write).

`routes()` is the one explicit list of endpoints: each pipeline with the NATS subject
(services.gateway.service) and the HTTP path (services.gateway.http) it answers on.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, AsyncIterator, Protocol, TypeVar

from services.gateway.call import Call
from services.gateway.embeddings import Embeddings
from services.gateway.frontend import Frontend
from services.gateway.generation import Generation
from services.gateway.rerank import Pairs
from services.gateway.responses import Responses
from services.gateway.tokenize import Tokenize
from shared import subjects


class Prepared(Protocol):
    @property
    def stream(self) -> bool: ...  # whether the reply is streamed


P = TypeVar("P", bound=Prepared)  # what a pipeline's prepare gives its whole and chunks


class Pipeline(Protocol[P]):
    name: str  # the endpoint as telemetry records name it

    async def prepare(self, body: bytes, call: Call) -> P: ...

    async def whole(self, prep: P, call: Call) -> object: ...

    def chunks(self, prep: P, call: Call) -> AsyncIterator[list[object]]: ...


@dataclass(frozen=True, slots=True)
class Route:
    pipeline: Pipeline[Any]
    endpoint: str  # the nats.micro endpoint name (`nats micro stats`)
    subject: str
    path: str
    cut: bool = False  # HTTP bodies past the bus's max_payload are cut into parts (embeddings)


def routes(front: Frontend) -> list[Route]:
    return [
        Route(Embeddings(front), "embeddings", subjects.EMBEDDINGS, "/v1/embeddings", cut=True),
        Route(Generation(front, chat=False), "completions", subjects.COMPLETIONS,
              "/v1/completions"),
        Route(Generation(front, chat=True), "chat-completions", subjects.CHAT_COMPLETIONS,
              "/v1/chat/completions"),
        Route(Responses(front), "responses", subjects.RESPONSES, "/v1/responses"),
        Route(Pairs(front), "rerank", subjects.RERANK, "/v1/rerank"),
        Route(Pairs(front, rerank=False), "score", subjects.SCORE, "/v1/score"),
        Route(Tokenize(front), "tokenize", subjects.TOKENIZE, "/v1/tokenize"),
        Route(Tokenize(front, inverse=True), "detokenize", subjects.DETOKENIZE,
              "/v1/detokenize"),
    ]
