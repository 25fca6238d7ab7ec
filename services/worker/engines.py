"""Which engine a worker builds for a model: kind from the model's files, backend
from `TENSORBUS_ENGINE`, precision from `TENSORBUS_DTYPE` (both per model).

The serving layer sees engines only through engine/interface.py; this is the one
place that picks an implementation.
"""

from __future__ import annotations

from pathlib import Path

from shared import catalog
from shared.config import Config, bad_config

ENGINES = ("jax", "torch")
DTYPES = ("float32", "bfloat16", "float16")


def engine_settings(config: Config, model: str) -> tuple[str, str]:
    """(engine, dtype) for `model`; exits 78 on a value no engine knows."""
    try:
        engine = config.for_model("engine", model) or "jax"
        dtype = config.for_model("dtype", model) or "float32"
    except ValueError as exc:
        raise bad_config(str(exc)) from None
    if engine not in ENGINES:
        raise bad_config(f"TENSORBUS_ENGINE={engine!r} for {model}: use one of {', '.join(ENGINES)}")
    if dtype not in DTYPES:
        raise bad_config(f"TENSORBUS_DTYPE={dtype!r} for {model}: use one of {', '.join(DTYPES)}")
    return engine, dtype


def build_engine(config: Config, info: catalog.ModelInfo):
    """The engine for one model directory, by kind and the model's engine settings."""
    from engine import jaxrt

    backend, dtype = engine_settings(config, info.name)
    jaxrt.setup(str(Path(config.data_dir) / "jax-cache"))
    if info.kind == "encoder":
        kw = dict(name=info.name, dtype=dtype, batch_buckets=config.batch_bucket_list,
                  seq_buckets=config.seq_bucket_list, max_batch=config.max_batch)
        if backend == "torch":
            from engine.torch_encoder import TorchEncoder

            return TorchEncoder(info.path, **kw)
        from engine.encoder import JaxEncoder

        return JaxEncoder(info.path, **kw)
    kw = dict(name=info.name, dtype=dtype, slots=config.decode_slots,
              max_context=config.max_context)
    if backend == "torch":
        from engine.torch_decoder import TorchDecoder

        return TorchDecoder(info.path, **kw)
    from engine.decoder.engine import DecoderEngine

    return DecoderEngine(info.path, kv_block=config.kv_block, kv_blocks=config.kv_blocks,
                         prefill_chunk=config.prefill_chunk, prefix_cache=config.prefix_cache,
                         **kw)
