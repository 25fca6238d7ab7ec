"""Cross-encoders (rerankers) on the JAX encoder engine against sentence-transformers'
`CrossEncoder.predict`, on tiny random-weight models it saved itself.

BERT (ms-marco-MiniLM's architecture: pooler then classifier, token types 0/1) and
XLM-RoBERTa (bge-reranker's: classifier.dense then out_proj, positions from
padding_idx + 1), one label with the sigmoid `predict` applies by default, and three
labels with none.
"""

from __future__ import annotations

import numpy as np
import pytest

from engine.encoder import EncoderEngine
from engine.encoder.spec import UnsupportedEncoder, read_spec
from engine.tokenizer import Tokenizer
from engine.torch_encoder import TorchEncoder
from bench.support import tiny_encoders
from bench.support.tiny_encoders import PAIRS

KW = dict(batch_buckets=(4,), seq_buckets=(16,), max_batch=4)


@pytest.mark.parametrize("family, labels, activation", [
    ("bert", 1, "sigmoid"),
    ("xlm-roberta", 1, "sigmoid"),
    ("bert", 3, "identity"),
])  # fmt: skip
def test_scores_match_cross_encoder_predict(tmp_path, family, labels, activation):
    ce = tiny_encoders.build_cross_encoder(tmp_path, family, num_labels=labels)
    d = tmp_path / "ce"
    spec = read_spec(d)
    assert (spec.task, spec.num_labels, spec.score_activation) == ("score", labels, activation)
    ids, types = Tokenizer.from_dir(d).encode_pairs(PAIRS)
    feats = ce.tokenizer([q for q, _ in PAIRS], [p for _, p in PAIRS], padding=True)
    assert ids == [[t for t, m in zip(row, mask) if m] for row, mask in
                   zip(feats["input_ids"], feats["attention_mask"])]  # fmt: skip
    if family == "bert":
        assert any(1 in t for t in types)  # the second text is segment 1
    enc = EncoderEngine(d, name="reranker", **KW)
    reference = np.asarray(ce.predict(PAIRS), dtype=np.float32).reshape(len(PAIRS), labels)
    scores = enc.score(ids, types)
    assert scores.shape == (len(PAIRS), labels) and enc.dim == labels
    np.testing.assert_allclose(scores, reference, atol=1e-4, rtol=0)
    assert np.ptp(reference) > 1e-3  # the pairs score differently: the test can fail
    if family == "bert":  # and the second segment's token type is what makes it pass
        zeros = [[0] * len(t) for t in types]
        assert np.abs(enc.score(ids, zeros) - reference).max() > 1e-3


def test_a_reranker_is_not_an_embedder(tmp_path):
    tiny_encoders.build_cross_encoder(tmp_path, "bert", num_labels=1)
    enc = EncoderEngine(tmp_path / "ce", name="reranker", **KW)
    with pytest.raises(ValueError, match="cross-encoder"):
        enc.embed([[101, 102]])
    with pytest.raises(UnsupportedEncoder, match="JAX engine only"):
        TorchEncoder(tmp_path / "ce", **KW)
