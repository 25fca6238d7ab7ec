"""A chat request's prompt: its messages rendered with the model's chat template (or
the request's own, with the model's special tokens), its tools and extra template
variables, then tokenized. Used by the chat pipeline (services.gateway.generation)
and `/tokenize` (services.gateway.tokenize)."""

from __future__ import annotations

import functools

from services.gateway import tools
from services.gateway.models import ModelEntry
from shared.api import ChatCompletionRequest
from shared.errors import bad_request


@functools.lru_cache(maxsize=64)
def chat_template(model_dir: str):
    """The model's engine.chat.ChatTemplate, read once per directory."""
    from engine.chat import ChatTemplate

    return ChatTemplate.from_dir(model_dir)


def chat_prompt_of(req: ChatCompletionRequest, entry: ModelEntry, tp=None) -> list[int]:
    return chat_prompt(req.messages, entry, req.add_generation_prompt, tp, req.chat_template,
                       req.chat_template_kwargs)


def chat_prompt(messages: list, entry: ModelEntry, add_generation_prompt: bool = True,
                tp: tools.ToolPlan | None = None, source: str | None = None,
                extra: dict | None = None) -> list[int]:
    """Chat messages (shared.api.ChatMessage) rendered with the model's chat template,
    or the request's own `source` (with the model's special tokens), with the
    request's tools (services.gateway.tools) and extra variables, and tokenized; a
    template that refuses them is a 400."""
    contents = [_content(m.content) for m in messages]
    try:
        template = chat_template(entry.info.path)
        if source is not None:
            template = template.with_source(source)
        plain = tools.template_messages(messages, contents, tp, template.knows_tools)
        given = tp.dicts() if tp is not None and template.knows_tools else None
        return template.encode(entry.tokenizer, plain, add_generation_prompt, given, extra)
    except ValueError as exc:
        raise bad_request(f"cannot render the chat: {exc}") from None


def _content(content: str | list | None) -> str:
    """A message's text: a string, or its text parts joined by newlines (as vLLM
    joins them); any other part type is a 400 that names it."""
    if not isinstance(content, list):
        return content or ""
    for part in content:
        if part.type != "text":
            raise bad_request(f"message content part type '{part.type}' is not supported; "
                              f"only 'text' parts are")
        if part.text is None:
            raise bad_request("a message content part of type 'text' needs 'text'")
    return "\n".join(part.text for part in content)
