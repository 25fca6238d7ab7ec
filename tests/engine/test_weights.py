"""engine.weights against safetensors' and torch's own readers of the same files."""

from __future__ import annotations

import json

import ml_dtypes
import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from engine.weights import load_weights, read_safetensors, strip_prefix, weight_files
from tests.engine.minilm_inputs import model_dir


def _tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {
        "model.embed.weight": torch.randn(7, 5, generator=g, dtype=torch.bfloat16),
        "model.layer.0.w": torch.randn(5, 3, generator=g, dtype=torch.float16),
        "model.layer.0.b": torch.randn(3, generator=g),
        "model.pos_ids": torch.arange(6, dtype=torch.int64).reshape(1, 6),
        "lm_head.weight": torch.randn(2, 5, generator=g, dtype=torch.bfloat16),
    }


def _same(ours: dict[str, np.ndarray], ref: dict[str, torch.Tensor]) -> None:
    assert set(ours) == set(ref)
    for name, t in ref.items():
        if t.dtype == torch.bfloat16:  # compare bits: no rounding on the way
            assert ours[name].dtype == ml_dtypes.bfloat16
            assert (ours[name].view(np.int16) == t.view(torch.int16).numpy()).all()
        else:
            np.testing.assert_array_equal(ours[name], t.numpy())


def test_bfloat16_safetensors_read_bit_exact(tmp_path):
    ref = _tensors()
    save_file(ref, tmp_path / "model.safetensors")
    _same(load_weights(tmp_path), load_file(tmp_path / "model.safetensors"))


def test_sharded_safetensors_with_index(tmp_path):
    ref = _tensors()
    names = sorted(ref)
    shards = {"model-00001-of-00002.safetensors": names[:2],
              "model-00002-of-00002.safetensors": names[2:]}  # fmt: skip
    for fname, keys in shards.items():
        save_file({k: ref[k] for k in keys}, tmp_path / fname)
    index = {"weight_map": {k: f for f, keys in shards.items() for k in keys}}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    assert [p.name for p in weight_files(tmp_path)] == sorted(shards)
    _same(load_weights(tmp_path), ref)


def test_torch_bin_fallback(tmp_path):
    ref = _tensors()
    torch.save(ref, tmp_path / "pytorch_model.bin")
    _same(load_weights(tmp_path), ref)


def test_safetensors_preferred_and_missing_weights_reported(tmp_path):
    ref = _tensors()
    save_file(ref, tmp_path / "model.safetensors")
    torch.save({"other": torch.zeros(1)}, tmp_path / "pytorch_model.bin")
    assert set(load_weights(tmp_path)) == set(ref)
    with pytest.raises(FileNotFoundError):
        load_weights(tmp_path / "nothing-here")


def test_minilm_matches_safetensors_reader():
    path = model_dir() / "model.safetensors"
    ours, ref = read_safetensors(path), load_file(path)
    _same(ours, ref)
    assert ours["embeddings.word_embeddings.weight"].shape == (30522, 384)


def test_strip_prefix_keeps_heads_and_refuses_collisions():
    w = {"bert.embeddings.x": np.zeros(1), "cls.predictions.bias": np.zeros(2)}
    assert set(strip_prefix(w)) == {"embeddings.x", "cls.predictions.bias"}
    assert set(strip_prefix({"model.a": 1, "b": 2}, ("model.",))) == {"a", "b"}
    with pytest.raises(ValueError, match="both map"):
        strip_prefix({"model.a": 1, "a": 2})
