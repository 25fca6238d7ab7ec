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


@pytest.mark.parametrize("family", ["bert", "xlm-roberta"])
def test_raw_scores_are_the_logits_from_the_same_program(tmp_path, family):
    """`score(raw=True)` is CrossEncoder.predict with no activation (TEI's
    `raw_scores`), from the programs that give the activated scores: nothing more is
    compiled, and `activate` of the logits is exactly what `score` answers."""
    import torch

    ce = tiny_encoders.build_cross_encoder(tmp_path, family, num_labels=1)
    d = tmp_path / "ce"
    ids, types = Tokenizer.from_dir(d).encode_pairs(PAIRS)
    enc = EncoderEngine(d, name="reranker", **KW)
    scores = enc.score(ids, types)
    traced = enc.traces
    raw = enc.score(ids, types, raw=True)
    assert enc.traces == traced  # the same program
    logits = np.asarray(ce.predict(PAIRS, activation_fn=torch.nn.Identity()),
                        dtype=np.float32).reshape(len(PAIRS), 1)
    np.testing.assert_allclose(raw, logits, atol=1e-4, rtol=0)
    assert np.abs(logits - np.asarray(ce.predict(PAIRS)).reshape(-1, 1)).min() > 1e-2  # differ
    np.testing.assert_array_equal(enc.activate(raw), scores)
    np.testing.assert_allclose(scores, 1 / (1 + np.exp(-logits.astype(np.float64))), atol=1e-6)


@pytest.mark.parametrize("family", ["bert", "xlm-roberta"])
def test_a_pair_is_cut_longest_first_as_transformers_cuts_it(tmp_path, family):
    """`encode_pairs(max_length=n)`: transformers' `truncation='longest_first'`: the
    longer text loses tokens first, special tokens count; a pair within `n` is whole."""
    ce = tiny_encoders.build_cross_encoder(tmp_path, family, num_labels=1)
    tok = Tokenizer.from_dir(tmp_path / "ce")
    pairs = [("word " * 30, "short one"), ("short one", "word " * 30),
             ("alpha beta " * 12, "gamma delta " * 10), ("hi", "there")]
    for n in (12, 13, 20, 33):
        ids, types = tok.encode_pairs(pairs, max_length=n)
        ref = ce.tokenizer([a for a, _ in pairs], [b for _, b in pairs],
                           truncation="longest_first", max_length=n)
        assert ids == ref["input_ids"] and all(len(x) <= n for x in ids)
        if "token_type_ids" in ref:
            assert types == ref["token_type_ids"]
    whole, _ = tok.encode_pairs(pairs)
    assert tok.encode_pairs(pairs, max_length=max(map(len, whole)))[0] == whole
    assert len(whole[0]) > 33 and len(whole[1]) > 33  # the cut is exercised both ways
