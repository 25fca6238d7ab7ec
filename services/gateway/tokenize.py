"""Tokenize and detokenize with a model's own tokenizer (vLLM's endpoints).

  1. Decode the request and resolve the model (404 for an unknown one); no worker
     is involved: the gateway holds every served model's tokenizer.
  2. Tokenize: `prompt` with the tokenizer (its special tokens unless
     `add_special_tokens` is false), or `messages` rendered with the model's chat
     template first, exactly as a chat completion would render them. Detokenize:
     the ids' text, special tokens skipped as in generated text.
  3. The reply is whole: `{"tokens", "count", "max_model_len"}` or `{"prompt"}`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, AsyncIterator

from services.gateway import codec
from services.gateway.frontend import INLINE_TOKENIZE
from services.gateway.chat_prompt import chat_prompt
from services.gateway.models import ModelEntry, split_name
from shared.api_models import DetokenizeRequest, DetokenizeResponse, TokenizeRequest, TokenizeResponse
from shared.errors import bad_request

if TYPE_CHECKING:
    from services.gateway.call import Call


@dataclass
class Prepared:
    reply: TokenizeResponse | DetokenizeResponse
    stream: bool = False


class Tokenize:
    """The tokenize pipeline, or with `inverse` the detokenize one
    (services.gateway.pipeline.Pipeline)."""

    def __init__(self, front, inverse: bool = False) -> None:
        self.front = front
        self.inverse = inverse
        self.name = "detokenize" if inverse else "tokenize"
        self._request_type = DetokenizeRequest if inverse else TokenizeRequest

    async def prepare(self, body: bytes, call: Call) -> Prepared:
        self.front.check_size(body)
        req = codec.decode(body, self._request_type, call.msgpack)
        name, version = split_name(req.model)
        call.out.model = name
        entry, _ = await self.front.models.choose(name, version, call.user)
        run = self._detokenize if self.inverse else self._tokenize
        if len(body) <= INLINE_TOKENIZE:
            return Prepared(run(req, entry))
        return Prepared(await self.front.tokenize(run, req, entry))

    def _tokenize(self, req: TokenizeRequest, entry: ModelEntry) -> TokenizeResponse:
        if (req.prompt is None) == (req.messages is None):
            raise bad_request("send one of 'prompt' and 'messages'")
        if req.messages is not None:
            ids = chat_prompt(req.messages, entry, req.add_generation_prompt)
        else:
            assert req.prompt is not None  # one of the two
            ids = entry.tokenizer.encode(req.prompt, add_special_tokens=req.add_special_tokens)
        limit = entry.info.max_tokens
        if entry.info.kind == "decoder":
            limit = min(limit, self.front.config.max_context)  # as completions count it
        return TokenizeResponse(ids, len(ids), limit)

    @staticmethod
    def _detokenize(req: DetokenizeRequest, entry: ModelEntry) -> DetokenizeResponse:
        vocab = entry.tokenizer.vocab_size
        bad = next((t for t in req.tokens if t >= vocab), None)
        if bad is not None:
            raise bad_request(f"token id {bad} is outside the vocabulary of {vocab} tokens")
        return DetokenizeResponse(entry.tokenizer.decode(req.tokens))

    async def whole(self, prep: Prepared, call: Call):
        return prep.reply

    async def chunks(self, prep: Prepared, call: Call) -> AsyncIterator[list[object]]:
        raise bad_request(f"{self.name} does not stream")
        yield []  # an async generator, as the pipeline protocol has it
