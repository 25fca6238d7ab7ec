"""`echo` on the completions endpoint: each choice's text begins with the prompt, and
with `logprobs` its logprobs begin with the prompt's tokens (the first has none: it
has nothing before it), as OpenAI's legacy completions and vLLM answer. This is what
evaluation harnesses (lm-evaluation-harness's `local-completions`) ask to score a
continuation: `echo`, `logprobs`, and a prompt holding context plus continuation.

The worker computes the prompt's logprobs on the device before it generates
(engine/decoder/scoring.py) and sends them on each choice's first chunk
(`GenChunk.prompt_logprobs`); this module puts the prompt in front, whole or
streamed (the first chunk of each choice carries it).
"""

from __future__ import annotations

from shared.api import CompletionRequest
from shared.api_replies import CompletionLogprobs
from shared.messages import GenChunk


class Echo:
    """One completions request's echo: its prompt text, and which choices have had
    it already (a stream's first chunk of each choice carries it)."""

    def __init__(self, req: CompletionRequest | None, prompt: list[int], tokenizer) -> None:
        self.on = req is not None and req.echo
        self.prompt = prompt
        self.text = _prompt_text(req, prompt, tokenizer) if self.on and req is not None else ""
        self._given: set[int] = set()

    def first(self, ev: GenChunk) -> bool:
        """Whether `ev` is the first chunk of its choice (the echo goes in front)."""
        if not self.on or ev.index in self._given:
            return False
        self._given.add(ev.index)
        return True

    def logprobs(self, render, index: int, chunk: GenChunk) -> CompletionLogprobs | None:
        """The prompt's logprobs, rendered ahead of the choice's own (`render`: the
        request's services.gateway.logprobs.Logprobs)."""
        return render.prompt(index, self.prompt[0], chunk.prompt_logprobs)


def joined(head: CompletionLogprobs | None, tail: CompletionLogprobs | None):
    """Two runs of completions logprobs, one after the other."""
    if head is None or tail is None:
        return head or tail
    return CompletionLogprobs(head.tokens + tail.tokens,
                              head.token_logprobs + tail.token_logprobs,
                              head.top_logprobs + tail.top_logprobs,
                              head.text_offset + tail.text_offset)


def _prompt_text(req: CompletionRequest, prompt: list[int], tokenizer) -> str:
    """The prompt as the client sent it; token ids decoded, special tokens kept."""
    p = req.prompt
    if isinstance(p, str):
        return p
    if isinstance(p, list) and len(p) == 1 and isinstance(p[0], str):
        return p[0]
    return tokenizer.decode(prompt, skip_special_tokens=False)
