"""ModernBERT embedders and cross-encoders on the JAX encoder engine, against
sentence-transformers (and transformers itself) on the same tiny random-weight models.

The models are shaped like ModernBERT-base (global attention every third layer,
160k / 10k RoPE bases, GeGLU, no biases) with a local window of +/- 4 tokens, so
that most inputs are longer than the window and batches mix lengths: the sliding
window, the two RoPE bases and the padding mask each decide the result, and the
tests show it by breaking each one.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from engine.encoder import EncoderEngine
from engine.encoder.config import BertConfig
from engine.encoder.spec import UnsupportedEncoder, read_spec
from engine.tokenizer import Tokenizer
from engine.torch_encoder import TorchEncoder
from bench.support import tiny_encoders
from bench.support.tiny_encoders import PAIRS, TEXTS

KW = dict(batch_buckets=(8,), seq_buckets=(16,), max_batch=8)


# gte-modernbert-base pools the CLS token; modernbert-embed-base the mean.
@pytest.fixture(scope="module", params=["cls", "mean"])
def embedder(request, tmp_path_factory):
    out = tmp_path_factory.mktemp(f"modernbert-{request.param}")
    st = tiny_encoders.build(out, family="modernbert", pooling=request.param)
    return request.param, out / "st", st


def _cosine(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return (a * b).sum(1) / (np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1))


def _ids(model_dir: Path, st, texts: list[str]) -> list[list[int]]:
    ids = Tokenizer.from_dir(model_dir).encode_batch(texts)
    feats = st.tokenize(texts)
    assert "token_type_ids" not in feats  # ModernBERT takes none
    theirs = [row[m.bool()].tolist() for row, m in zip(feats["input_ids"], feats["attention_mask"])]
    assert ids == theirs
    return ids


def test_embeddings_match_sentence_transformers(embedder):
    pooling, d, st = embedder
    cfg = BertConfig(d)
    assert (cfg.family, cfg.spec.pooling, cfg.window) == ("modernbert", (pooling,), 4)
    assert cfg.global_layers == (True, False, False, True)
    assert cfg.rope_theta == (160000.0, 10000.0)
    ids = _ids(d, st, TEXTS)
    assert max(map(len, ids)) > 16 and min(map(len, ids)) < 2 * cfg.window + 1  # two buckets
    enc = EncoderEngine(d, name="modernbert", **KW)
    reference = st.encode(TEXTS, convert_to_numpy=True)
    got = enc.embed(ids)
    assert got.shape == reference.shape and enc.dim == tiny_encoders.HIDDEN
    cos = _cosine(got, reference)
    assert cos.min() >= 0.9999, f"worst cosine {cos.min():.6f} at {cos.argmin()}"
    # One at a time (no padding) gives the same vectors as the mixed batch.
    alone = np.concatenate([enc.embed([x]) for x in ids])
    np.testing.assert_allclose(alone, got, atol=1e-5)


@pytest.mark.parametrize("broken", ["no sliding window", "one rope base", "no final norm"])
def test_each_modernbert_part_is_what_makes_it_agree(embedder, broken):
    """Attention over the whole input in local layers, the global RoPE base in every
    layer, or skipping the final LayerNorm each fail the bar the engine passes."""
    _, d, st = embedder
    enc = EncoderEngine(d, name="modernbert", **KW)
    if broken == "no sliding window":
        enc.cfg.window = 10_000
    elif broken == "one rope base":
        enc.cfg.rope_theta = (enc.cfg.rope_theta[0],) * 2
    else:
        enc.params["final_g"] = enc.params["final_g"] * 0 + 1
        enc.params["final_b"] = enc.params["final_b"] * 0
    reference = st.encode(TEXTS, convert_to_numpy=True)
    assert _cosine(enc.embed(_ids(d, st, TEXTS)), reference).min() < 0.9999


def test_quantized_and_bfloat16_weights_stay_close(embedder):
    """The int8 weight quantization and bfloat16 read the same parameter names as
    BERT's: near the float32 reference, not equal to it."""
    _, d, st = embedder
    reference = st.encode(TEXTS, convert_to_numpy=True)
    ids = _ids(d, st, TEXTS)
    for kw in (dict(quant="int8"), dict(dtype="bfloat16")):
        got = EncoderEngine(d, name="modernbert", **KW, **kw).embed(ids)
        assert _cosine(got, reference).min() >= 0.999, kw


def test_the_torch_engine_refuses_modernbert(embedder):
    _, d, _ = embedder
    with pytest.raises(UnsupportedEncoder, match="ModernBERT is computed by the JAX engine only"):
        TorchEncoder(d, **KW)


@pytest.mark.parametrize("pooling", ["cls", "mean"])
def test_rerank_scores_match_cross_encoder_predict(tmp_path, pooling):
    """gte-reranker-modernbert-base's shape: ModernBertForSequenceClassification, one
    label (sigmoid in `predict`), classifier_pooling cls or mean (masked mean over a
    padded batch of pairs longer than the local window)."""
    ce = tiny_encoders.build_cross_encoder(tmp_path, "modernbert", num_labels=1,
                                           classifier_pooling=pooling)  # fmt: skip
    d = tmp_path / "ce"
    spec = read_spec(d)
    assert (spec.family, spec.task, spec.num_labels, spec.score_activation) == \
        ("modernbert", "score", 1, "sigmoid")
    ids, types = Tokenizer.from_dir(d).encode_pairs(PAIRS)
    feats = ce.tokenizer([q for q, _ in PAIRS], [p for _, p in PAIRS], padding=True)
    assert ids == [[t for t, m in zip(row, mask) if m] for row, mask in
                   zip(feats["input_ids"], feats["attention_mask"])]  # fmt: skip
    enc = EncoderEngine(d, name="reranker", batch_buckets=(4,), seq_buckets=(16,), max_batch=4)
    reference = np.asarray(ce.predict(PAIRS), dtype=np.float32).reshape(len(PAIRS), 1)
    scores = enc.score(ids, types)
    np.testing.assert_allclose(scores, reference, atol=1e-4, rtol=0)
    assert np.ptp(reference) > 1e-3
    # transformers' own logits (eager attention), before predict's sigmoid.
    logits = _transformers_logits(tmp_path / "hf", ids)
    np.testing.assert_allclose(scores, 1 / (1 + np.exp(-logits)), atol=1e-4, rtol=0)
    # Token types do not exist for ModernBERT: they change nothing.
    np.testing.assert_array_equal(enc.score(ids, [[0] * len(t) for t in types]), scores)


def _transformers_logits(hf_dir: Path, ids: list[list[int]]) -> np.ndarray:
    import torch
    from transformers import ModernBertForSequenceClassification

    model = ModernBertForSequenceClassification.from_pretrained(
        str(hf_dir), attn_implementation="eager").eval()
    s = max(map(len, ids))
    batch = torch.tensor([x + [0] * (s - len(x)) for x in ids])
    mask = torch.tensor([[1] * len(x) + [0] * (s - len(x)) for x in ids])
    with torch.no_grad():
        return model(input_ids=batch, attention_mask=mask).logits.numpy()


def test_modernbert_configs_from_the_hub_are_read(tmp_path):
    """The pre-5.x config fields (global_attn_every_n_layers, global_rope_theta,
    local_rope_theta) as ModernBERT-base ships them; rope scaling is refused."""
    import json

    from tests.engine.test_encoder_families import MODULES

    hub = {"model_type": "modernbert", "architectures": ["ModernBertModel"],
           "hidden_size": 32, "num_attention_heads": 4, "num_hidden_layers": 7,
           "intermediate_size": 48, "global_attn_every_n_layers": 3, "local_attention": 128,
           "global_rope_theta": 160000.0, "local_rope_theta": None, "pad_token_id": 50283}
    (tmp_path / "1_Pooling").mkdir()
    (tmp_path / "1_Pooling" / "config.json").write_text(json.dumps({"pooling_mode": "cls"}))
    (tmp_path / "modules.json").write_text(json.dumps(MODULES))
    (tmp_path / "config.json").write_text(json.dumps(hub))
    cfg = BertConfig(tmp_path)
    assert cfg.global_layers == (True, False, False, True, False, False, True)
    assert (cfg.window, cfg.rope_theta, cfg.pad_id) == (64, (160000.0, 160000.0), 50283)
    hub["rope_scaling"] = {"rope_type": "yarn", "factor": 4.0}
    (tmp_path / "config.json").write_text(json.dumps(hub))
    with pytest.raises(UnsupportedEncoder, match="rope scaling"):
        BertConfig(tmp_path)
