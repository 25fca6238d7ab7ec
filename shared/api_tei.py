"""Text Embeddings Inference's request and response shapes (its `/embed` and
`/rerank` routes), served beside OpenAI's (services/gateway/tei.py).

TEI serves one model and its bodies name none; `model` is accepted here to pick one
where the gateway serves several. Unknown fields are a 400, as for every request.
"""

from __future__ import annotations

from typing import Annotated, Literal

import msgspec
from msgspec import Meta

from shared.api import MAX_LIST, Text, _Request

Name = Annotated[str, Meta(min_length=1, max_length=256)]
Direction = Literal["right", "Right"]  # TEI's default; "left" is not served


class TeiEmbedRequest(_Request, kw_only=True):
    inputs: Text | Annotated[list[Text], Meta(max_length=MAX_LIST * 4)]
    normalize: bool = True
    truncate: bool = False  # cut an over-long input at the model's limit (else a 413/400)
    truncation_direction: Direction = "right"
    prompt_name: Name | None = None
    dimensions: Annotated[int, Meta(ge=1)] | None = None
    model: Name | None = None


class TeiRerankRequest(_Request, kw_only=True):
    query: Text
    texts: Annotated[list[Text], Meta(max_length=MAX_LIST * 4)]
    raw_scores: bool = False
    return_text: bool = False
    truncate: bool = False
    truncation_direction: Direction = "right"
    model: Name | None = None


class TeiRank(msgspec.Struct, omit_defaults=True):
    index: int
    score: float
    text: str | None = None
