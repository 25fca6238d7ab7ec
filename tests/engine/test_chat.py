"""Chat templates render as transformers' `apply_chat_template` renders them."""

from __future__ import annotations

import json
import os
import shutil

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest

from engine.chat import FALLBACK_TEMPLATE, ChatTemplate, TemplateError, render_chat
from shared.api import ChatMessage
from shared.catalog import DEMO_LM, bundled_dir

MESSAGES = [
    {"role": "system", "content": "You answer briefly."},
    {"role": "user", "content": "What is a list?"},
    {"role": "assistant", "content": "A mutable sequence."},
    {"role": "user", "content": "And a tuple? «ünïcode»"},
]
# Llama-3 style: BOS written by the template, loop controls, raise_exception.
LLAMA3_STYLE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{% if message['role'] == 'tool' %}{{ raise_exception('no tools here') }}{% endif %}"
    "{% if loop.index0 > 99 %}{% break %}{% endif %}"
    "<|start_header_id|>{{ message['role'] }}<|end_header_id|>\n\n"
    "{{ message['content'] | trim }}<|eot_id|>"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}"
)


def _hf_render(model_dir, messages) -> str:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(model_dir))
    return tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)


def test_demo_template_matches_transformers():
    d = bundled_dir(DEMO_LM)
    ours = ChatTemplate.from_dir(d).render(MESSAGES)
    assert ours == _hf_render(d, MESSAGES)
    assert ours.endswith("<|assistant|>\n")


@pytest.fixture
def llama3_dir(tmp_path):
    shutil.copy(bundled_dir(DEMO_LM) / "tokenizer.json", tmp_path / "tokenizer.json")
    cfg = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<|endoftext|>",
           "eos_token": "<|endoftext|>", "chat_template": LLAMA3_STYLE}  # fmt: skip
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(cfg))
    return tmp_path


def test_bos_writing_template_matches_transformers(llama3_dir):
    template = ChatTemplate.from_dir(llama3_dir)
    ours = template.render(MESSAGES)
    assert ours == _hf_render(llama3_dir, MESSAGES)
    assert ours.startswith("<|endoftext|><|start_header_id|>system")


def test_template_raise_exception_is_a_template_error(llama3_dir):
    with pytest.raises(TemplateError, match="no tools here"):
        ChatTemplate.from_dir(llama3_dir).render([{"role": "tool", "content": "x"}])


def test_sandbox_refuses_python_internals():
    evil = "{{ messages.__class__.__mro__[1].__subclasses__() }}"
    with pytest.raises(TemplateError):
        ChatTemplate(evil).render(MESSAGES)


def test_fallback_template_and_struct_messages(tmp_path):
    (tmp_path / "tokenizer_config.json").write_text("{}")
    template = ChatTemplate.from_dir(tmp_path)
    assert template.is_fallback and template.source == FALLBACK_TEMPLATE
    msgs = [ChatMessage(role="system", content="Be kind."), ChatMessage(role="user", content="Hi")]
    assert template.render(msgs) == "system: Be kind.\nuser: Hi\nassistant:"
    assert render_chat(msgs, add_generation_prompt=False) == "system: Be kind.\nuser: Hi\n"
