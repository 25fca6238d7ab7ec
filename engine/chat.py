"""Chat messages -> one prompt string, with the model's own chat template.

The template is Jinja, as written by the model's authors, so it runs in Jinja's
immutable sandbox (no attribute access to Python internals, no mutation of the
arguments). The environment mirrors the one Hugging Face renders with: trim_blocks,
lstrip_blocks, loop controls, a `tojson` filter, `raise_exception` and
`strftime_now`, and the variables messages, add_generation_prompt, bos_token,
eos_token (plus the other named special tokens).

Where it lives, most specific first: `chat_template.jinja`, `chat_template.json`,
the `chat_template` key of `tokenizer_config.json`; in a GGUF directory, the file's
`tokenizer.chat_template`. A model without one gets
`FALLBACK_TEMPLATE` ("role: content" lines, then "assistant:").
"""

from __future__ import annotations

import json
from datetime import datetime
from functools import lru_cache
from pathlib import Path
from typing import Any, Iterable

FALLBACK_TEMPLATE = (
    "{% for message in messages %}"
    "{{ message['role'] }}: {{ message['content'] }}\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)
_SPECIAL_KEYS = ("bos_token", "eos_token", "pad_token", "unk_token")


class TemplateError(ValueError):
    """The template refused the conversation (its own `raise_exception`) or is broken."""


def _raise(message: str):
    raise TemplateError(message)


def _tojson(value: Any, ensure_ascii: bool = False, indent=None, separators=None,
            sort_keys: bool = False) -> str:  # fmt: skip
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent,
                      separators=separators, sort_keys=sort_keys)  # fmt: skip


@lru_cache(maxsize=32)
def _compile(source: str):
    from jinja2.ext import loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env.from_string(source)


def _token_text(value: Any) -> str:
    if isinstance(value, dict):
        return str(value.get("content", ""))
    return "" if value is None else str(value)


def _message(m: Any) -> dict:
    """A dict or a Struct with role/content (shared.api.ChatMessage) -> plain dict."""
    get = m.get if isinstance(m, dict) else lambda k, d=None: getattr(m, k, d)
    out = {"role": get("role"), "content": get("content") or ""}
    for key in ("name", "tool_calls", "tool_call_id"):  # the last two: tool-aware templates
        if get(key):
            out[key] = get(key)
    return out


def _pick(value: Any) -> str | None:
    """`chat_template` is a string or a list of {"name", "template"}: take "default"."""
    if isinstance(value, str):
        return value
    if isinstance(value, list):
        named = {t.get("name"): t.get("template") for t in value if isinstance(t, dict)}
        return named.get("default") or next(iter(named.values()), None)
    return None


class ChatTemplate:
    def __init__(self, source: str | None = None, **special_tokens: str) -> None:
        self.source = source or FALLBACK_TEMPLATE
        self.is_fallback = source is None
        # Whether the template renders `tools` itself (else the caller describes them).
        self.knows_tools = "tools" in self.source
        self.special = {k: special_tokens.get(k, "") for k in _SPECIAL_KEYS}
        self.special.update(special_tokens)

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> "ChatTemplate":
        d = Path(model_dir)
        from shared.gguf import find_file

        gguf_file = find_file(d)
        if gguf_file is not None:
            return cls.from_gguf(gguf_file)
        cfg_path = d / "tokenizer_config.json"
        cfg = json.loads(cfg_path.read_text()) if cfg_path.exists() else {}
        source = None
        if (d / "chat_template.jinja").exists():
            source = (d / "chat_template.jinja").read_text()
        elif (d / "chat_template.json").exists():
            source = _pick(json.loads((d / "chat_template.json").read_text()).get("chat_template"))
        else:
            source = _pick(cfg.get("chat_template"))
        special = {k: _token_text(cfg.get(k)) for k in _SPECIAL_KEYS if k in cfg}
        return cls(source, **special)

    @classmethod
    def from_gguf(cls, path: str | Path) -> "ChatTemplate":
        """`tokenizer.chat_template` of a GGUF file, with its special tokens' text."""
        from engine.gguf import chat_template, special_tokens
        from shared.gguf import read_header

        header = read_header(path)
        return cls(chat_template(header), **special_tokens(header))

    def with_source(self, source: str) -> "ChatTemplate":
        """The same special tokens under another template (a request's own)."""
        return ChatTemplate(source, **self.special)

    def render(self, messages: Iterable[Any], add_generation_prompt: bool = True,
               tools: list[dict] | None = None, extra: dict[str, Any] | None = None) -> str:
        """`tools`: OpenAI's tool dicts, for a template that `knows_tools`; `extra`:
        more variables for the template (a request's chat_template_kwargs), never
        in place of the ones set here."""
        msgs = [_message(m) for m in messages]
        given = dict(messages=msgs, add_generation_prompt=add_generation_prompt,
                     tools=tools or None, **self.special)
        try:
            return _compile(self.source).render({**(extra or {}), **given})
        except TemplateError:
            raise
        except Exception as exc:  # jinja2 errors of a broken template
            raise TemplateError(f"chat template failed: {exc}") from exc

    def encode(self, tokenizer, messages: Iterable[Any],
               add_generation_prompt: bool = True, tools: list[dict] | None = None,
               extra: dict[str, Any] | None = None) -> list[int]:
        """Render and tokenize. A template that writes the BOS token itself must not
        get a second one from the tokenizer's post-processor."""
        text = self.render(messages, add_generation_prompt, tools, extra)
        bos = self.special.get("bos_token", "")
        return tokenizer.encode(text, add_special_tokens=not (bos and text.startswith(bos)))


def render_chat(messages: Iterable[Any], model_dir: str | Path | None = None,
                add_generation_prompt: bool = True) -> str:  # fmt: skip
    template = ChatTemplate.from_dir(model_dir) if model_dir else ChatTemplate()
    return template.render(messages, add_generation_prompt)
