"""Which engine a worker builds: `TENSORBUS_ENGINE` picks the backend per model, and a
name no engine knows stops the worker process with 78 before it touches the bus."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from shared import catalog
from shared.config import EX_CONFIG, Config

ROOT = Path(__file__).resolve().parents[2]


def _closed_port() -> int:
    """A port nothing listens on: a worker that tried to connect would fail otherwise."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(env: dict[str, str]) -> subprocess.CompletedProcess:
    base = {k: v for k, v in os.environ.items() if not k.startswith("TENSORBUS_")}
    base.update(HF_HUB_OFFLINE="1", TENSORBUS_NATS_URL=f"nats://127.0.0.1:{_closed_port()}",
                TENSORBUS_LOG_FORMAT="json", **env)
    return subprocess.run([sys.executable, "-m", "services.worker"], cwd=ROOT, env=base,
                          capture_output=True, text=True, timeout=120)  # fmt: skip


@pytest.mark.parametrize("env, quoted", [
    ({"TENSORBUS_ENGINE": "tpu"}, "'tpu'"),
    ({"TENSORBUS_ENGINE": "jax,all-MiniLM-L6-v2=nope", "TENSORBUS_MODEL": "all-MiniLM-L6-v2"},
     "'nope'"),
    ({"TENSORBUS_ENGINE": "jax,torch"}, "only the first value"),
])  # fmt: skip
def test_worker_process_exits_78_on_an_unknown_engine(env, quoted):
    done = _worker(env)
    assert done.returncode == EX_CONFIG == 78, done.stderr[-2000:]
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("bad configuration:"), done.stderr[-2000:]
    assert quoted in last
    if "only" not in quoted:
        assert "TENSORBUS_ENGINE" in last and "jax, torch" in last


def test_engine_setting_picks_the_decoder_backend_per_model(tmp_path):
    from engine.decoder import DecoderEngine
    from engine.torch_decoder import TorchDecoder
    from services.worker.engines import build_engine
    from tests.support.tiny_models import build

    build("llama", tmp_path, positions=32)
    info = catalog.describe("tiny", tmp_path)
    assert info.kind == "decoder"
    cfg = Config.from_env({}, data_dir=str(tmp_path / "data"), decode_slots=2, max_context=32)
    torch_engine = build_engine(cfg.with_(engine="torch", dtype="bfloat16"), info)
    assert isinstance(torch_engine, TorchDecoder)
    assert (torch_engine.info.dtype, torch_engine.slots, torch_engine.max_context) == ("bfloat16", 2, 32)
    assert isinstance(build_engine(cfg.with_(engine="torch,tiny=jax"), info), DecoderEngine)
    assert isinstance(build_engine(cfg.with_(engine="jax,tiny=torch"), info), TorchDecoder)


@pytest.mark.parametrize("env, says", [
    ({"TENSORBUS_MODEL": catalog.SMOLLM2, "TENSORBUS_TENSOR_PARALLEL": "1,smollm2-135m-instruct=2"},
     "cannot split 9 query heads, 3 kv heads into 2 equal parts"),
    ({"TENSORBUS_TENSOR_PARALLEL": "two"}, "TENSORBUS_TENSOR_PARALLEL='two'"),
    ({"TENSORBUS_QUANT": "none,all-MiniLM-L6-v2=fp4"}, "use one of auto, none, int8, int4, fp8"),
    ({"TENSORBUS_QUANT": "int4", "TENSORBUS_QUANT_FORM": "w8a8"}, "runs int8 weights only"),
    ({"TENSORBUS_QUANT": "none", "TENSORBUS_QUANT_FORM": "dequant"}, "needs quantized weights"),
    ({"TENSORBUS_QUANT_FORM": "kernel"}, "needs quantized weights named in TENSORBUS_QUANT"),
    ({"TENSORBUS_QUANT_FORM": "fast"}, "use one of auto, float, dequant, w8a8"),
    ({"TENSORBUS_WEIGHT_BUDGET_MB": "-5"}, "TENSORBUS_WEIGHT_BUDGET_MB='-5'"),
    ({"TENSORBUS_QUANT": "gguf"}, "encoders are not read from GGUF"),
    ({"TENSORBUS_MODEL": catalog.DEMO_LM, "TENSORBUS_QUANT": "gguf"}, "has none"),
    ({"TENSORBUS_ENGINE": "torch", "TENSORBUS_QUANT": "int8"}, "need TENSORBUS_ENGINE=jax"),
    ({"TENSORBUS_ENGINE": "onnx", "TENSORBUS_QUANT": "int4"},
     "the onnx engine runs on one device with float or int8 weights (TENSORBUS_QUANT=auto, "
     "none, int8); TENSORBUS_TENSOR_PARALLEL=1 and TENSORBUS_QUANT='int4' need"),
    ({"TENSORBUS_ENGINE": "onnx", "TENSORBUS_DTYPE": "bfloat16"},
     "the onnx engine computes float32"),
    ({"TENSORBUS_SPECULATIVE": "off,all-MiniLM-L6-v2=eagle:3"}, "use off or ngram:K"),
])  # fmt: skip
def test_worker_exits_78_when_the_model_cannot_split_or_quantize_so(env, says):
    done = _worker(env)
    assert done.returncode == EX_CONFIG, done.stderr[-2000:]
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("bad configuration:") and says in last, last


def test_the_onnx_engine_keeps_its_graph_in_the_workers_cache_folder(tmp_path, capsys):
    """TENSORBUS_ENGINE=onnx builds the onnx encoder per model, its exported graph kept
    under the worker's cache folder, where the next build reads it back; int8 that
    strays past its bound (a tiny random model's does) exits 78 with the cosine."""
    from bench.support import tiny_encoders
    from engine.onnx_encoder import OnnxEncoder
    from services.worker.engines import build_engine, cache_folder

    tiny_encoders.build(tmp_path, family="bert", pooling="mean")
    info = catalog.describe("tiny", tmp_path / "st")
    cfg = Config.from_env({}, data_dir=str(tmp_path / "data")).with_(engine="jax,tiny=onnx")
    engine = build_engine(cfg, info)
    assert isinstance(engine, OnnxEncoder) and engine.quant == "none"
    assert engine.path.is_relative_to(cache_folder(cfg) / "onnx-encoders")
    mtime = engine.path.stat().st_mtime_ns
    again = build_engine(cfg, info)
    assert again.path == engine.path and again.path.stat().st_mtime_ns == mtime
    with pytest.raises(SystemExit) as exit_info:
        build_engine(cfg.with_(quant="int8"), info)
    assert exit_info.value.code == EX_CONFIG
    said = capsys.readouterr().err.strip().splitlines()[-1]
    assert said.startswith("bad configuration: tiny: int8 weights") and "below 0.999" in said


def test_the_onnx_engine_says_what_to_install(monkeypatch, capsys):
    import importlib.util

    from services.worker.engines import engine_settings

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "onnxruntime" else real(name, *a))
    with pytest.raises(SystemExit) as exit_info:
        engine_settings(Config.from_env({}).with_(engine="onnx"), catalog.ENCODER)
    assert exit_info.value.code == EX_CONFIG
    said = capsys.readouterr().err
    assert "TENSORBUS_ENGINE=onnx for all-MiniLM-L6-v2: onnxruntime not installed" in said
    assert "pip install onnxruntime==1.30.0" in said


def test_quantized_and_split_settings_reach_the_jax_engine(tmp_path):
    from services.worker.engines import build_engine
    from tests.support.tiny_models import build

    build("llama", tmp_path, positions=32)
    info = catalog.describe("tiny", tmp_path)
    cfg = Config.from_env({}, data_dir=str(tmp_path / "data"), decode_slots=2, max_context=32)
    engine = build_engine(cfg.with_(quant="none,tiny=int4"), info)
    assert (engine.quant, engine.devices) == ("int4", ["cpu:0"])
    engine = build_engine(cfg.with_(quant="int8", quant_form="auto,tiny=w8a8"), info)
    assert set(engine.forms.compute_forms.values()) == {"w8a8"}
    assert build_engine(cfg.with_(quant="fp8"), info).quant == "fp8"
    with pytest.raises(SystemExit) as exit_info:  # one CPU device in this process
        build_engine(cfg.with_(tensor_parallel="2"), info)
    assert exit_info.value.code == EX_CONFIG


def test_auto_quant_keeps_gguf_blocks_only_where_the_kernel_reads_them(monkeypatch, tmp_path,
                                                                      smollm2_dir):  # fmt: skip
    """The default (auto) serves a GGUF decoder from its own blocks through the CPU
    kernel, and float weights wherever the kernel cannot read them: another engine,
    dtype or device count, a float file, an encoder, or no compiler (the image)."""
    from engine import kernels
    from services.worker.engines import parallel_settings, resolve_quant
    from tests.support.tiny_models import build

    assert parallel_settings(Config.from_env({}), catalog.SMOLLM2) == (1, "auto")
    smol = catalog.describe(catalog.SMOLLM2, smollm2_dir)
    build("llama", tmp_path / "tiny", positions=32)
    tiny = catalog.describe("tiny", tmp_path / "tiny")
    minilm = catalog.resolve(catalog.ENCODER)
    kernels.reset()
    try:
        assert resolve_quant("auto", smol, "jax", "float32", 1) == "gguf"
        for engine, dtype, tp in [("torch", "float32", 1), ("jax", "bfloat16", 1),
                                  ("jax", "float32", 2)]:  # fmt: skip
            assert resolve_quant("auto", smol, engine, dtype, tp) == "none"
        assert resolve_quant("auto", tiny, "jax", "float32", 1) == "none"
        assert resolve_quant("auto", minilm, "jax", "float32", 1) == "none"
        assert resolve_quant("int8", tiny, "jax", "float32", 1) == "int8"  # named: kept
        monkeypatch.setenv("CXX", str(tmp_path / "no-such-g++"))
        kernels.reset()
        assert resolve_quant("auto", smol, "jax", "float32", 1) == "none"
        assert resolve_quant("gguf", smol, "jax", "float32", 1) == "gguf"  # named: kept
    finally:
        kernels.reset()


def test_speculation_setting_reaches_the_jax_engine_per_model(tmp_path):
    from services.worker.engines import build_engine
    from tests.support.tiny_models import build

    build("llama", tmp_path, positions=32)
    info = catalog.describe("tiny", tmp_path)
    cfg = Config.from_env({}, data_dir=str(tmp_path / "data"), decode_slots=2, max_context=32)
    assert build_engine(cfg, info).speculation.k == 0  # off by default
    assert build_engine(cfg.with_(speculative="off,tiny=ngram:3"), info).speculation.k == 3
    assert build_engine(cfg.with_(speculative="ngram:2,other=off"), info).speculation.k == 2


def _unserved_encoder(d: Path, config: dict, st_modules: bool = True) -> Path:
    """A model directory holding config files only: the refusal must come from them."""
    import json

    d.mkdir(parents=True, exist_ok=True)
    (d / "config.json").write_text(json.dumps(config))
    if st_modules:
        (d / "modules.json").write_text(json.dumps([
            {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
            {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
        ]))  # fmt: skip
        (d / "1_Pooling").mkdir(exist_ok=True)
        (d / "1_Pooling" / "config.json").write_text(json.dumps({"pooling_mode": "mean"}))
    return d


@pytest.mark.parametrize("config, st_modules, says", [
    ({"model_type": "electra", "architectures": ["ElectraModel"]}, True, "ELECTRA"),
    ({"model_type": "t5", "architectures": ["T5EncoderModel"]}, False, "T5 encoders"),
    ({"model_type": "deberta-v2", "architectures": ["DebertaV2Model"]}, True,
     "disentangled attention"),
    ({"model_type": "bert", "architectures": ["BertForSequenceClassification"],
      "hidden_size": 32, "num_attention_heads": 4, "num_hidden_layers": 1, "num_labels": 3},
     False, "a cross-encoder with 3 labels; the rerank and score endpoints serve"),
])  # fmt: skip
def test_worker_exits_78_on_an_encoder_it_does_not_serve(tmp_path, config, st_modules, says):
    d = _unserved_encoder(tmp_path / "m", config, st_modules)
    assert catalog.describe("m", d).kind == "encoder"  # never run as a decoder
    done = _worker({"TENSORBUS_MODEL": "unserved", "TENSORBUS_MODEL_DIR": str(d)})
    assert done.returncode == EX_CONFIG, done.stderr[-2000:]
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("bad configuration: unserved: ") and says in last, last


def test_build_engine_exits_78_on_a_pooling_it_does_not_serve(tmp_path):
    import json

    from services.worker.engines import build_engine

    d = _unserved_encoder(tmp_path / "m", {"model_type": "bert", "hidden_size": 32,
                                           "num_attention_heads": 4, "num_hidden_layers": 1})
    (d / "1_Pooling" / "config.json").write_text(json.dumps({"pooling_mode": "mean",
                                                             "include_prompt": False}))
    cfg = Config.from_env({}, data_dir=str(tmp_path / "data"))
    with pytest.raises(SystemExit) as exit_info:
        build_engine(cfg, catalog.describe("m", d))
    assert exit_info.value.code == EX_CONFIG


@pytest.mark.parametrize("config, env, says", [
    ({"model_type": "mamba"}, {}, "model_type 'mamba' is not a supported decoder"),
    ({"model_type": "llama", "rope_scaling": {"rope_type": "proportional", "factor": 4.0}},
     {}, "rope scaling 'proportional'"),
    ({"model_type": "qwen3", "head_dim": 8}, {"TENSORBUS_ENGINE": "torch"},
     "q/k norms (Qwen3, Gemma 3): serve this model with TENSORBUS_ENGINE=jax"),
    ({"model_type": "llama"}, {"TENSORBUS_ENGINE": "onnx"},
     "the onnx engine computes sentence encoders only; serve this decoder with "
     "TENSORBUS_ENGINE=jax or torch"),
])  # fmt: skip
def test_worker_exits_78_on_a_decoder_it_does_not_compute(tmp_path, config, env, says):
    import json

    d = tmp_path / "m"
    d.mkdir()
    (d / "config.json").write_text(json.dumps({
        "vocab_size": 16, "hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 1,
        "num_attention_heads": 2, "max_position_embeddings": 64, **config}))
    assert catalog.describe("m", d).kind == "decoder"
    done = _worker({"TENSORBUS_MODEL": "unserved", "TENSORBUS_MODEL_DIR": str(d), **env})
    assert done.returncode == EX_CONFIG, done.stderr[-2000:]
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("bad configuration: unserved: ") and says in last, last
