"""The rerank and score endpoints: text pairs through a cross-encoder.

  1. prepare: decode the body (rerank: Cohere's and Jina's shape, `query` and
     `documents`; score: vLLM's, `text_1` and `text_2`), resolve a cross-encoder
     with one score per pair (400 for any other model), check the pairs (400: none,
     more than TENSORBUS_MAX_INPUTS, an empty text, a pair longer than the model
     takes: refused with its index, never cut unless TEI's `truncate` asks), and
     tokenize them through the
     model's pair template (`Tokenizer.encode_pairs`) under the admission every
     encoder request gets (services.gateway.embeddings.tokenized).
  2. whole: one EmbedWork whose inputs are the pairs, with their token types; the
     worker's encoder runner batches it with other requests' inputs (each pair is
     one input) and its engine scores them (services.gateway.embeddings.computed).
  3. Render: rerank sorts by score, best first (ties by index), keeps `top_n` and,
     asked for, each document's text; score keeps the pairs' order.
"""

from __future__ import annotations

import array
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

from services.gateway import codec
from services.gateway.embeddings import check_count, computed, tokenized
from services.gateway.frontend import Frontend, user_key
from services.gateway.models import ModelEntry, split_name
from shared.api import (
    RerankDocument,
    RerankRequest,
    RerankResponse,
    RerankResult,
    ScoreData,
    ScoreRequest,
    ScoreResponse,
    Usage,
)
from shared.errors import bad_request, internal
from shared.messages import EmbedWork

if TYPE_CHECKING:
    from services.gateway.call import Call


@dataclass(slots=True)
class PairsPrepared:
    req: RerankRequest | ScoreRequest
    work: EmbedWork
    stream: bool = False  # always answered whole


class Pairs:
    """The rerank pipeline, or without `rerank` the score one
    (services.gateway.pipeline.Pipeline)."""

    def __init__(self, front: Frontend, rerank: bool = True) -> None:
        self.front = front
        self.rerank = rerank
        self.name = "rerank" if rerank else "score"
        self._type = RerankRequest if rerank else ScoreRequest

    async def prepare(self, body: bytes, call: Call, *, raw: bool = False,
                      truncate: bool = False) -> PairsPrepared:
        """`raw` and `truncate`: TEI's `raw_scores` and `truncate` (services.gateway.tei);
        Cohere's and vLLM's bodies have neither."""
        front = self.front
        front.check_size(body)
        req = codec.decode(body, self._type, call.msgpack)
        name, version = split_name(req.model)
        call.out.model = name
        user = user_key(req.user, call.user)
        entry, version = await front.models.choose(name, version, user)
        check_cross_encoder(entry)
        pairs, each = rerank_pairs(req) if self.rerank else score_pairs(req)
        check_count(len(pairs), front.config, "documents" if self.rerank else "pairs")
        ids, types, reserved = await tokenized(
            front, call, entry, version, body, lambda: (len(pairs), [a + b for a, b in pairs], 0),
            lambda: tokenize_pairs(pairs, entry, each, truncate), "documents" if self.rerank else "pairs")
        call.out.prompt_tokens = sum(len(x) for x in ids)
        work = EmbedWork(call.wire, name, version, ids, call.deadline, "", types=types,
                         user=user, reserved=reserved, priority=call.priority, raw=raw)
        return PairsPrepared(req, work)

    async def whole(self, prep: PairsPrepared, call: Call) -> RerankResponse | ScoreResponse:
        res = await computed(self.front, prep.work, call)
        scores = array.array("f")
        scores.frombytes(res.vectors)
        if res.dim != 1 or len(scores) != len(prep.work.inputs):
            raise internal()
        usage = Usage(prompt_tokens=res.prompt_tokens, total_tokens=res.prompt_tokens)
        req = prep.req
        if isinstance(req, ScoreRequest):
            return ScoreResponse(id=f"score-{prep.work.request_id}", created=int(time.time()),
                                 model=req.model, usage=usage,
                                 data=[ScoreData(i, s) for i, s in enumerate(scores)])
        order = sorted(range(len(scores)), key=lambda i: (-scores[i], i))
        order = order[:req.top_n] if req.top_n is not None else order
        return RerankResponse(
            id=f"rerank-{prep.work.request_id}", model=req.model, usage=usage,
            results=[RerankResult(i, scores[i], RerankDocument(document_text(req.documents[i]))
                                  if req.return_documents else None) for i in order])

    async def chunks(self, prep: PairsPrepared, call: Call):
        raise bad_request(f"{self.name} is not streamed")
        yield []  # an async generator, as the pipeline protocol has it


def check_cross_encoder(entry: ModelEntry) -> None:
    name = entry.info.name
    if entry.info.kind != "encoder":
        raise bad_request(f"model '{name}' generates text; rerank and score need a "
                          f"cross-encoder (reranker)")  # fmt: skip
    if entry.task != "score":
        raise bad_request(f"model '{name}' is an embedding model; rerank and score need a "
                          f"cross-encoder (reranker)")  # fmt: skip
    if entry.labels != 1:
        raise bad_request(f"model '{name}' gives {entry.labels} scores per pair; rerank and "
                          f"score serve cross-encoders with one")  # fmt: skip


def _text(text: str, where: str) -> str:
    if not text:
        raise bad_request(f"{where} is an empty string")
    if "\x00" in text:
        raise bad_request(f"{where} contains a NUL character")
    return text


def rerank_pairs(req: RerankRequest) -> tuple[list[tuple[str, str]], str]:
    """(query, document) per document, and what an error calls one pair."""
    query = _text(req.query, "'query'")
    if not req.documents:
        raise bad_request("'documents' is empty: send at least one document")
    return [(query, _text(document_text(d), f"document {i}"))
            for i, d in enumerate(req.documents)], "document"


def document_text(d) -> str:
    return d if isinstance(d, str) else d.text


def score_pairs(req: ScoreRequest) -> tuple[list[tuple[str, str]], str]:
    """vLLM's pairing: one `text_1` against each `text_2`, else pair i with pair i."""
    one = [req.text_1] if isinstance(req.text_1, str) else req.text_1
    two = [req.text_2] if isinstance(req.text_2, str) else req.text_2
    if not one or not two:
        raise bad_request(f"'{'text_1' if not one else 'text_2'}' is empty: send a string or "
                          f"a non-empty list")  # fmt: skip
    if len(one) == 1:
        one = one * len(two)
    elif len(one) != len(two):
        raise bad_request(f"'text_1' has {len(one)} texts and 'text_2' {len(two)}: send one "
                          f"'text_1', or as many as 'text_2'")  # fmt: skip
    pairs = [(_text(a, f"text_1[{i}]"), _text(b, f"text_2[{i}]"))
             for i, (a, b) in enumerate(zip(one, two))]
    return pairs, "pair"


def tokenize_pairs(pairs: list[tuple[str, str]], entry: ModelEntry, each: str,
                   truncate: bool = False) -> tuple[list[list[int]], list[list[int]]]:
    """(ids, token types) per pair, special tokens included; a pair longer than the
    model takes is a 400 naming it (refused, not truncated: a cut document would be
    scored on text the client did not send), unless `truncate` asks to cut it to the
    limit, the longer text first (`Tokenizer.encode_pairs`)."""
    limit = entry.info.max_tokens
    ids, types = entry.tokenizer.encode_pairs(pairs, limit if truncate else None)
    for i, x in enumerate(ids):
        if len(x) > limit:
            raise bad_request(f"{each} {i} takes {len(x)} tokens as a pair; model "
                              f"'{entry.info.name}' accepts at most {limit}",
                              code="context_length_exceeded")  # fmt: skip
    return ids, types
