"""Text Embeddings Inference's routes over HTTP: `POST /embed`, and `POST /rerank`
with TEI's body (`query` and `texts`), beside OpenAI's and Cohere's shapes.

  1. prepare: decode TEI's body (shared/api_tei.py), pick the model (its `model`, or
     the one model served for the task: TEI serves one and its clients name none),
     and hand the same request in OpenAI's / Cohere's shape to the embeddings or
     rerank pipeline, which validates, tokenizes and admits it as any other.
  2. whole: that pipeline's answer in TEI's shape: a list of vectors; ranks best
     first, each with its index (and its text when `return_text`).

`/rerank` is Cohere's and vLLM's path too: a body with `texts` is TEI's, any other
goes to the rerank pipeline unchanged (`RerankRoute`). TEI's `normalize` is served
as asked where the model's vectors allow it: unit vectors from a model without a
Normalize module are normalised here; raw vectors from a model that normalises in
its own modules cannot be had (400). A rerank's `raw_scores` gives the classifier's
logits before the model's activation (sigmoid for one label), and its `truncate`
cuts a pair longer than the model takes to its limit, the longer text first (without
it such a pair is a 400 naming it).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, cast

import msgspec

from services.gateway import codec
from services.gateway.embeddings import EmbedPrepared, Embeddings
from services.gateway.frontend import Frontend
from services.gateway.rerank import Pairs, PairsPrepared
from shared.api import EmbeddingRequest, RerankRequest, RerankResponse
from shared.api_tei import TeiEmbedRequest, TeiRank, TeiRerankRequest
from shared.errors import bad_request

if TYPE_CHECKING:
    from services.gateway.call import Call


@dataclass(slots=True)
class TeiEmbedPrepared:
    inner: EmbedPrepared
    unit: bool  # normalise the vectors here
    stream: bool = False


@dataclass(slots=True)
class TeiRerankPrepared:
    inner: PairsPrepared
    return_text: bool
    stream: bool = False


async def _only_model(front: Frontend, task: str, what: str) -> str:
    """The one served encoder model of `task` ("embed" or "score"), else a 400."""
    names = []
    for card in front.model_list().data:
        if card.kind == "encoder" and card.state != "failed":
            entry = await front.models.get(card.id)
            if entry.task == task:
                names.append(card.id)
    if len(names) != 1:
        served = ", ".join(names) or "none"
        raise bad_request(f"name the {what} with 'model': this gateway serves {len(names)} "
                          f"({served})")  # fmt: skip
    return names[0]


class TeiEmbed:
    """TEI's `/embed` (services.gateway.pipeline.Pipeline)."""

    name = "embeddings"

    def __init__(self, front: Frontend) -> None:
        self.front = front
        self.inner = Embeddings(front)

    async def prepare(self, body: bytes, call: Call) -> TeiEmbedPrepared:
        front = self.front
        front.check_size(body, front.config.max_body)
        req = codec.decode(body, TeiEmbedRequest, call.msgpack)
        model = req.model or await _only_model(front, "embed", "embedding model")
        entry = await front.models.get(model.split("@", 1)[0])
        if not req.normalize and entry.normalized:
            raise bad_request(f"model '{model}' normalises its vectors in its own modules: "
                              "'normalize': false cannot be served for it")  # fmt: skip
        inner = EmbeddingRequest(model=model, input=req.inputs, dimensions=req.dimensions,
                                 prompt_name=req.prompt_name,
                                 truncate_prompt_tokens=-1 if req.truncate else None)
        prep = await self.inner.prepare(msgspec.json.encode(inner), _json(call))
        return TeiEmbedPrepared(prep, unit=req.normalize and not entry.normalized)

    async def whole(self, prep: TeiEmbedPrepared, call: Call) -> list[list[float]]:
        resp = await self.inner.whole(prep.inner, call)
        # float lists: the inner request asks for the default encoding_format
        vectors = cast("list[list[float]]",
                       [d.embedding for d in sorted(resp.data, key=lambda d: d.index)])
        return [_unit(v) for v in vectors] if prep.unit else vectors

    async def chunks(self, prep, call: Call):
        raise bad_request("embed is not streamed")
        yield []


class RerankRoute:
    """`/rerank`: TEI's body (with `texts`) or Cohere's, told apart by their fields."""

    name = "rerank"

    def __init__(self, front: Frontend) -> None:
        self.front = front
        self.cohere = Pairs(front)

    async def prepare(self, body: bytes, call: Call):
        self.front.check_size(body)
        try:
            fields = msgspec.json.decode(body, type=dict[str, msgspec.Raw])
        except (msgspec.DecodeError, msgspec.ValidationError):
            fields = {}  # the rerank pipeline says what is wrong with it
        if "texts" not in fields:
            return await self.cohere.prepare(body, call)
        req = codec.decode(body, TeiRerankRequest, call.msgpack)
        model = req.model or await _only_model(self.front, "score", "reranker")
        inner = RerankRequest(model=model, query=req.query, documents=list(req.texts))
        prep = await self.cohere.prepare(msgspec.json.encode(inner), _json(call),
                                         raw=req.raw_scores, truncate=req.truncate)
        return TeiRerankPrepared(prep, req.return_text)

    async def whole(self, prep, call: Call):
        if isinstance(prep, PairsPrepared):
            return await self.cohere.whole(prep, call)
        resp = cast(RerankResponse, await self.cohere.whole(prep.inner, call))  # not score
        texts = prep.inner.req.documents
        return [TeiRank(r.index, r.relevance_score, texts[r.index] if prep.return_text else None)
                for r in resp.results]

    async def chunks(self, prep, call: Call):
        raise bad_request("rerank is not streamed")
        yield []


def _json(call: Call) -> Call:
    """The call, its body now JSON (what the inner pipeline decodes)."""
    call.msgpack = False
    return call


def _unit(v: list[float]) -> list[float]:
    norm = math.sqrt(sum(x * x for x in v))
    return [x / norm for x in v] if norm > 0 else v
