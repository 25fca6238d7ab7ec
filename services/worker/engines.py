"""Which engine a worker builds for a model: kind from the model's files, backend
from `TENSORBUS_ENGINE`, precision from `TENSORBUS_DTYPE`, devices from
`TENSORBUS_TENSOR_PARALLEL`, stored weights from `TENSORBUS_QUANT` and how they are
multiplied from `TENSORBUS_QUANT_FORM` and `TENSORBUS_WEIGHT_BUDGET_MB`, a decoder's
speculation from `TENSORBUS_SPECULATIVE` (all per model).

The serving layer sees engines only through engine/interface.py; this is the one
place that picks an implementation.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import TYPE_CHECKING, Any

from services.registry.servable import encoder_refusal
from shared import catalog
from shared.config import Config, bad_config, prefill_chunk_on

if TYPE_CHECKING:  # the engines themselves are imported when one is built
    from engine.interface import Engine

ENGINES = ("jax", "torch", "onnx")  # onnx: encoders only (engine/onnx_encoder.py)
DTYPES = ("float32", "bfloat16", "float16")
# The onnx engine's stored weights: float, or its own int8 graph (refused at build
# when its vectors stray from float32's: engine/onnx_encoder.py).
ONNX_QUANTS = ("auto", "none", "int8")
QUANTS = ("auto", "none", "int8", "int4", "fp8", "gguf")  # engine/quant.py; gguf: the file's own blocks


def _per_model(config: Config, name: str, model: str, default: str) -> str:
    """`model`'s value of a `VALUE[,MODEL=VALUE...]` setting; exits 78 when malformed."""
    try:
        return config.for_model(name, model) or default
    except ValueError as exc:
        raise bad_config(str(exc)) from None


def parallel_settings(config: Config, model: str) -> tuple[int, str]:
    """(tensor parallel degree, quantization) for `model`; exits 78 on a bad value."""
    tp_text = _per_model(config, "tensor_parallel", model, "1")
    quant = _per_model(config, "quant", model, "auto")
    try:
        tp = int(tp_text)
    except ValueError:
        tp = 0
    if tp < 1:
        raise bad_config(f"TENSORBUS_TENSOR_PARALLEL={tp_text!r} for {model}: use a whole number >= 1")
    if quant not in QUANTS:
        raise bad_config(f"TENSORBUS_QUANT={quant!r} for {model}: use one of {', '.join(QUANTS)}")
    return tp, quant


def form_settings(config: Config, model: str, kind: str) -> tuple[str, int]:
    """(compute form, weight budget in bytes) for `model`; exits 78 on a bad value
    or a form its quantization (or an encoder, which runs its stored form) cannot run."""
    from engine import forms

    _, quant = parallel_settings(config, model)
    form = _per_model(config, "quant_form", model, "auto")
    budget_text = _per_model(config, "weight_budget_mb", model, "0")
    if quant == "auto" and form in forms.FORMS:
        raise bad_config(f"TENSORBUS_QUANT_FORM={form!r} for {model}: a forced form needs "
                         f"quantized weights named in TENSORBUS_QUANT (it is 'auto')")  # fmt: skip
    try:
        forms.check_form(form, quant)
    except ValueError as exc:
        raise bad_config(f"TENSORBUS_QUANT_FORM={form!r} for {model}: {exc}") from None
    if kind == "encoder" and form not in ("auto", "float" if quant == "none" else "dequant"):
        raise bad_config(f"TENSORBUS_QUANT_FORM={form!r} for {model}: encoders run their "
                         f"stored weights (auto or dequant)")  # fmt: skip
    try:
        budget = float(budget_text)
    except ValueError:
        budget = -1.0
    if budget < 0:
        raise bad_config(f"TENSORBUS_WEIGHT_BUDGET_MB={budget_text!r} for {model}: use a number >= 0")
    return form, int(budget * 2**20)


def speculative_settings(config: Config, model: str) -> int:
    """Draft tokens per step of `model`'s prompt-lookup speculation (0: off); exits
    78 on a value the engine does not know."""
    from engine.decoder.speculative import parse

    text = _per_model(config, "speculative", model, "off")
    try:
        return parse(text)
    except ValueError as exc:
        raise bad_config(f"TENSORBUS_SPECULATIVE={text!r} for {model}: {exc}") from None


def _check_gguf_blocks(info: catalog.ModelInfo) -> None:
    """Exit 78 unless the model is one GGUF file whose blocks the engine can keep."""
    if info.kind == "encoder":
        raise bad_config(f"TENSORBUS_QUANT='gguf' for {info.name}: encoders are not read from GGUF")
    from engine.decoder.config import load_config
    from engine.decoder.model import gguf_blocks

    try:
        gguf_blocks(info.path, load_config(info.path))
    except ValueError as exc:
        raise bad_config(f"TENSORBUS_QUANT='gguf' for {info.name}: {exc}") from None


def resolve_quant(quant: str, info: catalog.ModelInfo, engine: str, dtype: str, tp: int) -> str:
    """The stored weights to build: `quant` itself unless it is "auto", the default,
    which keeps a GGUF decoder's own blocks ("gguf") where the CPU kernel reads them
    (the jax engine, float32, one device, the kernel built here) and holds float
    weights ("none") everywhere else: on a GPU, without a C++ compiler (the image),
    for a file whose block types the engine does not keep, and for every encoder.
    Without the kernel the blocks run through XLA's dequantizing matmul, several times
    slower than float32 (docs/decisions/0062)."""
    if quant != "auto":
        return quant
    if info.kind != "decoder" or engine != "jax" or dtype != "float32" or tp != 1:
        return "none"
    from engine.decoder.config import load_config
    from engine.decoder.model import gguf_blocks

    try:
        if not gguf_blocks(info.path, load_config(info.path)):
            return "none"  # a float file: nothing to keep
    except ValueError:
        return "none"
    import jax

    from engine import kernels

    if jax.default_backend() != "cpu" or kernels.compiler() is None:
        return "none"  # asked first: `load` would warn of a fallback that auto does not take
    return "gguf" if kernels.load() is not None else "none"


def check_encoder(info: catalog.ModelInfo) -> None:
    """Exit 78 when the encoder engines do not serve the model's architecture,
    sentence-transformers modules or pooling (read from its config files alone)."""
    if info.kind != "encoder":
        return
    why = encoder_refusal(info.path)
    if why is not None:
        raise bad_config(f"{info.name}: {why}")


def check_decoder(info: catalog.ModelInfo, engine: str) -> None:
    """Exit 78 when the decoder engine asked for does not compute the model's
    architecture (read from its config alone): the reason, never an approximation."""
    if info.kind != "decoder":
        return
    if engine == "onnx":
        raise bad_config(f"{info.name}: the onnx engine computes sentence encoders only; "
                         f"serve this decoder with TENSORBUS_ENGINE=jax or torch")
    from engine.decoder.config import UnsupportedDecoder, load_config

    try:
        cfg = load_config(info.path)
        if engine == "torch":
            from engine.torch_decoder.model import check_served

            check_served(cfg)
    except UnsupportedDecoder as exc:
        raise bad_config(f"{info.name}: {exc}") from None


def check_split(config: Config, info: catalog.ModelInfo) -> None:
    """Exit 78 when the model's heads or MLP columns do not split over its devices."""
    from engine import sharding

    tp, _ = parallel_settings(config, info.name)
    if tp == 1:
        return
    if info.kind == "encoder":
        from engine.encoder.config import BertConfig

        bert = BertConfig(info.path)
        sizes = dict(attention_heads=bert.heads, mlp_columns=bert.intermediate)
    else:
        from engine.decoder.config import load_config

        cfg = load_config(info.path)
        sizes = dict(query_heads=cfg.heads, kv_heads=cfg.kv_heads, mlp_columns=cfg.intermediate)
    try:
        sharding.check_divisible(info.name, tp, **sizes)
    except sharding.ShardingError as exc:
        raise bad_config(str(exc)) from None


def _check_onnx(model: str, tp: int, quant: str, dtype: str) -> None:
    """Exit 78 unless the onnx engine can run `model` so: it exports its graph with
    torch and runs it on ONNX Runtime's CPU provider, one device, float32 or int8."""
    missing = [m for m in ("onnxruntime", "onnx", "torch") if importlib.util.find_spec(m) is None]
    if missing:
        raise bad_config(f"TENSORBUS_ENGINE=onnx for {model}: {', '.join(missing)} not installed "
                         f"here (the image leaves torch out: pip install onnxruntime==1.30.0 "
                         f"onnx==1.23.1 torch==2.13.0)")  # fmt: skip
    if tp > 1 or quant not in ONNX_QUANTS:
        raise bad_config(f"{model}: the onnx engine runs on one device with float or int8 "
                         f"weights (TENSORBUS_QUANT={', '.join(ONNX_QUANTS)}); "
                         f"TENSORBUS_TENSOR_PARALLEL={tp} and TENSORBUS_QUANT={quant!r} need "
                         f"TENSORBUS_ENGINE=jax")  # fmt: skip
    if dtype != "float32":
        raise bad_config(f"{model}: the onnx engine computes float32 (ONNX Runtime's CPU "
                         f"kernels for {dtype} are few and slower): TENSORBUS_DTYPE={dtype!r} "
                         f"needs TENSORBUS_ENGINE=jax or torch")  # fmt: skip


def engine_settings(config: Config, model: str,
                    info: catalog.ModelInfo | None = None) -> tuple[str, str]:
    """(engine, dtype) for `model`; exits 78 on a value no engine knows, a tensor
    parallel degree or quantization the backend does not run, or (for `info`, else
    the model's directory when it is known here) heads that do not split over the
    devices asked for, GGUF blocks the engine cannot keep, or an encoder the encoder
    engines do not serve."""
    tp, quant = parallel_settings(config, model)
    form_settings(config, model, "decoder")  # the encoder's narrower check: at build
    speculative_settings(config, model)
    engine = _per_model(config, "engine", model, "jax")
    dtype = _per_model(config, "dtype", model, "float32")
    if engine not in ENGINES:
        raise bad_config(f"TENSORBUS_ENGINE={engine!r} for {model}: use one of {', '.join(ENGINES)}")
    if dtype not in DTYPES:
        raise bad_config(f"TENSORBUS_DTYPE={dtype!r} for {model}: use one of {', '.join(DTYPES)}")
    if engine == "torch" and importlib.util.find_spec("torch") is None:
        raise bad_config(f"TENSORBUS_ENGINE=torch for {model}: torch is not installed here "
                         f"(the image leaves it out: pip install torch==2.13.0)")
    if engine == "torch" and (tp > 1 or quant not in ("none", "auto")):
        raise bad_config(f"{model}: the torch engine runs on one device with float weights; "
                         f"TENSORBUS_TENSOR_PARALLEL={tp} and TENSORBUS_QUANT={quant!r} need "
                         f"TENSORBUS_ENGINE=jax")  # fmt: skip
    if engine == "onnx":
        _check_onnx(model, tp, quant, dtype)
    local = bool(config.model_dir) and catalog.is_model_dir(config.model_dir)
    if info is None and (tp > 1 or quant == "gguf" or local):
        info = catalog.resolve(model, config.model_dir)
    if info is not None:
        check_encoder(info)
        check_decoder(info, engine)
        check_split(config, info)
        if quant == "gguf":
            _check_gguf_blocks(info)
    return engine, dtype


def prefill_chunk(config: Config) -> int:
    """TENSORBUS_PREFILL_CHUNK, or its default on this process's device where it is 0
    (shared.config.prefill_chunk_on: the schedulers read the same from heartbeats)."""
    if config.prefill_chunk > 0:
        return config.prefill_chunk
    import jax

    return prefill_chunk_on(0, jax.default_backend())


def cache_folder(config: Config) -> Path:
    """The compilation cache (and the engines' prepared weights, kernels and, under
    onnx-encoders/, the onnx engine's exported graphs)."""
    return Path(config.data_dir) / "jax-cache"


def build_engine(config: Config, info: catalog.ModelInfo) -> Engine:
    """The engine for one model directory, by kind and the model's engine settings."""
    from engine import jaxrt
    from engine.encoder.spec import UnsupportedEncoder
    from engine.sharding import ShardingError

    backend, dtype = engine_settings(config, info.name, info)
    tp, quant = parallel_settings(config, info.name)
    form, budget = form_settings(config, info.name, info.kind)
    jaxrt.setup(str(cache_folder(config)))  # before the kernel's cache dir is read
    quant = resolve_quant(quant, info, backend, dtype, tp)
    try:
        return _build(config, info, backend, dtype, tp, quant, form, budget)
    except ShardingError as exc:  # e.g. fewer devices than asked for
        raise bad_config(str(exc)) from None
    except UnsupportedEncoder as exc:  # an architecture, module or pooling not served
        raise bad_config(f"{info.name}: {exc}") from None


def _build(config: Config, info: catalog.ModelInfo, backend: str, dtype: str, tp: int, quant: str,
           form: str = "auto", budget: int = 0) -> Engine:
    kw: dict[str, Any]  # the arguments every backend of the kind takes
    if info.kind == "encoder":
        kw = dict(name=info.name, dtype=dtype, batch_buckets=config.batch_bucket_list,
                  seq_buckets=config.seq_bucket_list, max_batch=config.max_batch)
        if backend == "torch":
            from engine.torch_encoder import TorchEncoder

            return TorchEncoder(info.path, **kw)
        if backend == "onnx":  # its exported graphs kept beside the compilation cache
            from engine.onnx_encoder import OnnxEncoder

            return OnnxEncoder(info.path, quant=quant,
                               cache_dir=cache_folder(config) / "onnx-encoders", **kw)
        from engine.encoder import EncoderEngine

        # "first": ready after a first set, the rest compiled in the background; an
        # encoder's "lazy" compiles every bucket at warm-up as before (a handful of
        # seconds; the tests' in-process stacks use it to skip decoder programs).
        ahead = "first" if config.compile_ahead == "first" else "all"
        return EncoderEngine(info.path, tensor_parallel=tp, quant=quant, compile_ahead=ahead,
                             **kw)
    kw = dict(name=info.name, dtype=dtype, slots=config.decode_slots,
              max_context=config.max_context)
    if backend == "torch":
        from engine.torch_decoder import TorchDecoder

        return TorchDecoder(info.path, **kw)
    from engine.decoder.engine import DecoderEngine

    return DecoderEngine(info.path, kv_block=config.kv_block, kv_blocks=config.kv_blocks,
                         prefill_chunk=prefill_chunk(config), prefix_cache=config.prefix_cache,
                         mixed_steps=config.mixed_steps, compile_ahead=config.compile_ahead, attention=config.attention,
                         tensor_parallel=tp, quant=quant, quant_form=form,
                         weight_budget=budget,
                         speculative=speculative_settings(config, info.name), **kw)  # fmt: skip
