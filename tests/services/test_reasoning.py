"""The reasoning split (services/gateway/reasoning.py): whole replies cut at the think
tags as Qwen3's and DeepSeek-R1's parsers cut them, streamed pieces cut anywhere
(inside a tag too) joining to the same two texts with no piece holding part of a
tag, and when the split is on for a model."""

from __future__ import annotations

import msgspec
import pytest

from engine.chat import ChatTemplate
from services.gateway import reasoning
from services.gateway.reasoning import Plan, Splitter, split
from shared.api_replies import ChatDelta, ResponseMessage
from shared.config import EX_CONFIG, Config

TEXT = "<think>a b</think>answer"

# (reply, prompt leaves a think open, (reasoning, content))
WHOLE = [
    (TEXT, False, ("a b", "answer")),  # Qwen3: both tags in the reply
    (TEXT, True, ("a b", "answer")),  # DeepSeek-R1-0528: the start tag again
    ("a b</think>answer", True, ("a b", "answer")),  # DeepSeek-R1: the prompt opened it
    ("plain answer", False, (None, "plain answer")),  # no tags: all content
    ("\n\nplain", False, (None, "\n\nplain")),  # Qwen3, enable_thinking false
    ("<think>a b c", False, ("a b c", "")),  # cut by max_tokens inside the reasoning
    ("a b c", True, ("a b c", "")),  # the same, the prompt having opened it
    ("</think>answer", True, ("", "answer")),  # opened, closed at once
    ("<think></think>x", False, ("", "x")),
    ("x<think>a</think>y", False, (None, "x<think>a</think>y")),  # not where a reply begins
    ("<think>a</think>b</think>c<think>d", False, ("a", "b</think>c<think>d")),  # once
    ("a</think>b", False, (None, "a</think>b")),  # an end tag alone: no prompt opened it
    ("", False, (None, "")),
    ("", True, ("", "")),
    ("<thi", False, (None, "<thi")),  # ends where a tag might have begun: text after all
    ("<think>a</thi", False, ("a</thi", "")),
]


@pytest.mark.parametrize("text, opened, want", WHOLE)
def test_a_whole_reply_splits_at_its_tags(text, opened, want):
    assert split(text, opened) == want
    assert Plan(opened).split(text) == want


def streamed(pieces: list[str], opened: bool) -> list[tuple[str, str]]:
    s = Splitter(opened)
    return [s.feed(p, last=i == len(pieces) - 1) for i, p in enumerate(pieces)]


def joined(out: list[tuple[str, str]]) -> tuple[str, str]:
    return "".join(r for r, _ in out), "".join(c for _, c in out)


def cuts(text: str):
    """`text` as two pieces cut at every index, and as single characters."""
    for i in range(len(text) + 1):
        yield [text[:i], text[i:]]
    yield list(text)


@pytest.mark.parametrize("text, opened, want", WHOLE)
def test_streamed_pieces_join_to_the_whole_split_wherever_they_are_cut(text, opened, want):
    reasoning_text, content = want
    for pieces in cuts(text):
        assert joined(streamed(pieces, opened)) == (reasoning_text or "", content), pieces


@pytest.mark.parametrize("text, opened", [(TEXT, False), (TEXT, True),
                                          ("a b</think>answer", True)])
def test_no_streamed_piece_holds_part_of_a_tag(text, opened):
    for pieces in cuts(text):
        for r, c in streamed(pieces, opened):
            for piece in (r, c):
                assert not set(piece) & set("<>/"), (pieces, r, c)


def test_a_tag_cut_in_the_middle_is_held_until_it_is_whole():
    s = Splitter(False)
    assert s.feed("<th") == ("", "")
    assert s.feed("ink>a b</thi") == ("a b", "")
    assert s.feed("nk>ans") == ("", "ans")
    assert s.feed("wer", last=True) == ("", "wer")


def test_held_text_that_is_no_tag_after_all_goes_on_as_text():
    s = Splitter(False)
    assert s.feed("<think>a <") == ("a ", "")
    assert s.feed("b") == ("<b", "")
    assert s.feed("</", last=True) == ("</", "")  # the reply ended there


def test_the_prompt_tail_says_whether_a_think_is_open():
    assert reasoning.opens("<｜Assistant｜><think>\n")  # DeepSeek-R1's generation prompt
    assert not reasoning.opens("<|im_start|>assistant\n")  # Qwen3's, thinking
    assert not reasoning.opens("<|im_start|>assistant\n<think>\n\n</think>\n\n")  # not
    assert not reasoning.opens("")


# The generation prompt of Qwen3's template, as it ships (the rest elided).
QWEN3 = (
    "{% for message in messages %}<|im_start|>{{ message.role }}\n{{ message.content }}"
    "<|im_end|>\n{% endfor %}"
    "{%- if add_generation_prompt %}\n    {{- '<|im_start|>assistant\\n' }}\n"
    "    {%- if enable_thinking is defined and enable_thinking is false %}\n"
    "        {{- '<think>\\n\\n</think>\\n\\n' }}\n    {%- endif %}\n{%- endif %}\n")
# DeepSeek-R1's (updated): the prompt opens the think.
DEEPSEEK_R1 = ("{% for message in messages %}{{ message.content }}{% endfor %}"
               "{% if add_generation_prompt %}{{ '<｜Assistant｜><think>\\n' }}{% endif %}")


def test_enable_thinking_false_renders_a_closed_think_so_nothing_is_split():
    chat = [{"role": "user", "content": "hi"}]
    template = ChatTemplate(QWEN3)
    thinking = template.render(chat, extra={"enable_thinking": True})
    quiet = template.render(chat, extra={"enable_thinking": False})
    assert quiet.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert not reasoning.opens(thinking) and not reasoning.opens(quiet)
    # The reply of a prompt that closed the think has no tags: content, whole.
    assert Plan(reasoning.opens(quiet)).split("Hello.") == (None, "Hello.")
    assert reasoning.opens(ChatTemplate(DEEPSEEK_R1).render(chat))


def test_the_split_is_on_by_the_template_unless_the_setting_says_otherwise():
    assert reasoning.thinks(QWEN3) and reasoning.thinks(DEEPSEEK_R1)
    plain = "{% for m in messages %}{{ m.content }}{% endfor %}"
    assert not reasoning.thinks(plain)
    assert reasoning.on("auto", "qwen3", QWEN3) and not reasoning.on("auto", "smol", plain)
    assert not reasoning.on("none", "qwen3", QWEN3)
    assert reasoning.on("think", "smol", plain)
    setting = "none,smol=think"
    assert reasoning.on(setting, "smol", plain) and not reasoning.on(setting, "qwen3", QWEN3)
    assert reasoning.on("smol=none", "qwen3", QWEN3)  # no default given: auto
    with pytest.raises(ValueError, match="deepseek_r1"):
        reasoning.on("deepseek_r1", "qwen3", QWEN3)


@pytest.mark.parametrize("setting", ["maybe", "auto,smol=yes", "auto,=think", "auto,think"])
def test_a_bad_setting_stops_the_gateway_with_78(setting):
    with pytest.raises(SystemExit) as stop:
        reasoning.check_setting(Config.from_env({}, reasoning_parser=setting))
    assert stop.value.code == EX_CONFIG


def test_a_good_setting_passes():
    reasoning.check_setting(Config.from_env({}, reasoning_parser="none,qwen3=auto,smol=think"))
    assert Config().reasoning_parser == "auto"


def test_the_reply_holds_reasoning_content_only_when_there_was_some():
    assert msgspec.json.decode(msgspec.json.encode(ResponseMessage("assistant", "x"))) == \
        {"role": "assistant", "content": "x", "tool_calls": None}
    said = ResponseMessage("assistant", "x", reasoning_content="why")
    assert msgspec.json.decode(msgspec.json.encode(said))["reasoning_content"] == "why"
    assert msgspec.json.encode(ChatDelta(content="x")) == b'{"content":"x"}'
    assert msgspec.json.encode(ChatDelta(reasoning_content="y")) == b'{"reasoning_content":"y"}'
