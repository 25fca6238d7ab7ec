"""Reasoning models: the thinking of a chat reply split out as `reasoning_content`.

A thinking model (Qwen3, QwQ, DeepSeek-R1) writes its reasoning between a start and
an end tag, `<think>` and `</think>`, and then its answer. vLLM's reasoning parsers
(`--reasoning-parser qwen3|deepseek_r1`) return the two apart: the message's
`reasoning_content` and its `content`; streamed, deltas carry `reasoning_content`
while the reply is inside the tags and `content` after. This module does the same.

Which side of the tags a reply starts on is read from the prompt, not guessed from
the reply, because a stream cannot wait for its end to decide:

  - The prompt leaves a think open (DeepSeek-R1's, QwQ's and Qwen3-Thinking's
    templates end the generation prompt with `<think>\\n`; `opens`): the reply starts
    inside the reasoning. Everything before the first end tag is reasoning (a start
    tag at the reply's very beginning is dropped, as DeepSeek-R1-0528 writes one
    again), the rest is content; no end tag (cut by `max_tokens`): all reasoning.
  - Otherwise (Qwen3's template; with `enable_thinking: false` its prompt ends with
    an empty think already closed): a reply that begins with the start tag reasons
    up to the first end tag (none: to its end), the rest is content. Any other reply
    is content, whole, tags and all.

After the end tag nothing is split again. The split only removes the tags that
mark it: reasoning and content are the reply's text in order. A request whose
grammar shapes the reply (`response_format`, vLLM's `guided_*`, `tools`) is read as
one whose prompt leaves no think open: its grammar constrains the reply from the
first token, so the reply reasons only where the grammar writes the start tag first.

On or off per model (`mode`, TENSORBUS_REASONING_PARSER, `VALUE[,MODEL=VALUE...]`):
`auto` (on when the model's chat template knows the tags: `thinks`), `none`,
`think` (on, whatever the template).
"""

from __future__ import annotations

from dataclasses import dataclass

from shared.config import Config, bad_config, parse_per_model, per_model

START, END = "<think>", "</think>"
MODES = ("auto", "none", "think")
# Prompt tokens read back to see whether the prompt leaves a think open: the
# generation prompt's last few (`<think>\n`, or `<think>\n\n</think>\n\n`).
PROMPT_TAIL = 32


def mode(setting: str, model: str) -> str:
    """`model`'s value of TENSORBUS_REASONING_PARSER; ValueError when it is none of MODES."""
    value = per_model(setting, model) or "auto"
    if value not in MODES:
        raise ValueError(f"TENSORBUS_REASONING_PARSER={setting!r}: {value!r} (for "
                         f"{model or 'every other model'}) is not one of {', '.join(MODES)}")
    return value


def check_setting(config: Config) -> None:
    """Exit 78 at start when the setting is malformed, not at a request."""
    try:
        _, per = parse_per_model(config.reasoning_parser)
        for model in ("", *per):
            mode(config.reasoning_parser, model)
    except ValueError as exc:
        raise bad_config(str(exc)) from None


def thinks(template: str) -> bool:
    """A chat template that writes or strips think tags belongs to a thinking model
    (Qwen3's and QwQ's hold both; DeepSeek-R1's first templates only the end tag)."""
    return START in template or END in template


def on(setting: str, model: str, template: str) -> bool:
    """Whether `model`'s chat replies are split (its template's source: `template`)."""
    value = mode(setting, model)
    return value == "think" or (value == "auto" and thinks(template))


def opens(prompt_tail: str) -> bool:
    """Whether a prompt ending in `prompt_tail` leaves a think open for the reply."""
    return prompt_tail.rfind(START) > prompt_tail.rfind(END)


def split(text: str, opened: bool) -> tuple[str | None, str]:
    """A whole reply -> (reasoning, content); reasoning None: the reply did not reason."""
    if text.startswith(START):
        text = text[len(START):]
    elif not opened:
        return None, text
    reasoning, _, content = text.partition(END)
    return reasoning, content


@dataclass(frozen=True)
class Plan:
    """A chat request's split: `opened`, whether its reply starts inside the reasoning."""

    opened: bool

    def split(self, text: str) -> tuple[str | None, str]:
        return split(text, self.opened)

    def streams(self, n: int) -> list["Splitter"]:
        return [Splitter(self.opened) for _ in range(n)]


_HEAD, _REASONING, _CONTENT = "head", "reasoning", "content"


class Splitter:
    """One streamed choice's text pieces -> (reasoning, content) pieces, as `split`
    cuts the whole. Text that may be the start of a tag ("</thi" before "nk>") is
    held until the next piece says what it is, so no piece ever carries part of a
    tag; the last piece (`last`) lets out what was held: text after all."""

    def __init__(self, opened: bool) -> None:
        self.opened = opened
        self.state = _HEAD  # before the reply's first characters say whether it thinks
        self.held = ""

    def feed(self, text: str, last: bool = False) -> tuple[str, str]:
        reasoning: list[str] = []
        content: list[str] = []
        buf, self.held = self.held + text, ""
        while buf:
            if self.state == _HEAD:
                if buf.startswith(START):
                    buf, self.state = buf[len(START):], _REASONING
                elif START.startswith(buf) and not last:
                    self.held = buf  # the start tag, perhaps: not all here yet
                    break
                else:
                    self.state = _REASONING if self.opened else _CONTENT
            elif self.state == _REASONING:
                at = buf.find(END)
                if at >= 0:
                    reasoning.append(buf[:at])
                    buf, self.state = buf[at + len(END):], _CONTENT
                    continue
                keep = 0 if last else _tag_head(buf, END)
                reasoning.append(buf[:len(buf) - keep])
                self.held = buf[len(buf) - keep:]
                break
            else:
                content.append(buf)
                break
        return "".join(reasoning), "".join(content)


def _tag_head(text: str, tag: str) -> int:
    """The length of the longest end of `text` that begins `tag` (and is not all of it)."""
    for n in range(min(len(text), len(tag) - 1), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0
