"""engine.tokenizer against the reference tokenizers (sentence-transformers for MiniLM,
transformers' PreTrainedTokenizerFast for GPT-2 and Llama-style files)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models, pre_tokenizers, processors, trainers

from engine.tokenizer import Tokenizer
from tests.engine.minilm_inputs import SENTENCES, mixed_texts, model_dir, words


@pytest.fixture(scope="module")
def tok():
    return Tokenizer.from_dir(model_dir())


@pytest.fixture(scope="module")
def st_model():
    from sentence_transformers import SentenceTransformer

    return SentenceTransformer(str(model_dir()), device="cpu")


def _unpadded(features) -> list[list[int]]:
    ids, mask = features["input_ids"].tolist(), features["attention_mask"].tolist()
    return [[i for i, m in zip(row, mrow) if m] for row, mrow in zip(ids, mask)]


def test_matches_sentence_transformers_up_to_its_256_limit(tok, st_model):
    texts = SENTENCES + mixed_texts()
    expected = _unpadded(st_model.tokenize(texts))
    ours = tok.encode_batch(texts)
    assert ours == expected
    # The file truncates at 128; inputs of 129..256 tokens must come through whole.
    assert max(len(x) for x in ours) == 256
    assert sum(len(x) > 128 for x in ours) >= 8
    assert tok.count(texts) == [len(x) for x in expected]


def test_over_long_input_is_counted_not_truncated(tok, st_model):
    text = words(400)
    full = st_model.tokenizer(text, truncation=False)["input_ids"]
    assert len(full) == 402
    assert tok.encode_batch([text]) == [full]
    assert tok.count([text, "hi"]) == [402, 3]


def test_special_tokens_and_ids(tok, st_model):
    ref = st_model.tokenizer
    assert tok.pad_id == ref.pad_token_id == 0
    assert tok.vocab_size == len(ref) == 30522
    assert tok.encode_batch([""]) == [[ref.cls_token_id, ref.sep_token_id]]
    assert tok.encode_batch(["hello world"], add_special_tokens=False) == [
        ref("hello world", add_special_tokens=False)["input_ids"]
    ]
    assert tok.bos_token_id is None and tok.eos_token_ids == ()
    assert tok.encode_batch([]) == []


def test_decode_matches_reference(tok, st_model):
    for text in SENTENCES:
        ids = tok.encode(text)
        assert tok.decode(ids) == st_model.tokenizer.decode(ids, skip_special_tokens=True)
        assert tok.decode(ids, skip_special_tokens=False).startswith("[CLS]")


def test_import_pulls_in_no_tensor_library():
    code = (
        "import sys, engine.tokenizer;"
        "print(sorted(m for m in ('jax', 'torch', 'numpy') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True)  # fmt: skip
    assert out.stdout.strip() == "[]"


# --- decoder-style tokenizer files, built small here with the tokenizers trainer

CORPUS = [
    "def add(a, b):\n    return a + b\n",
    "The cat sat on the mat. The dog sat on the log.",
    "Ünïcödé text, emoji 🙂 and tabs\there.",
] * 20


def _train(special: list[str]) -> HFTokenizer:
    t = HFTokenizer(models.BPE())
    t.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    t.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=special,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())  # fmt: skip
    t.train_from_iterator(CORPUS, trainer)
    return t


def _write(d, t: HFTokenizer, tokenizer_config: dict, config: dict) -> None:
    t.save(str(d / "tokenizer.json"))
    (d / "tokenizer_config.json").write_text(json.dumps(tokenizer_config))
    (d / "config.json").write_text(json.dumps(config))


def _reference(d, **special):
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast(tokenizer_file=str(d / "tokenizer.json"), **special)


def test_gpt2_style_file(tmp_path):
    t = _train(["<|endoftext|>"])
    t.post_processor = processors.ByteLevel(trim_offsets=False)
    eot = t.token_to_id("<|endoftext|>")
    _write(tmp_path, t, {"eos_token": "<|endoftext|>", "bos_token": "<|endoftext|>"},
           {"eos_token_id": eot, "bos_token_id": eot})  # fmt: skip
    ours = Tokenizer.from_dir(tmp_path)
    ref = _reference(tmp_path, eos_token="<|endoftext|>")
    texts = CORPUS[:3] + ["  leading spaces", "x<|endoftext|>y"]
    assert ours.encode_batch(texts) == [ref.encode(x) for x in texts]
    assert ours.eos_token_ids == (eot,) and ours.bos_token_id == eot
    assert ours.pad_id == eot  # no pad token: padding uses end-of-text
    for text in texts:
        ids = ours.encode(text)
        assert ours.decode(ids) == ref.decode(ids, skip_special_tokens=True)


def test_llama_style_file_with_bos_template_and_several_eos(tmp_path):
    t = _train(["<unk>", "<s>", "</s>", "<|eot_id|>"])
    bos, eos, eot = (t.token_to_id(x) for x in ("<s>", "</s>", "<|eot_id|>"))
    t.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", bos)]
    )
    _write(tmp_path, t,
           {"bos_token": {"content": "<s>"}, "eos_token": "</s>", "pad_token": None},
           {"bos_token_id": bos, "eos_token_id": [eos, eot]})  # fmt: skip
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [eot, eos]}))
    ours = Tokenizer.from_dir(tmp_path)
    ref = _reference(tmp_path, bos_token="<s>", eos_token="</s>")
    texts = CORPUS[:3]
    assert ours.encode_batch(texts) == [ref.encode(x) for x in texts]
    assert all(ids[0] == bos for ids in ours.encode_batch(texts))
    assert ours.bos_token_id == bos
    # The named eos first, then the rest of generation_config's list, each once.
    assert ours.eos_token_ids == (eos, eot)
    ids = ours.encode(CORPUS[1]) + [eot]
    assert ours.decode(ids) == ref.decode(ids, skip_special_tokens=True) == CORPUS[1]
