"""Gateways read a registry version's tokenizer files, never its weights, per version.

A real nats-server and the real registry. Two tiny GPT-2 versions differ in their
tokenizer (a trained BPE against a bytes-only one) and chat template; transformers'
own tokenizer loaded from each version's directory is the reference for the counts.
Which objects the gateway's registry handle reads is recorded at its object store.
"""

from __future__ import annotations

import json
from datetime import datetime, timezone
from pathlib import Path

import msgspec
import pytest

from services.gateway.codec import VERSION_HEADER
from services.registry.errors import RegistryError
from services.registry.store import tokenizer_files
from shared import subjects
from shared.errors import HEADER_CODE
from shared.registry import FileEntry, ModelVersion
from tests.support.stack import running_stack, wait_until
from tests.support.swap import DEC_CONTEXT, Decoders, hb, model_name

TEXT = "the quick brown fox jumps over the lazy dog"
CHAT = [{"role": "user", "content": "a stream of tokens"}]


def _version_dir(root: Path, seed: int, bytes_only: bool, template: str) -> Path:
    """A tiny GPT-2; `bytes_only` swaps its trained BPE for one with no merges."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    from tests.support.tiny_models import build

    d = root / f"v{seed}"
    build("gpt2", d, positions=DEC_CONTEXT, seed=seed)
    if bytes_only:
        tok = Tokenizer(models.BPE())
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        tok.train_from_iterator(["x"], trainers.BpeTrainer(
            vocab_size=257, special_tokens=["<|endoftext|>"], show_progress=False,
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
        tok.save(str(d / "tokenizer.json"))
    cfg = json.loads((d / "tokenizer_config.json").read_text())
    cfg["chat_template"] = template
    (d / "tokenizer_config.json").write_text(json.dumps(cfg))
    return d


def _reference(d: Path) -> tuple[int, int]:
    """(prompt tokens of TEXT, of CHAT rendered) by transformers' tokenizer of `d`."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(d))
    chat = tok.apply_chat_template(CHAT, tokenize=True, add_generation_prompt=True)
    chat = chat["input_ids"] if isinstance(chat, dict) or hasattr(chat, "keys") else chat
    return len(tok(TEXT)["input_ids"]), len(chat)


def _spy_objects(st) -> list[str]:
    """Names of every object the gateway's registry handle reads from now on."""
    reg = st.gateway.front.models.resolver.registry
    names: list[str] = []
    real = reg._obj.get

    async def get(name, *args, **kwargs):
        names.append(name)
        return await real(name, *args, **kwargs)

    reg._obj.get = get
    return names


async def _ask(nc, subject: str, body: dict) -> tuple[dict, str]:
    msg = await nc.request(subject, msgspec.json.encode(body), timeout=60)
    headers = msg.headers or {}
    assert int(headers.get(HEADER_CODE, 200)) == 200, msg.data
    return msgspec.json.decode(msg.data), headers.get(VERSION_HEADER, "")


async def _counts(nc, model: str, user: str = "") -> tuple[int, int, str]:
    """(prompt tokens of a completion of TEXT, the version that ran it, tokens of
    CHAT by /v1/tokenize)."""
    body = {"model": model, "prompt": TEXT, "max_tokens": 1} | ({"user": user} if user else {})
    done, version = await _ask(nc, subjects.COMPLETIONS, body)
    chat, _ = await _ask(nc, subjects.TOKENIZE, {"model": model, "messages": CHAT})
    return done["usage"]["prompt_tokens"], chat["count"], version


def test_a_gguf_record_from_before_headers_is_refused_with_the_reason():
    mv = ModelVersion(name="m", version="1", kind="decoder", format="gguf",
                      files=[FileEntry("m.gguf", 10, "0" * 64)],
                      created_at=datetime.now(timezone.utc))
    with pytest.raises(RegistryError, match="import the file again"):
        tokenizer_files(mv)
    old_dir = msgspec.structs.replace(mv, format="safetensors", files=[
        FileEntry("model.safetensors", 10, "0" * 64), FileEntry("tokenizer.json", 5, "1" * 64)])
    assert [e.path for e in tokenizer_files(old_dir)] == ["tokenizer.json"]


async def test_the_gateway_reads_tokenizer_objects_never_weights(nats_server, tmp_path,
                                                                 smollm2_file):
    from engine.tokenizer import Tokenizer

    name, gname = model_name(), model_name()
    d = _version_dir(tmp_path, 1, False, "{% for m in messages %}{{ m['content'] }}{% endfor %}")
    async with running_stack(nats_server.url, registry=True) as st:
        mv = await st.registry.push(d, name, version="1", progress=False)
        gv = await st.registry.import_gguf(smollm2_file, gname, version="1", progress=False)
        await st.registry.promote(name, "1")
        await st.registry.promote(gname, "1")
        fetched = _spy_objects(st)
        got, _ = await _ask(st.client, subjects.TOKENIZE, {"model": name, "prompt": TEXT})
        assert got["count"] == _reference(d)[0]
        assert sorted(fetched) == sorted(f"{name}/1/{e.path}" for e in mv.tokenizer)
        assert not any(n.endswith(".safetensors") for n in fetched)
        assert {e.path for e in mv.tokenizer} >= {"tokenizer.json", "tokenizer_config.json",
                                                   "config.json"}
        fetched.clear()
        got, _ = await _ask(st.client, subjects.TOKENIZE, {"model": gname, "prompt": TEXT})
        # Only the header: metadata (the vocabulary) and tensor table, no tensor data.
        assert fetched == [f"{gname}/1/.header/{smollm2_file.name}"]
        assert gv.tokenizer[0].size < gv.files[0].size / 20  # 1.8 of 98 MB here
        assert got["tokens"] == Tokenizer.from_dir(smollm2_file.parent).encode(TEXT)
        fetched.clear()
        await _ask(st.client, subjects.TOKENIZE, {"model": name, "prompt": "again"})
        assert fetched == []  # fetched once per version


async def test_a_promoted_or_canary_version_tokenizes_with_its_own_files(nats_server, tmp_path):
    name = model_name()
    d1 = _version_dir(tmp_path, 1, False,
                      "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}")
    d2 = _version_dir(tmp_path, 2, True, "{% for m in messages %}{{ m['content'] }}{% endfor %}")
    (text1, chat1), (text2, chat2) = _reference(d1), _reference(d2)
    assert text1 != text2 and chat1 != chat2  # the versions must tell apart
    async with running_stack(nats_server.url, registry=True) as st:
        for v, d in (("1", d1), ("2", d2)):
            await st.registry.push(d, name, version=v, progress=False)
        await st.registry.promote(name, "1")
        await st.add_registry_worker(name, Decoders(), "tok-w1")
        assert await _counts(st.client, name) == (text1, chat1, "1")

        gateway_aliases = st.gateway.front.models.resolver.aliases
        await st.registry.promote(name, "2")
        await gateway_aliases.wait_for(name, lambda a: a.prod == "2", timeout=10)
        await wait_until(lambda: "2" in hb(st, "tok-w1").versions, timeout=120)
        assert await _counts(st.client, name) == (text2, chat2, "2")

        # A canary of the old version, taking every request: its own tokenizer.
        await st.registry.canary(name, "1", weight=1.0)
        await gateway_aliases.wait_for(name, lambda a: a.canary == "1", timeout=10)
        await wait_until(lambda: "1" in hb(st, "tok-w1").versions, timeout=120)
        assert await _counts(st.client, name, user="u1") == (text1, chat1, "1")
        # A pinned version: that version's files.
        assert await _counts(st.client, f"{name}@2") == (text2, chat2, "2")
