"""Model weights from a Hugging Face directory into a flat {name: numpy array} dict.

Order of preference:
  1. `model.safetensors`
  2. sharded `model-0000x-of-0000y.safetensors` listed by `model.safetensors.index.json`
  3. `pytorch_model.bin` (or its sharded index), via `torch.load(weights_only=True)`;
     never a plain unpickle.
  4. a directory without config.json holding one `*.gguf` file: dequantized to
     float32 under Hugging Face names (engine/gguf.py).

safetensors files are read by this module directly (an 8-byte header length, a JSON
header, raw little-endian bytes): `safetensors.numpy` refuses bfloat16 because numpy
has no such dtype, while `ml_dtypes.bfloat16` (shipped with jax) represents it exactly.

A checkpoint whose config.json has a `quantization_config` is served or refused as
engine/prequant.py says: its float8 weights come back dequantized to float32 (their
scales applied), so no reader of these dicts ever sees a stored float8 weight.
"""

from __future__ import annotations

import json
import mmap
import struct
from pathlib import Path
from typing import Iterable, Mapping

import numpy as np

from shared.logging import get_logger

log = get_logger(__name__)

SAFETENSORS = "model.safetensors"
SAFETENSORS_INDEX = "model.safetensors.index.json"
TORCH_BIN = "pytorch_model.bin"
TORCH_BIN_INDEX = "pytorch_model.bin.index.json"
COMMON_PREFIXES = ("bert.", "model.", "transformer.", "roberta.")

Weights = dict[str, np.ndarray]


def _numpy_dtype(code: str) -> np.dtype:
    """safetensors dtype code -> numpy dtype (bf16 and fp8 through ml_dtypes)."""
    plain = {
        "F64": np.float64, "F32": np.float32, "F16": np.float16,
        "I64": np.int64, "I32": np.int32, "I16": np.int16, "I8": np.int8,
        "U64": np.uint64, "U32": np.uint32, "U16": np.uint16, "U8": np.uint8,
        "BOOL": np.bool_,
    }  # fmt: skip
    if code in plain:
        return np.dtype(plain[code]).newbyteorder("<")
    import ml_dtypes

    extra = {
        "BF16": ml_dtypes.bfloat16,
        "F8_E4M3": ml_dtypes.float8_e4m3fn,
        "F8_E5M2": ml_dtypes.float8_e5m2,
        # power-of-two block scales (DeepSeek's "ue8m0"), in ml_dtypes >= 0.5
        "F8_E8M0": getattr(ml_dtypes, "float8_e8m0fnu", None),
    }
    if extra.get(code) is None:
        raise ValueError(f"unsupported safetensors dtype {code!r}")
    return np.dtype(extra[code])


def read_safetensors(path: str | Path) -> Weights:
    """Every tensor of one .safetensors file, copied out of a read-only mapping."""
    out: Weights = {}
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mm:
        (header_len,) = struct.unpack("<Q", mm[:8])
        header = json.loads(mm[8 : 8 + header_len])
        base = 8 + header_len
        for name, info in header.items():
            if name == "__metadata__":
                continue
            start, end = info["data_offsets"]
            dtype = _numpy_dtype(info["dtype"])
            flat = np.frombuffer(mm, dtype=dtype, count=(end - start) // dtype.itemsize,
                                 offset=base + start)  # fmt: skip
            out[name] = flat.reshape(info["shape"]).copy()
            del flat  # the mapping cannot close while a view of it is alive
    return out


def _torch_to_numpy(t) -> np.ndarray:
    import torch

    t = t.detach().cpu().contiguous()
    import ml_dtypes

    # Same bits, reinterpreted (numpy has none of these dtypes): no rounding through
    # float32 and back.
    if t.dtype == torch.bfloat16:
        return t.view(torch.int16).numpy().view(ml_dtypes.bfloat16).copy()
    float8 = {torch.float8_e4m3fn: ml_dtypes.float8_e4m3fn,
              torch.float8_e5m2: ml_dtypes.float8_e5m2}  # fmt: skip
    if t.dtype in float8:
        return t.view(torch.uint8).numpy().view(float8[t.dtype]).copy()
    return t.numpy().copy()


def read_torch_bin(path: str | Path) -> Weights:
    import torch

    state = torch.load(str(path), map_location="cpu", weights_only=True)
    if isinstance(state, dict) and "state_dict" in state:
        state = state["state_dict"]
    return {k: _torch_to_numpy(v) for k, v in state.items() if isinstance(v, torch.Tensor)}


def _shards(model_dir: Path, index_name: str) -> list[Path]:
    index = json.loads((model_dir / index_name).read_text())
    files = sorted(set(index["weight_map"].values()))
    return [model_dir / name for name in files]


def weight_files(model_dir: str | Path) -> list[Path]:
    """The files `load_weights` reads, in the order of preference above."""
    d = Path(model_dir)
    if (d / SAFETENSORS).exists():
        return [d / SAFETENSORS]
    if (d / SAFETENSORS_INDEX).exists():
        return _shards(d, SAFETENSORS_INDEX)
    shards = sorted(d.glob("model-*-of-*.safetensors"))
    if shards:
        return shards
    if (d / TORCH_BIN).exists():
        return [d / TORCH_BIN]
    if (d / TORCH_BIN_INDEX).exists():
        return _shards(d, TORCH_BIN_INDEX)
    from shared.gguf import find_file

    gguf_file = find_file(d)
    if gguf_file is not None:
        return [gguf_file]
    raise FileNotFoundError(f"no model.safetensors, pytorch_model.bin or .gguf file in {d}")


def _read(path: Path) -> Weights:
    if path.suffix == ".safetensors":
        return read_safetensors(path)
    if path.suffix == ".gguf":
        from engine.gguf import load_weights as read_gguf

        return read_gguf(path)
    return read_torch_bin(path)


def load_weights(model_dir: str | Path) -> Weights:
    """All tensors of a model directory, as numpy arrays in their stored dtype; a
    pre-quantized checkpoint's float8 weights dequantized to float32 (engine/prequant.py:
    `UnsupportedQuantization` for a method that is not served)."""
    from engine import prequant

    found = prequant.read_scheme(model_dir)  # refused before any bytes are read
    out: Weights = {}
    for path in weight_files(model_dir):
        part = _read(path)
        overlap = out.keys() & part.keys()
        if overlap:
            raise ValueError(f"tensor {sorted(overlap)[0]!r} appears in two shards")
        out.update(part)
    out, n = prequant.dequantize(out, found)
    if found is not None:
        log.info("prequantized_weights_dequantized", method=found.method, tensors=n,
                 computed_in_float=", ".join(found.ignored) or None)
    return out


def strip_prefix(weights: Mapping[str, np.ndarray],
                 prefixes: Iterable[str] = COMMON_PREFIXES) -> Weights:  # fmt: skip
    """Drop a leading wrapper name ("bert.", "model.", ...) so one loader fits both
    a bare `BertModel` checkpoint and a `BertForMaskedLM` one. Names without a prefix
    (task heads such as "cls.predictions...") are kept as they are."""
    prefixes = tuple(prefixes)
    out: Weights = {}
    for name, value in weights.items():
        short = next((name[len(p) :] for p in prefixes if name.startswith(p)), name)
        if short in out:
            raise ValueError(f"{name!r} and another tensor both map to {short!r}")
        out[short] = value
    return out
