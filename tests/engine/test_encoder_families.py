"""Encoder families and sentence-transformers heads against sentence-transformers.

Each case is a tiny model built from the real architecture's config with random
weights, saved by sentence-transformers in its module layout (tests/support/
tiny_encoders.py) and loaded back with `SentenceTransformer(dir)`: the reference.
Both engines must give the same vectors (cosine >= 0.9999) from the same directory,
with the pooling, Dense layers, Normalize (or its absence) and prompts the
directory declares. Models the engines cannot serve are refused from their config
files alone, with the reason.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest

from engine.encoder import EncoderEngine
from engine.encoder.config import BertConfig
from engine.encoder.spec import UnsupportedEncoder, read_spec
from engine.tokenizer import Tokenizer
from engine.torch_encoder import TorchEncoder
from bench.support import tiny_encoders
from bench.support.tiny_encoders import TEXTS

KW = dict(batch_buckets=(8,), seq_buckets=(16,), max_batch=8)

# name -> build() arguments: what each real family ships.
CASES = {
    # BGE: BERT, CLS pooling, Normalize.
    "bge": dict(family="bert", pooling="cls"),
    # E5 / GTE: BERT, mean pooling, Normalize, "query: " / "passage: " prompts.
    "e5": dict(family="bert", pooling="mean",
               prompts={"query": "query: ", "passage": "passage: "}),
    # A model trained without Normalize: its vectors are not unit length.
    "bert-mean-no-normalize": dict(family="bert", pooling="mean", normalize=False),
    # A Dense projection after pooling (tanh, 32 -> 16), then Normalize.
    "bert-dense": dict(family="bert", pooling="mean", dense=(16,)),
    # multilingual-e5 / paraphrase-xlm-r: XLM-RoBERTa, mean pooling.
    "xlm-roberta-mean": dict(family="xlm-roberta", pooling="mean"),
    # bge-m3: XLM-RoBERTa, CLS pooling.
    "xlm-roberta-cls": dict(family="xlm-roberta", pooling="cls"),
    "roberta-mean": dict(family="roberta", pooling="mean", normalize=False),
    # all-mpnet-base-v2: MPNet (relative position bias), mean pooling, Normalize.
    "mpnet-mean": dict(family="mpnet", pooling="mean"),
    # The other pooling modes sentence-transformers offers, and a concatenation.
    "bert-max": dict(family="bert", pooling="max"),
    "bert-weightedmean": dict(family="bert", pooling="weightedmean"),
    "bert-lasttoken": dict(family="bert", pooling="lasttoken"),
    "bert-mean-sqrt-len": dict(family="bert", pooling="mean_sqrt_len_tokens", normalize=False),
    "bert-cls-mean-dense": dict(family="bert", pooling=("cls", "mean"), dense=(24, 8),
                                normalize=False),
}  # fmt: skip


@pytest.fixture(scope="module", params=sorted(CASES))
def case(request, tmp_path_factory):
    """(name, model directory, the sentence-transformers reference loaded from it)."""
    out = tmp_path_factory.mktemp(request.param)
    st = tiny_encoders.build(out, **CASES[request.param])
    return request.param, out / "st", st


def _cosine(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return (a * b).sum(1) / (np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1))


def _check(ours: np.ndarray, reference: np.ndarray) -> None:
    assert ours.dtype == np.float32 and ours.shape == reference.shape
    cos = _cosine(ours, reference)
    assert cos.min() >= 0.9999, f"worst cosine {cos.min():.6f} at {cos.argmin()}"
    # Same length too: a model without Normalize is not silently normalised.
    np.testing.assert_allclose(np.linalg.norm(ours, axis=1), np.linalg.norm(reference, axis=1),
                               rtol=1e-3)  # fmt: skip


def _ids(model_dir: Path, st, texts: list[str]) -> list[list[int]]:
    """Our tokenizer (the gateway's), checked against sentence-transformers' own."""
    ids = Tokenizer.from_dir(model_dir).encode_batch(texts)
    feats = st.tokenize(texts)
    theirs = [row[mask.bool()].tolist() for row, mask in
              zip(feats["input_ids"], feats["attention_mask"])]  # fmt: skip
    assert ids == theirs
    return ids


@pytest.mark.parametrize("engine", ["jax", "torch"])
def test_engine_matches_sentence_transformers(case, engine):
    name, model_dir, st = case
    enc = EncoderEngine(model_dir, name=name, **KW) if engine == "jax" else TorchEncoder(
        model_dir, name=name, **KW)
    reference = st.encode(TEXTS, convert_to_numpy=True)  # [N, dim]
    assert enc.dim == reference.shape[1] and enc.max_tokens == tiny_encoders.MAX_SEQ
    _check(enc.embed(_ids(model_dir, st, TEXTS)), reference)
    for prompt_name, prefix in enc.prompts.items():  # the gateway prepends the prefix
        reference = st.encode(TEXTS, prompt_name=prompt_name, convert_to_numpy=True)
        _check(enc.embed(_ids(model_dir, st, [prefix + t for t in TEXTS])), reference)


def test_spec_reads_what_each_family_declares(case):
    name, model_dir, _ = case
    spec = read_spec(model_dir)
    want = CASES[name]
    pooling = want["pooling"]
    assert spec.pooling == ((pooling,) if isinstance(pooling, str) else pooling)
    assert spec.family == {"xlm-roberta": "roberta"}.get(want["family"], want["family"])
    assert spec.normalize == want.get("normalize", True)
    assert [d.out_features for d in spec.dense] == list(want.get("dense", ()))
    assert {k: v for k, v in spec.prompts.items() if v} == want.get("prompts", {})
    cfg = BertConfig(model_dir)
    assert cfg.position_offset == (0 if want["family"] == "bert" else 2)


def test_mpnet_relative_buckets_equal_transformers():
    """Computed in float32 like Hugging Face, so distances 16, 32 and 64 (exact
    bucket boundaries) land where they do there, at every length served."""
    import torch
    from transformers.models.mpnet.modeling_mpnet import MPNetEncoder

    from engine.encoder.config import relative_buckets

    for s in (1, 2, 17, 48, 129, 512):
        pos = torch.arange(s)
        ref = MPNetEncoder.relative_position_bucket(pos[None, :] - pos[:, None])
        np.testing.assert_array_equal(relative_buckets(s), ref.numpy())


def test_mpnet_relative_position_bias_is_what_makes_it_agree(tmp_path):
    st = tiny_encoders.build(tmp_path, family="mpnet", pooling="mean")
    enc = EncoderEngine(tmp_path / "st", **KW)
    ids = _ids(tmp_path / "st", st, TEXTS)
    reference = st.encode(TEXTS, convert_to_numpy=True)
    _check(enc.embed(ids), reference)
    enc.params["rel_bias"] = enc.params["rel_bias"] * 0.0
    assert _cosine(enc.embed(ids), reference).min() < 0.9995


def test_roberta_positions_start_after_padding_idx(tmp_path, monkeypatch):
    """Numbering RoBERTa positions from 0, as BERT does, gives other vectors: the
    offset is what makes the (XLM-)RoBERTa cases above agree."""
    st = tiny_encoders.build(tmp_path, family="xlm-roberta", pooling="mean")
    ids = _ids(tmp_path / "st", st, TEXTS)
    reference = st.encode(TEXTS, convert_to_numpy=True)
    _check(EncoderEngine(tmp_path / "st", **KW).embed(ids), reference)

    class FromZero(BertConfig):
        def __init__(self, model_dir) -> None:
            super().__init__(model_dir)
            self.position_offset = 0

    monkeypatch.setattr("engine.encoder.params.BertConfig", FromZero)
    assert _cosine(EncoderEngine(tmp_path / "st", **KW).embed(ids), reference).min() < 0.999


# --- refusals, from the config files alone


def _write(d: Path, files: dict[str, object]) -> Path:
    for name, body in files.items():
        (d / name).parent.mkdir(parents=True, exist_ok=True)
        (d / name).write_text(json.dumps(body))
    return d


BERT_CFG = {"model_type": "bert", "architectures": ["BertModel"], "hidden_size": 32,
            "num_attention_heads": 4, "num_hidden_layers": 2}  # fmt: skip
MODULES = [{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
           {"idx": 1, "name": "1", "path": "1_Pooling",
            "type": "sentence_transformers.models.Pooling"}]  # fmt: skip


@pytest.mark.parametrize("config, reason", [
    ({"model_type": "t5", "architectures": ["T5EncoderModel"]}, "T5 encoders"),
    ({"model_type": "electra", "architectures": ["ElectraModel"]}, "ELECTRA"),
    ({"model_type": "nomic_bert", "architectures": ["NomicBertModel"]},
     "modelling code lives only on the hub"),
    ({"model_type": "modernbert", "architectures": ["ModernBertModel"],
      "rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "ModernBERT with rope scaling"),
    ({"model_type": "modernbert", "hidden_activation": "swish"}, "hidden_activation 'swish'"),
    ({"model_type": "gpt_neox", "architectures": ["GPTNeoXModel"]}, "'gpt-neox' (GPTNeoXModel)"),
    ({"model_type": "qwen3", "architectures": ["Qwen3Model"]}, "lacks 'hidden_size'"),
    ({"model_type": "qwen3", "vocab_size": 8, "hidden_size": 8, "intermediate_size": 8,
      "num_hidden_layers": 1, "num_attention_heads": 2,
      "rope_scaling": {"rope_type": "proportional", "factor": 2.0}},
     "rope scaling 'proportional'"),
    ({**BERT_CFG, "position_embedding_type": "relative_key"}, "absolute positions only"),
    ({**BERT_CFG, "hidden_act": "swish"}, "hidden_act 'swish'"),
])  # fmt: skip
def test_unserved_architectures_are_refused_with_the_reason(tmp_path, config, reason):
    d = _write(tmp_path, {"config.json": config, "modules.json": MODULES,
                          "1_Pooling/config.json": {"pooling_mode": "mean"}})  # fmt: skip
    with pytest.raises(UnsupportedEncoder, match=re.escape(reason)) as exc:
        BertConfig(d)
    assert "\n" not in str(exc.value)


@pytest.mark.parametrize("files, reason", [
    ({"1_Pooling/config.json": {"pooling_mode": "median"}}, "pooling 'median'"),
    ({"1_Pooling/config.json": {"pooling_mode": "mean", "include_prompt": False}},
     "include_prompt"),
    ({"modules.json": MODULES[:1]}, "no Pooling module"),
    ({"modules.json": MODULES + [{"idx": 2, "path": "2_LayerNorm",
                                  "type": "sentence_transformers.models.LayerNorm"}]},
     "'sentence_transformers.models.LayerNorm'"),
    ({"modules.json": MODULES + [{"idx": 2, "path": "2_Dense",
                                  "type": "sentence_transformers.models.Dense"}],
      "2_Dense/config.json": {"in_features": 32, "out_features": 8,
                              "activation_function": "my.custom.Swish"}}, "activation"),
    ({"config_sentence_transformers.json": {"prompts": {"query": "q: "},
                                            "default_prompt_name": "doc"}}, "'doc'"),
])  # fmt: skip
def test_unserved_heads_are_refused_with_the_reason(tmp_path, files, reason):
    d = _write(tmp_path, {"config.json": BERT_CFG, "modules.json": MODULES,
                          "1_Pooling/config.json": {"pooling_mode": "mean"}})  # fmt: skip
    _write(d, files)
    with pytest.raises(UnsupportedEncoder, match=re.escape(reason)):
        read_spec(d)


def test_legacy_pooling_keys_and_plain_directories(tmp_path):
    """sentence-transformers < 6 wrote one boolean per mode; a directory with no
    modules.json gets what `SentenceTransformer(dir)` builds for it: mean, no Normalize."""
    d = _write(tmp_path, {"config.json": BERT_CFG, "modules.json": MODULES,
                          "1_Pooling/config.json": {"pooling_mode_cls_token": True,
                                                    "pooling_mode_mean_tokens": False}})  # fmt: skip
    assert read_spec(d).pooling == ("cls",)
    (d / "modules.json").unlink()
    spec = read_spec(d)
    assert (spec.pooling, spec.normalize, spec.sentence_transformers) == (("mean",), False, False)


def test_a_decoder_based_embedder_matches_sentence_transformers(tmp_path):
    """Qwen3-Embedding style: a causal decoder's last hidden states (after its final
    norm), last-token pooling, Normalize; the JAX encoder engine over the decoder
    engine's layers, batched with right padding, against sentence-transformers."""
    from shared import catalog

    st = tiny_encoders.build_decoder_embedder(tmp_path)
    d = tmp_path / "st"
    assert catalog.describe("qwen3-embed", d).kind == "encoder"
    texts = ["the quick brown fox", "a stream of tokens, one by one, and more of them",
             "dog", "the lazy dog jumps over the quick brown fox again and again"]
    ids = st.tokenizer(texts)["input_ids"]
    engine = EncoderEngine(d, name="qwen3-embed", batch_buckets=(1, 4), seq_buckets=(16,))
    got = engine.embed(ids)
    want = st.encode(texts)
    np.testing.assert_allclose(got, want, atol=1e-4)
    assert engine.dim == want.shape[1] and engine.normalize
    with pytest.raises(UnsupportedEncoder, match="JAX engine only"):
        TorchEncoder(d, name="qwen3-embed")
