"""A GGUF file's header (metadata and tensor table) in plain Python, and the Hugging
Face-style config it describes.

The catalogue, the registry and the gateway need a GGUF model's kind, context length,
config and tokenizer without its tensors, and must not import the engine (nor numpy):
this reads only the header, in tens of milliseconds, where `gguf.GGUFReader` builds
numpy views of every field and tensor first (1.7 s for SmolLM2-135M). The engine
reads tensors with `gguf` itself (`engine/gguf.py`).

Layout (little-endian, GGUF v2/v3): magic `GGUF`, u32 version, u64 tensor count, u64
metadata count; then each metadata entry (string key, u32 type, value); then each
tensor (string name, u32 dims, u64 shape[dims] fastest-moving first, u32 ggml type,
u64 offset into the data section).
"""

from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Any

SUFFIX = ".gguf"
_MAGIC = b"GGUF"
_VERSIONS = (2, 3)
_STRING, _ARRAY = 8, 9
# value type -> struct format of one value (8 = string and 9 = array are read apart)
_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?",
            10: "Q", 11: "q", 12: "d"}  # fmt: skip

# Architectures whose tensors and math are Llama's (llama.cpp writes Mistral as llama),
# with Qwen's flags: biases on q/k/v (qwen2), q/k RMSNorm (qwen3).
SUPPORTED_ARCHS = ("llama", "qwen2", "qwen3")
_HF_ARCH = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM",
            "qwen3": "Qwen3ForCausalLM"}  # fmt: skip


class GGUFError(ValueError):
    """Not a GGUF file, or one this project cannot serve."""


@dataclass(frozen=True)
class Header:
    path: str
    version: int
    metadata: dict[str, Any]
    tensors: dict[str, tuple[tuple[int, ...], int]]  # name -> (shape [out, in] order, ggml type)
    size: int = 0  # bytes of the header: its first `size` bytes read alone as this header
    offsets: dict[str, int] = field(default_factory=dict)  # name -> its data's offset

    @property
    def architecture(self) -> str:
        return str(self.metadata.get("general.architecture", ""))

    def arch(self, key: str, default: Any = None) -> Any:
        """An architecture-scoped value: `arch("context_length")` reads `llama.context_length`."""
        return self.metadata.get(f"{self.architecture}.{key}", default)


def find_file(model_dir: str | Path) -> Path | None:
    """The one `*.gguf` file of a model directory, or None when it holds none.

    A directory with config.json is a Hugging Face one whatever else it holds; two
    GGUF files (two quantizations, say) are ambiguous and refused.
    """
    d = Path(model_dir)
    if not d.is_dir() or (d / "config.json").exists():
        return None
    found = sorted(p for p in d.iterdir()
                   if p.suffix == SUFFIX and p.is_file() and not p.name.startswith("."))  # fmt: skip
    if len(found) > 1:
        raise GGUFError(f"{d} holds {len(found)} GGUF files; a model directory holds one")
    return found[0] if found else None


def read_header(path: str | Path) -> Header:
    """Metadata and tensor table of one file; cached while the file is unchanged."""
    st = Path(path).stat()
    return _read_cached(str(Path(path).resolve()), st.st_size, st.st_mtime_ns)


@lru_cache(maxsize=8)
def _read_cached(path: str, size: int, mtime_ns: int) -> Header:
    with open(path, "rb") as f:
        if size < 24:
            raise GGUFError(f"{path} is too short to be a GGUF file")
        with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mm:
            return _parse(path, mm)


def _parse(path: str, buf) -> Header:
    if buf[:4] != _MAGIC:
        raise GGUFError(f"{path} is not a GGUF file (no GGUF magic)")
    version, n_tensors, n_meta = struct.unpack_from("<IQQ", buf, 4)
    if version not in _VERSIONS:
        raise GGUFError(f"{path} is GGUF v{version}; v2 and v3 are supported")
    pos, meta = 24, {}
    try:
        for _ in range(n_meta):
            key, pos = _string(buf, pos)
            (kind,), pos = struct.unpack_from("<I", buf, pos), pos + 4
            meta[key], pos = _value(buf, pos, kind)
        tensors, offsets = {}, {}
        for _ in range(n_tensors):
            name, pos = _string(buf, pos)
            (dims,) = struct.unpack_from("<I", buf, pos)
            shape = struct.unpack_from(f"<{dims}Q", buf, pos + 4)
            pos += 4 + 8 * dims
            ggml_type, offsets[name] = struct.unpack_from("<IQ", buf, pos)
            pos += 12
            tensors[name] = (tuple(reversed(shape)), ggml_type)
    except (struct.error, UnicodeDecodeError, IndexError) as exc:
        raise GGUFError(f"{path}: truncated or damaged GGUF header ({exc})") from None
    if "general.architecture" not in meta:
        raise GGUFError(f"{path} names no general.architecture")
    return Header(path, version, meta, tensors, pos, offsets)


def _string(buf, pos: int) -> tuple[str, int]:
    (n,) = struct.unpack_from("<Q", buf, pos)
    end = pos + 8 + n
    if end > len(buf):
        raise IndexError("string past the end of the file")
    return bytes(buf[pos + 8 : end]).decode("utf-8"), end


def _value(buf, pos: int, kind: int) -> tuple[Any, int]:
    if kind in _SCALARS:
        fmt = "<" + _SCALARS[kind]
        return struct.unpack_from(fmt, buf, pos)[0], pos + struct.calcsize(fmt)
    if kind == _STRING:
        return _string(buf, pos)
    if kind == _ARRAY:
        item, count = struct.unpack_from("<IQ", buf, pos)
        pos += 12
        if item in _SCALARS:  # one unpack for the whole array (token types: 49k int32)
            fmt = f"<{count}{_SCALARS[item]}"
            return list(struct.unpack_from(fmt, buf, pos)), pos + struct.calcsize(fmt)
        out = []
        for _ in range(count):
            value, pos = _value(buf, pos, item)
            out.append(value)
        return out, pos
    raise GGUFError(f"unknown GGUF metadata value type {kind}")


# --- what the header describes


def hf_config(header: Header) -> dict[str, Any]:
    """The Hugging Face `config.json` this file stands for (Llama, Qwen2, Qwen3), key
    for key what transformers' GGUF loader derives, plus the special token ids."""
    arch = header.architecture
    if arch not in SUPPORTED_ARCHS:
        raise GGUFError(f"{header.path}: GGUF architecture {arch!r} is not supported "
                        f"(supported: {', '.join(SUPPORTED_ARCHS)})")  # fmt: skip
    a, m = header.arch, header.metadata
    hidden, heads = int(a("embedding_length")), int(a("attention.head_count"))
    vocab = a("vocab_size") or len(m.get("tokenizer.ggml.tokens") or ()) or None
    if vocab is None:  # counted from the embedding when neither says it
        vocab = header.tensors["token_embd.weight"][0][0]
    cfg: dict[str, Any] = {
        "model_type": arch,
        "architectures": [_HF_ARCH[arch]],
        "hidden_size": hidden,
        "intermediate_size": int(a("feed_forward_length")),
        "num_hidden_layers": int(a("block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(a("attention.head_count_kv", heads)),
        "head_dim": int(a("attention.key_length") or a("rope.dimension_count") or hidden // heads),
        "max_position_embeddings": int(a("context_length", 2048)),
        "rms_norm_eps": float(a("attention.layer_norm_rms_epsilon", 1e-5)),
        "rope_theta": float(a("rope.freq_base", 10000.0)),
        "vocab_size": int(vocab),
        "hidden_act": "silu",
        # llama.cpp writes no output.weight when the head is the embedding.
        "tie_word_embeddings": "output.weight" not in header.tensors,
    }
    if arch != "llama":  # Qwen: biases where the file has them, no sliding window
        cfg["attention_bias"] = "blk.0.attn_q.bias" in header.tensors
        cfg["use_sliding_window"] = False
    scaling = a("rope.scaling.type")
    if "rope_freqs.weight" in header.tensors:
        cfg["rope_scaling"] = llama3_scaling(header, cfg["head_dim"], cfg["rope_theta"])
    elif scaling in ("yarn", "longrope"):  # llama.cpp's own fields: not mapped, so refused
        cfg["rope_scaling"] = {"rope_type": f"{scaling} (GGUF)"}
    elif scaling and scaling != "none":
        cfg["rope_scaling"] = {"rope_type": scaling, "factor": float(a("rope.scaling.factor", 1.0))}
    for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
        value = m.get(f"tokenizer.ggml.{key.replace('pad_', 'padding_')}")
        if value is not None:
            cfg[key] = int(value)
    return cfg


def tensor_f32(header: Header, name: str) -> list[float]:
    """An F32 tensor's values, read from the file (a header alone has none)."""
    shape, kind = header.tensors[name]
    if kind != 0:
        raise GGUFError(f"{header.path}: {name} is GGML type {kind}, not F32")
    count = 1
    for n in shape:
        count *= n
    align = int(header.metadata.get("general.alignment", 32))
    start = -(-header.size // align) * align + header.offsets[name]
    with open(header.path, "rb") as f:
        f.seek(start)
        data = f.read(4 * count)
    if len(data) != 4 * count:
        raise GGUFError(f"{header.path}: {name}'s data is not in the file")
    return list(struct.unpack(f"<{count}f", data))


def llama3_scaling(header: Header, head_dim: int, theta: float) -> dict[str, Any]:
    """The `rope_scaling` a `rope_freqs` tensor stands for. llama.cpp writes Llama 3.1's
    scaling as one factor per frequency (1 at high frequencies, `factor` at low ones,
    a smooth step between, `convert_hf_to_gguf.py`); the step's ends fix low / high
    frequency factors relative to the original context, which the metadata gives
    (8192 when absent: the step depends on their ratios alone). The factors are
    recomputed from what is derived and must match, else the file is refused."""
    import math

    r = tensor_f32(header, "rope_freqs.weight")
    inv = [theta ** (-i / head_dim) for i in range(0, head_dim, 2)]
    factor = max(r)
    orig = int(header.arch("rope.scaling.original_context_length") or 8192)
    mid = [(w / (2 * math.pi), (1 / x - 1 / factor) / (1 - 1 / factor))
           for w, x in zip(inv, r) if 1 + 1e-6 < x < factor - 1e-6]  # (1/wavelength, step)
    if len(mid) < 2:
        raise GGUFError(f"{header.path}: rope_freqs has {len(mid)} values between 1 and its "
                        f"largest; Llama 3's step cannot be read from it")
    (x0, s0), (x1, s1) = mid[0], mid[-1]
    a = (s1 - s0) / (x1 - x0)  # step = a / wavelength + b
    b = s0 - a * x0
    low, high = -b / a * orig, (1 - b) / a * orig
    out = {"rope_type": "llama3", "factor": factor, "low_freq_factor": low,
           "high_freq_factor": high, "original_max_position_embeddings": orig}
    for w, x in zip(inv, r):
        wavelen = 2 * math.pi / w
        step = (orig / wavelen - low) / (high - low)
        want = factor if wavelen > orig / low else 1.0 if wavelen < orig / high else \
            1 / ((1 - step) / factor + step)
        if abs(want - x) > 1e-4 * factor:
            raise GGUFError(f"{header.path}: rope_freqs does not follow Llama 3's scaling "
                            f"({x} where {want} was expected)")
    return out


def context_length(header: Header) -> int:
    return int(header.arch("context_length", 2048))
