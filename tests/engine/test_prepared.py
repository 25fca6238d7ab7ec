"""Prepared weights (engine/prepared.py): SmolLM2's GGUF file dequantized and arranged
once, written as safetensors, read back on the next load bit for bit equal to a fresh
build, and built again when the source file changes."""

from __future__ import annotations

import json
import os
import shutil

import jax
import numpy as np
import pytest
import safetensors.numpy

from engine import prepared
from engine.decoder import DecoderEngine
from engine.decoder.config import load_config
from engine.decoder.model import load_host_forms
from engine.quant import QWeight, is_qweight
from tests.support.tiny_models import build


def _assert_identical(got, want) -> None:
    """Same tree, same dtypes and shapes, the same bytes in every leaf."""
    got_leaves, got_def = jax.tree.flatten(got, is_leaf=lambda n: n is None)
    want_leaves, want_def = jax.tree.flatten(want, is_leaf=lambda n: n is None)
    assert got_def == want_def
    for g, w in zip(got_leaves, want_leaves):
        g, w = np.asarray(g), np.asarray(w)
        assert g.dtype == w.dtype and g.shape == w.shape
        assert g.tobytes() == w.tobytes()


def _entries(folder):
    return sorted(folder.glob("*.safetensors"))


@pytest.mark.parametrize("quant, forms", [("none", ("float",)), ("gguf", ("dequant", "w8a8"))])
def test_written_on_the_first_load_and_read_bit_for_bit_on_the_second(smollm2_dir, tmp_path,
                                                                      quant, forms):
    cfg, folder = load_config(smollm2_dir), tmp_path / "prepared"
    first, how = load_host_forms(smollm2_dir, cfg, quant, forms, folder)
    assert how == "built" and len(_entries(folder)) == 1
    again, how = load_host_forms(smollm2_dir, cfg, quant, forms, folder)
    assert how == "cache" and len(_entries(folder)) == 1
    fresh, how = load_host_forms(smollm2_dir, cfg, quant, forms, None)
    assert how == "built, not kept"
    _assert_identical(again, fresh)
    _assert_identical(first, fresh)
    if quant == "gguf":  # Q4_1 blocks (int4, with minimums) and int8 per channel
        leaves = jax.tree.leaves(again, is_leaf=is_qweight)
        kinds = {(w.bits, w.offset is None, w.compute) for w in leaves if isinstance(w, QWeight)}
        assert {(4, False, "dequant"), (8, True, "int8")} <= kinds
    else:  # a plain safetensors file: the library reads it too
        entry = safetensors.numpy.load_file(str(_entries(folder)[0]))
        assert np.array_equal(entry["float.embed"], fresh["float"]["embed"])


def test_a_changed_source_is_built_again(smollm2_file, tmp_path):
    model = tmp_path / "model"
    model.mkdir()
    source = model / smollm2_file.name
    shutil.copyfile(smollm2_file, source)  # the same bytes elsewhere: a fresh cache here
    cfg, folder = load_config(model), tmp_path / "prepared"
    first, how = load_host_forms(model, cfg, "none", ("float",), folder)
    [old] = _entries(folder)
    assert how == "built"
    st = source.stat()
    os.utime(source, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))  # touched, same bytes
    _, how = load_host_forms(model, cfg, "none", ("float",), folder)
    assert how == "cache"
    with source.open("r+b") as f:  # the last tensor's last bytes (output_norm, float32)
        f.seek(-4, os.SEEK_END)
        f.write(np.float32(0.5).tobytes())
    changed, how = load_host_forms(model, cfg, "none", ("float",), folder)
    assert how == "built" and len(_entries(folder)) == 2
    assert not np.array_equal(changed["float"]["norm_w"], first["float"]["norm_w"])
    # A damaged entry is built again, not trusted.
    [new] = [e for e in _entries(folder) if e != old]
    new.write_bytes(new.read_bytes()[: 1 << 20])
    _, how = load_host_forms(model, cfg, "none", ("float",), folder)
    assert how == "built" and new.stat().st_size > 1 << 20
    _, how = load_host_forms(model, cfg, "none", ("float",), folder)
    assert how == "cache"


def test_a_changed_config_json_is_built_again(tmp_path):
    """The config file says how the stored weights read (a quantization_config's
    block size, say) beyond what the engine's config keeps: a changed one is a new
    entry, not the old one's weights."""
    model, folder = tmp_path / "model", tmp_path / "prepared"
    build("llama", model, positions=32)
    cfg = load_config(model)
    _, how = load_host_forms(model, cfg, "none", ("float",), folder)
    assert how == "built"
    _, how = load_host_forms(model, cfg, "none", ("float",), folder)
    assert how == "cache"
    config = json.loads((model / "config.json").read_text())
    config["transformers_version"] = "0.0.1"  # a key the engine's config does not keep
    (model / "config.json").write_text(json.dumps(config))
    assert load_config(model) == cfg
    _, how = load_host_forms(model, cfg, "none", ("float",), folder)
    assert how == "built" and len(_entries(folder)) == 2


def test_the_engine_keeps_its_weights_and_loads_them_back(smollm2_dir, tmp_path):
    folder = tmp_path / "prepared"
    kw = dict(name="smollm2", slots=1, max_context=128, kv_blocks=16)
    DecoderEngine(smollm2_dir, weights_cache=folder, **kw)
    [entry] = _entries(folder)
    inode = entry.stat().st_ino
    cached = DecoderEngine(smollm2_dir, weights_cache=folder, **kw)
    assert _entries(folder) == [entry] and entry.stat().st_ino == inode  # read, not rewritten
    fresh = DecoderEngine(smollm2_dir, weights_cache=None, **kw)
    _assert_identical(cached.forms.held, fresh.forms.held)
    assert prepared.directory(None) is None and prepared.directory(folder) == folder
