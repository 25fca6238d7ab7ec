"""The completions endpoint's prompt-side answers, each choice's text and logprobs
put behind the prompt's:

- `echo`: each choice's text begins with the prompt, and with `logprobs` its
  logprobs begin with the prompt's tokens (the first has none: it has nothing before
  it), as OpenAI's legacy completions and vLLM answer. This is what evaluation
  harnesses (lm-evaluation-harness's `local-completions`) ask to score a
  continuation: `echo`, `logprobs`, and a prompt holding context plus continuation.
- `prompt_logprobs` (vLLM's): each choice carries the prompt's tokens scored in
  vLLM's shape, the one chat's top-level `prompt_logprobs` has
  (services.gateway.logprobs.Logprobs.prompt_maps): None for the first token, then
  per token a map token id -> {logprob, rank, decoded_token}.

The worker computes the prompt's logprobs on the device before it generates
(engine/decoder/scoring.py), once, with as many alternatives as the larger of the
two asks for, and sends them on each choice's first chunk
(`GenChunk.prompt_logprobs`); this module cuts each answer's alternatives to its own
count and puts it in front, whole or streamed (the first chunk of each choice
carries it).
"""

from __future__ import annotations

import msgspec

from shared.api import CompletionRequest
from shared.api_replies import CompletionLogprobs, PromptLogprobs
from shared.messages import GenChunk, TokenLogprob


def prompt_top(req: CompletionRequest) -> int:
    """Alternatives per prompt token the worker computes for `req` (the larger of
    what `echo` with `logprobs` and `prompt_logprobs` ask for); -1: none."""
    echoed = req.logprobs if req.echo and req.logprobs is not None else -1
    return max(echoed, req.prompt_logprobs if req.prompt_logprobs is not None else -1)


class Echo:
    """One completions request's prompt-side answers: its prompt text (echo), its
    prompt logprobs' counts, and which choices have had them already (a stream's
    first chunk of each choice carries them)."""

    def __init__(self, req: CompletionRequest | None, prompt: list[int], tokenizer) -> None:
        self.on = req is not None and req.echo
        self.top = req.logprobs if req is not None and req.logprobs is not None else 0
        self.scored = (req.prompt_logprobs if req is not None and req.prompt_logprobs is not None
                       else -1)  # vLLM's prompt_logprobs: its alternatives (-1: not asked)
        self.prompt = prompt
        self.text = _prompt_text(req, prompt, tokenizer) if self.on and req is not None else ""
        self._given: set[int] = set()

    def first(self, ev: GenChunk) -> bool:
        """Whether `ev` is the first chunk of its choice that the prompt's answers go
        in front of (False when the request asks for none)."""
        if (not self.on and self.scored < 0) or ev.index in self._given:
            return False
        self._given.add(ev.index)
        return True

    def logprobs(self, render, index: int,
                 entries: list[TokenLogprob]) -> CompletionLogprobs | None:
        """The echoed prompt's logprobs, rendered ahead of the choice's own (`render`:
        the request's services.gateway.logprobs.Logprobs); None without `echo`."""
        if not self.on:
            return None
        return render.prompt(index, self.prompt[0], _cut(entries, self.top))

    def maps(self, render, entries: list[TokenLogprob]) -> PromptLogprobs | msgspec.UnsetType:
        """The choice's `prompt_logprobs` (vLLM's shape); UNSET (left out) unless asked."""
        if self.scored < 0:
            return msgspec.UNSET
        return render.prompt_maps(_cut(entries, self.scored))


def joined(head: CompletionLogprobs | None, tail: CompletionLogprobs | None):
    """Two runs of completions logprobs, one after the other."""
    if head is None or tail is None:
        return head or tail
    return CompletionLogprobs(head.tokens + tail.tokens,
                              head.token_logprobs + tail.token_logprobs,
                              head.top_logprobs + tail.top_logprobs,
                              head.text_offset + tail.text_offset)


def _cut(entries: list[TokenLogprob], top: int) -> list[TokenLogprob]:
    """`entries` with at most `top` alternatives each (they come best first)."""
    return [e if len(e.top) <= top else TokenLogprob(e.token, e.logprob, e.top[:top], e.rank)
            for e in entries]


def _prompt_text(req: CompletionRequest, prompt: list[int], tokenizer) -> str:
    """The prompt as the client sent it; token ids decoded, special tokens kept."""
    p = req.prompt
    if isinstance(p, str):
        return p
    if isinstance(p, list) and len(p) == 1 and isinstance(p[0], str):
        return p[0]
    return tokenizer.decode(prompt, skip_special_tokens=False)
