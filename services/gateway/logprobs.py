"""Token logprobs, as workers send them (shared.messages.TokenLogprob: ids and
values), in OpenAI's reply shapes: chat's `logprobs.content` list, or the
completions' parallel lists. One renderer per request, so a streamed completion's
`text_offset` runs on across its chunks."""

from __future__ import annotations

from shared.api_replies import (
    ChatLogprobs,
    ChatTokenLogprob,
    CompletionLogprobs,
    PromptLogprob,
    TopLogprob,
)
from shared.messages import TokenLogprob


class Logprobs:
    """A request's TokenLogprobs in OpenAI's shapes: chat's `content` list, or the
    completions' parallel lists (`text_offset` counted on across a stream's chunks).
    Tokens are shown as their own decoded text, special tokens included."""

    FLOOR = -9999.0  # what -inf becomes (JSON has no infinities), as OpenAI shows it

    def __init__(self, tokenizer, choices: int, on: bool) -> None:
        self.on = on  # whether the request asked for logprobs
        self.tokenizer = tokenizer  # engine.tokenizer.Tokenizer
        self.offsets = [0] * choices
        self._texts: dict[int, str] = {}

    def _text(self, token: int) -> str:
        text = self._texts.get(token)
        if text is None:
            text = self._texts[token] = self.tokenizer.decode([token], skip_special_tokens=False)
        return text

    def _lp(self, value: float) -> float:
        return value if value > self.FLOOR else self.FLOOR  # NaN too

    def chat(self, entries: list[TokenLogprob]) -> ChatLogprobs | None:
        if not self.on:
            return None
        content = []
        for e in entries:
            text = self._text(e.token)
            top = [TopLogprob(t, self._lp(v), list(t.encode()))
                   for t, v in ((self._text(i), v) for i, v in e.top)]
            content.append(ChatTokenLogprob(text, self._lp(e.logprob), list(text.encode()), top))
        return ChatLogprobs(content)

    def prompt_maps(self, entries: list[TokenLogprob]) -> list[dict[int, PromptLogprob] | None]:
        """Chat's `prompt_logprobs`, vLLM's shape: the first prompt token's None, then
        per later token a map token id -> (logprob, rank, decoded text) of the token
        itself (its rank in the vocabulary) and its top alternatives (ranks 1, 2, ...),
        the token first (an alternative that is the token keeps its place)."""
        out: list[dict[int, PromptLogprob] | None] = [None]
        for e in entries:
            here = {e.token: PromptLogprob(self._lp(e.logprob), e.rank or None,
                                           self._text(e.token))}
            for rank, (i, v) in enumerate(e.top, 1):
                here[i] = PromptLogprob(self._lp(v), rank, self._text(i))
            out.append(here)
        return out

    def prompt(self, index: int, first: int, entries: list[TokenLogprob]) -> CompletionLogprobs | None:
        """An echoed prompt's logprobs: its first token (`first`) with none, then
        `entries` (each later token given those before it)."""
        if not self.on:
            return None
        text = self._text(first)
        head = CompletionLogprobs([text], [None], [None], [self.offsets[index]])
        self.offsets[index] += len(text)
        rest = self.completion(index, entries)
        assert rest is not None  # self.on
        return CompletionLogprobs(head.tokens + rest.tokens,
                                  head.token_logprobs + rest.token_logprobs,
                                  head.top_logprobs + rest.top_logprobs,
                                  head.text_offset + rest.text_offset)

    def completion(self, index: int, entries: list[TokenLogprob]) -> CompletionLogprobs | None:
        if not self.on:
            return None
        out = CompletionLogprobs([], [], [], [])
        for e in entries:
            text = self._text(e.token)
            out.tokens.append(text)
            out.token_logprobs.append(self._lp(e.logprob))
            top: dict[str, float] = {}
            for i, v in e.top:  # best first: two tokens with one text keep the better
                top.setdefault(self._text(i), self._lp(v))
            top.setdefault(text, self._lp(e.logprob))  # the sampled token is always listed
            out.top_logprobs.append(top)
            out.text_offset.append(self.offsets[index])
            self.offsets[index] += len(text)
        return out
