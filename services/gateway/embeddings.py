"""The embeddings endpoint: validate and tokenize at the edge, format the reply.

  1. prepare: decode the body, resolve an encoder model, refuse early (503 for a
     model not served, 429 when its queue or the work ahead is full), tokenize
     (`tokenized`). A large body, tokenized in a thread, is first admitted by a
     scheduler by its estimated size (`GatewayAdmission.reserve`) and submitted to
     that scheduler.
  2. whole: submit one EmbedWork (counted in the gateway's own tally of work out),
     wait for its EmbedResult (`computed`), check `dimensions` (a Matryoshka
     model's worker truncates; any other model answers at its full width or not at all).
  3. Render the vectors as float lists or base64 float32 (`encoding_format`).
"""

from __future__ import annotations

import array
import base64
from dataclasses import dataclass
from typing import TYPE_CHECKING, cast

from services.gateway import codec
from services.gateway.frontend import INLINE_TOKENIZE, Frontend, user_key
from services.gateway.models import ModelEntry, split_name
from services.gateway.split import computed_in_parts, cuts
from shared.api import Embedding, EmbeddingRequest, EmbeddingResponse, Usage
from shared.config import Config
from shared.errors import bad_request, internal, too_large
from shared.messages import EmbedResult, EmbedWork

if TYPE_CHECKING:
    from services.gateway.call import Call


@dataclass(slots=True)
class EmbedPrepared:
    req: EmbeddingRequest
    work: EmbedWork
    dim: int = 0  # the model's vector width, from its config (0: unknown)
    stream: bool = False  # embeddings are always answered whole


class Embeddings:
    """The embeddings pipeline (services.gateway.pipeline.Pipeline)."""

    name = "embeddings"

    def __init__(self, front: Frontend) -> None:
        self.front = front
        self.config = front.config

    async def prepare(self, body: bytes, call: Call) -> EmbedPrepared:
        front = self.front
        # Over HTTP a body larger than the bus is cut into parts; over NATS it came
        # in one message, bounded as any other.
        front.check_size(body, 0 if call.over_bus else self.config.max_body)
        req = codec.decode(body, EmbeddingRequest, call.msgpack)
        name, version = split_name(req.model)
        call.out.model = name
        user = user_key(req.user, call.user)
        entry, version = await front.models.choose(name, version, user)
        if entry.info.kind != "encoder":
            raise bad_request(f"model '{name}' generates text; use the completions endpoints")
        if entry.task == "score":
            raise bad_request(f"model '{name}' is a cross-encoder (reranker); use the rerank "
                              f"or score endpoints")  # fmt: skip
        truncated_width(req, entry)  # a width the model was not trained at: 400 before work
        limit = entry.info.max_tokens
        ids, _, reserved = await tokenized(
            front, call, entry, version, body, lambda: sizes(req, limit),
            lambda: (tokenize_inputs(req, entry, self.config), []), "inputs")
        call.out.prompt_tokens = sum(len(x) for x in ids)
        work = EmbedWork(call.wire, name, version, ids, call.deadline, "",
                         user=user, reserved=reserved,
                         dimensions=truncated_width(req, entry), priority=call.priority)
        prep = EmbedPrepared(req, work, truncated_width(req, entry) or entry.dim)
        if call.over_bus:
            check_answer_fits(prep, call.msgpack, front.bus_limit())
        return prep

    async def whole(self, prep: EmbedPrepared, call: Call) -> EmbeddingResponse:
        work, front = prep.work, self.front
        parts = cuts(work.inputs, prep.dim, front.bus_limit())
        if len(parts) == 1:
            res = await computed(front, work, call)
        else:  # larger than one bus message, one way or the other
            res = await computed_in_parts(front, work, parts, call, computed)
        check_dimensions(prep.req, res.dim)
        return build_response(prep.req, res)

    def chunks(self, prep: EmbedPrepared, call: Call):
        raise bad_request("embeddings are not streamed")


def sizes(req: EmbeddingRequest, limit: int) -> tuple[int, list[str], int]:
    """Before tokenizing: the request's inputs, its texts, and the tokens it sends as ids
    (at most `limit` an input: more is a 400 later, not work)."""
    inp = [req.input] if isinstance(req.input, str) else req.input
    texts = [x for x in inp if isinstance(x, str)]
    lists = [x for x in inp if isinstance(x, list)]
    if lists or texts:
        return max(len(inp), 1), texts, sum(min(len(x), limit) for x in lists)
    return 1, texts, min(len(inp), limit)  # one input of token ids


async def tokenized(front: Frontend, call: Call, entry: ModelEntry, version: str, body: bytes,
                    size, tokenize, what: str) -> tuple[list[list[int]], list[list[int]], str]:
    """An encoder request's (ids, token types, reservation), admitted before and
    around its tokenizing (the embeddings, rerank and score endpoints alike): 503 for
    a model not served, 429 when its queue or the work ahead is full. A body above
    INLINE_TOKENIZE is tokenized in a thread, behind others: `size()` (inputs, texts
    to learn from, tokens sent as ids) counts in its own check (refused now, not after
    the wait), a scheduler reserves its room first, and it counts here while it waits.
    `tokenize()` gives (ids, types); `what` names the inputs in a count refusal."""
    adm, name = front.admission, entry.info.name
    adm.check_served(name)
    # A batch request may wait (the scheduler's batch lane): bounded by count only.
    deadline = None if call.batch else call.deadline
    if len(body) <= INLINE_TOKENIZE:  # on the loop: nothing is read meanwhile
        adm.shed(name, deadline)
        return (*tokenize(), "")
    inputs, texts, id_tokens = size()
    check_count(inputs, front.config, what)  # the 400 comes first, as on the inline path
    tokens = id_tokens + adm.tokens.estimate(name, texts, entry.info.max_tokens)
    adm.shed(name, deadline, inputs, tokens)
    with adm.preparing(name, inputs, tokens):
        # admitted by the scheduler before the wait, so never refused after it (a
        # batch request reserves nothing: its lane admits it on arrival)
        reserved = "" if call.batch else await adm.reserve(call.wire, name, version, inputs,
                                                           tokens, call.deadline)
        try:
            ids, types = await front.tokenize(tokenize)
        except BaseException:
            if reserved:
                adm.unreserve(call.wire)
            raise
    if texts and not id_tokens:
        adm.tokens.learn(name, texts, sum(len(x) for x in ids))
    return ids, types, reserved


async def computed(front: Frontend, work: EmbedWork, call: Call) -> EmbedResult:
    """Submit one EmbedWork (counted in the gateway's own tally of work out) and wait
    for its EmbedResult."""
    out, tokens = call.out, sum(len(x) for x in work.inputs)
    with front.admission.sent(work.model, len(work.inputs), tokens):
        res = await front.call(work, call.deadline, out)
    if not isinstance(res, EmbedResult):
        raise internal()
    front.admission.computed(work.model, len(work.inputs), tokens)
    out.version, out.worker_id, out.timing = res.version, res.worker_id, res.timing
    return res


# Bytes one vector component takes in a reply, at most: a JSON float (shortest
# repr, comma), a msgpack float64, a base64 float32.
COMPONENT_BYTES = {"json": 13, "msgpack": 9, "base64": 6}


def check_answer_fits(prep: EmbedPrepared, msgpack: bool, limit: int) -> None:
    """A NATS request's answer is one bus message: refuse up front (413), before any
    work, one whose vectors cannot fit. HTTP requests have no such bound (their
    works are cut into parts that fit: services/gateway/split.py)."""
    fmt = "base64" if prep.req.encoding_format == "base64" else "msgpack" if msgpack else "json"
    size = len(prep.work.inputs) * prep.dim * COMPONENT_BYTES[fmt]
    if prep.dim and size > limit:
        raise too_large(
            f"the answer would take about {size} bytes ({len(prep.work.inputs)} vectors of "
            f"{prep.dim}) and one bus message carries at most {limit}: send fewer inputs, "
            f"ask for encoding_format base64, or use the HTTP API, which takes up to "
            f"TENSORBUS_MAX_BODY")


def check_count(inputs: int, config: Config, what: str = "inputs") -> None:
    if inputs > config.max_inputs:
        raise bad_request(f"too many {what}: {inputs}; at most {config.max_inputs} per request")


def tokenize_inputs(req: EmbeddingRequest, entry: ModelEntry, config: Config) -> list[list[int]]:
    """Token ids per input (special tokens included), or a 400 that names the input."""
    inp = req.input
    if isinstance(inp, str):
        inp = [inp]
    if not inp:
        raise bad_request("'input' is empty: send a string or a non-empty list")
    check_count(len(inp), config)
    kinds = {type(x) for x in inp}
    prompt = prompt_text(req, entry)
    if kinds == {str}:
        texts = cast("list[str]", inp)
        for i, s in enumerate(texts):
            if not s:
                raise bad_request(f"input {i} is an empty string")
            if "\x00" in s:
                raise bad_request(f"input {i} contains a NUL character")
        ids = entry.tokenizer.encode_batch([prompt + s for s in texts] if prompt else texts)
    elif kinds == {int}:
        ids = [_wrap(cast("list[int]", inp), entry, 0)]
    elif kinds == {list}:
        ids = [_wrap(cast("list[int]", x), entry, i) for i, x in enumerate(inp)]
    else:
        raise bad_request("'input' mixes strings, token ids and token-id lists; use one kind")
    limit = entry.info.max_tokens
    keep = req.truncate_prompt_tokens
    if keep is not None:
        ids = truncate(ids, keep, entry)
    for i, x in enumerate(ids):
        if len(x) > limit:
            raise bad_request(
                f"input {i} has {len(x)} tokens; model '{entry.info.name}' accepts at most {limit}",
                code="context_length_exceeded")
    return ids


def _wrap(tokens: list[int], entry: ModelEntry, i: int) -> list[int]:
    if not tokens:
        raise bad_request(f"input {i} is an empty token list")
    vocab = entry.tokenizer.vocab_size
    bad = next((t for t in tokens if t >= vocab), None)
    if bad is not None:
        raise bad_request(f"input {i} has token id {bad}; the vocabulary has {vocab} tokens")
    return entry.prefix + list(tokens) + entry.suffix


# input_type -> the prompt names models use for that role, first match wins.
ROLE_PROMPTS = {"query": ("query", "search_query", "retrieval.query"),
                "document": ("document", "passage", "search_document", "corpus",
                             "retrieval.passage")}


def prompt_text(req: EmbeddingRequest, entry: ModelEntry) -> str:
    """The text prepended to each text input: the prompt the request names (by name or
    role), else the model's default prompt, else none. A prompt the model does not
    have is a 400 listing those it has; token-id inputs take no prompt."""
    name, role, prompts = req.prompt_name, req.input_type, entry.prompts
    if name is not None and role is not None:
        raise bad_request("send 'prompt_name' or 'input_type', not both")
    if role is not None:
        if not prompts:  # a model without prompts embeds every role the same way
            return ""
        name = next((n for n in ROLE_PROMPTS[role] if n in prompts), None)
        if name is None:
            raise bad_request(f"model '{entry.info.name}' has no prompt for input_type "
                              f"'{role}' (its prompts: {', '.join(sorted(prompts))}); "
                              f"name one with 'prompt_name'")
    if name is None:
        name = entry.default_prompt
        return prompts.get(name, "") if name is not None else ""
    if name not in prompts:
        known = ", ".join(sorted(prompts)) or "none"
        raise bad_request(f"model '{entry.info.name}' has no prompt named '{name}' "
                          f"(its prompts: {known})")
    return prompts[name]


def truncate(ids: list[list[int]], keep: int, entry: ModelEntry) -> list[list[int]]:
    """`truncate_prompt_tokens`: each input cut to its first `keep` tokens (-1: the
    model's limit), its closing special tokens kept, as sentence-transformers
    truncates. 0, or fewer than the special tokens, or more than the limit: a 400."""
    limit, ends = entry.info.max_tokens, len(entry.prefix) + len(entry.suffix)
    keep = limit if keep == -1 else keep
    if keep > limit:
        raise bad_request(f"'truncate_prompt_tokens' is {keep}; model '{entry.info.name}' "
                          f"accepts at most {limit} tokens an input")
    if keep <= ends:
        raise bad_request(f"'truncate_prompt_tokens' must leave room for the model's {ends} "
                          f"special tokens: -1, or more than {ends}")
    tail = len(entry.suffix)
    return [x if len(x) <= keep else x[:keep - tail] + x[len(x) - tail:] for x in ids]


def truncated_width(req: EmbeddingRequest, entry: ModelEntry) -> int:
    """The width a Matryoshka model's worker cuts its vectors to (0: full). A width
    the model declares it was not trained at is a 400; any other model's width is
    checked against its answer (`check_dimensions`)."""
    want, info = req.dimensions, entry.info
    if want is None or not info.truncatable:
        return 0
    if info.dimensions and want not in info.dimensions and want != max(info.dimensions):
        sizes = ", ".join(str(d) for d in info.dimensions)
        raise bad_request(f"'dimensions' {want} is not one model '{info.name}' was trained "
                          f"at: {sizes}")
    return want


def check_dimensions(req: EmbeddingRequest, dim: int) -> None:
    if req.dimensions is not None and req.dimensions != dim:
        raise bad_request(f"'dimensions' must be {dim} for this model (it does not declare "
                          f"Matryoshka widths: no matryoshka_dimensions in its config)")


def build_response(req: EmbeddingRequest, res: EmbedResult) -> EmbeddingResponse:
    flat = array.array("f")
    flat.frombytes(res.vectors)
    dim = res.dim
    n = len(flat) // dim if dim else 0
    data = []
    for i in range(n):
        row = flat[i * dim:(i + 1) * dim]
        vec = base64.b64encode(row.tobytes()).decode() if req.encoding_format == "base64" else row.tolist()
        data.append(Embedding(index=i, embedding=vec))
    model = req.model
    return EmbeddingResponse(data=data, model=model,
                             usage=Usage(prompt_tokens=res.prompt_tokens, total_tokens=res.prompt_tokens))
