"""Prepared weights kept on disk, so a restart skips reading and converting the model.

Turning a model's files into the host-side parameter trees the decoder runs (a GGUF
file's blocks dequantized to float32, q/k rows un-permuted, matrices transposed and
fused, quantized forms built) takes seconds each start; reading the result back
takes a fraction of one. So:

1. `key(sources, fields, folder)`: the identity of what would be built: each source
   file's size and SHA-256 (the weights, and a decoder's config.json, whose
   quantization_config says how stored weights read; hashed once per file:
   `content_hash` remembers it by the file's path, size, modification time and
   inode), the form's fields (family,
   config, quantization, forms) and a hash of the code that builds the trees, so an
   update that changes their layout never reads an old entry. Bytes, not paths: the
   registry's fetched copy of the bundled file finds the entry the bundled file made.
2. `load_or_build(folder, sources, fields, build)`: the entry named by the key if
   there is one, read as safetensors (a JSON header and raw little-endian bytes;
   nothing is unpickled), else `build()`, written as one safetensors file (a
   temporary file, then a rename: a reader never sees half a file, and two workers
   writing the same entry both leave a whole one). A changed source file gets a new
   key; an unreadable entry is built again.
3. After a write, the least recently used entries go while the folder holds more
   than `MAX_BYTES` (a read counts as a use).

A tree is dicts, lists, numpy arrays, None and `engine.quant.QWeight`s; its shape is
kept in the file's metadata as JSON, with each array named there by its tensor.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Callable, Iterable

import numpy as np

from shared.logging import get_logger

log = get_logger(__name__)

DIR_NAME = "prepared-weights"  # inside the JAX compilation cache directory
INDEX_NAME = "sources.json"  # source file (path, size, time, inode) -> its SHA-256
MAX_BYTES = 8 << 30  # all entries together; the oldest go first
FORMAT = 1
# Modules whose code decides what a built tree holds.
_CODE = ("engine/prepared.py", "engine/gguf.py", "engine/weights.py", "engine/quant.py",
         "engine/prequant.py", "engine/decoder/model.py", "engine/decoder/llama.py",
         "engine/decoder/gpt2.py")  # fmt: skip
_ROOT = Path(__file__).resolve().parent.parent

Tree = dict


def directory(explicit: str | os.PathLike | None = "") -> Path | None:
    """`explicit`, or (given "") a folder inside the JAX compilation cache when one is
    set; None: no cache (every start builds)."""
    if explicit is None:
        return None
    if explicit:
        return Path(explicit)
    import jax

    cache_dir = jax.config.jax_compilation_cache_dir  # type: ignore[attr-defined]  # unstubbed flag
    return Path(cache_dir) / DIR_NAME if cache_dir else None


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(1 << 22):
            h.update(chunk)
    return h.hexdigest()


def content_hash(path: Path, folder: Path) -> str:
    """SHA-256 of a source file's bytes, remembered in `folder` by the file's path,
    size, modification time and inode, so a file is read for it once: a copy of the
    same bytes elsewhere (the registry's fetched copy of a bundled file) has the same
    hash and finds the same entry."""
    st = path.stat()
    where = f"{path.resolve()}|{st.st_size}|{st.st_mtime_ns}|{st.st_ino}"
    index_path = folder / INDEX_NAME
    try:
        index = json.loads(index_path.read_text())
    except (OSError, ValueError):
        index = {}
    if where in index:
        return index[where]
    # Files no longer where they were are forgotten: the index stays small.
    index = {k: v for k, v in index.items() if Path(k.rsplit("|", 3)[0]).exists()}
    digest = index[where] = _sha256(path)
    try:
        folder.mkdir(parents=True, exist_ok=True)
        tmp = index_path.with_name(f".{INDEX_NAME}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(index, indent=1, sort_keys=True))
        os.replace(tmp, index_path)
    except OSError as exc:  # a read-only folder: hashed again next time
        log.warning("prepared_weights_index_not_kept", path=str(index_path), error=str(exc))
    return digest


def _code_hash() -> str:
    h = hashlib.sha256()
    for rel in _CODE:
        h.update((_ROOT / rel).read_bytes())
    return h.hexdigest()


def key(sources: Iterable[Path], fields: dict, folder: Path) -> str:
    """The entry's name: the format, the building code, the form's fields and each
    source file's size and content hash (not its path or time)."""
    files = [{"size": Path(p).stat().st_size, "sha256": content_hash(Path(p), folder)}
             for p in sources]  # fmt: skip
    doc = {"format": FORMAT, "code": _code_hash(), "fields": fields, "sources": files}
    text = json.dumps(doc, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:32]


# --- a tree as named arrays plus a JSON skeleton


def flatten(trees: dict[str, Tree]) -> tuple[dict[str, np.ndarray], dict]:
    """{form: tree} -> ({tensor name: array}, skeleton); TypeError for a leaf this
    format does not hold."""
    from engine.quant import QWeight

    arrays: dict[str, np.ndarray] = {}

    def walk(node, name: str):
        if node is None:
            return None
        if isinstance(node, dict):
            return {"d": {k: walk(v, f"{name}.{k}") for k, v in node.items()}}
        if isinstance(node, list):
            return {"l": [walk(v, f"{name}.{i}") for i, v in enumerate(node)]}
        if isinstance(node, QWeight):
            parts = {f: walk(getattr(node, f), f"{name}.{f}") for f in ("q", "scale", "offset")}
            static = {"axis": node.axis, "bits": node.bits, "group": node.group,
                      "compute": node.compute}  # fmt: skip
            return {"q": {**parts, **static}}
        if isinstance(node, np.ndarray):
            arrays[name] = np.ascontiguousarray(node)
            return {"t": name}
        raise TypeError(f"{name}: a {type(node).__name__} is not kept in a prepared-weights file")

    skeleton = {form: walk(tree, form) for form, tree in trees.items()}
    return arrays, skeleton


def unflatten(arrays: dict[str, np.ndarray], skeleton: dict) -> dict[str, Tree]:
    from engine.quant import QWeight

    def build(node):
        if node is None:
            return None
        if "t" in node:
            return arrays[node["t"]]
        if "d" in node:
            return {k: build(v) for k, v in node["d"].items()}
        if "l" in node:
            return [build(v) for v in node["l"]]
        q = node["q"]
        return QWeight(build(q["q"]), build(q["scale"]), build(q["offset"]), q["axis"],
                       q["bits"], q["group"], q["compute"])  # fmt: skip

    return {form: build(node) for form, node in skeleton.items()}


# --- the file


def _dtype_code(dtype: np.dtype) -> str:
    import ml_dtypes

    codes = {np.dtype(np.float64): "F64", np.dtype(np.float32): "F32",
             np.dtype(np.float16): "F16", np.dtype(np.int64): "I64", np.dtype(np.int32): "I32",
             np.dtype(np.int16): "I16", np.dtype(np.int8): "I8", np.dtype(np.uint64): "U64",
             np.dtype(np.uint32): "U32", np.dtype(np.uint16): "U16", np.dtype(np.uint8): "U8",
             np.dtype(np.bool_): "BOOL", np.dtype(ml_dtypes.bfloat16): "BF16",
             np.dtype(ml_dtypes.float8_e4m3fn): "F8_E4M3",
             np.dtype(ml_dtypes.float8_e5m2): "F8_E5M2"}  # fmt: skip
    code = codes.get(np.dtype(dtype).newbyteorder("="))
    if code is None:
        raise TypeError(f"dtype {dtype} is not kept in a prepared-weights file")
    return code


def write(path: Path, arrays: dict[str, np.ndarray], metadata: dict[str, str]) -> None:
    """One safetensors file, atomically: written beside `path`, then renamed onto it."""
    header: dict = {"__metadata__": metadata}
    offset = 0
    # Widest items first: every tensor then starts at a multiple of its item size.
    arrays = dict(sorted(arrays.items(), key=lambda kv: -kv[1].dtype.itemsize))
    for name, a in arrays.items():
        header[name] = {"dtype": _dtype_code(a.dtype), "shape": list(a.shape),
                        "data_offsets": [offset, offset + a.nbytes]}  # fmt: skip
        offset += a.nbytes
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)  # the data starts 8-byte aligned
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        with tmp.open("wb") as f:
            f.write(len(text).to_bytes(8, "little"))
            f.write(text)
            for a in arrays.values():
                f.write(a.astype(a.dtype.newbyteorder("<"), copy=False).tobytes())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def read(path: Path) -> dict[str, Tree]:
    """An entry's trees. The file is read in one call into one buffer and every array
    is a view of it (a third of the time of a copy per tensor); nothing is unpickled."""
    from engine.weights import _numpy_dtype

    with path.open("rb") as f:
        header_len = int.from_bytes(f.read(8), "little")
        header = json.loads(f.read(header_len))
        buf = np.empty(os.fstat(f.fileno()).st_size - 8 - header_len, np.uint8)
        # numpy's stubs give ndarray __buffer__ only from Python 3.12
        if f.readinto(buf) != buf.size:  # type: ignore[arg-type]
            raise ValueError(f"{path}: shorter than its header says")
    arrays = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        start, end = info["data_offsets"]
        dtype = _numpy_dtype(info["dtype"])
        arrays[name] = buf[start:end].view(dtype).reshape(info["shape"])
    return unflatten(arrays, json.loads(header["__metadata__"]["skeleton"]))


def _evict(folder: Path, keep: Path) -> None:
    """The least recently used entries go while the folder holds more than MAX_BYTES."""
    entries = []
    for p in folder.glob("*.safetensors"):
        try:
            if p != keep:
                st = p.stat()
                entries.append((st.st_mtime, st.st_size, p))
        except FileNotFoundError:  # another worker evicted it
            continue
    total = keep.stat().st_size + sum(size for _, size, _ in entries)
    for _, size, p in sorted(entries):
        if total <= MAX_BYTES:
            break
        p.unlink(missing_ok=True)
        total -= size
        log.info("prepared_weights_removed", path=str(p))


def load_or_build(folder: Path | None, sources: list[Path], fields: dict,
                  build: Callable[[], dict[str, Tree]]) -> tuple[dict[str, Tree], str]:
    """(trees, how): how is "cache" (read from an entry), "built" (and written) or
    "built, not kept" (no folder, or the trees or the disk would not take it)."""
    if folder is None:
        return build(), "built, not kept"
    path = folder / f"{key(sources, fields, folder)}.safetensors"
    if path.exists():
        try:
            trees = read(path)
        except (OSError, ValueError, KeyError) as exc:  # truncated or foreign: build again
            log.warning("prepared_weights_unreadable", path=str(path), error=str(exc))
        else:
            os.utime(path)  # recently used: the last to be evicted
            log.info("prepared_weights_read", path=str(path))
            return trees, "cache"
    trees = build()
    try:
        arrays, skeleton = flatten(trees)
        write(path, arrays, {"skeleton": json.dumps(skeleton), "fields": json.dumps(fields,
              default=str)})  # fmt: skip
        _evict(folder, path)
    except (OSError, TypeError) as exc:
        log.warning("prepared_weights_not_kept", path=str(path), error=str(exc))
        return trees, "built, not kept"
    log.info("prepared_weights_written", path=str(path), bytes=path.stat().st_size)
    return trees, "built"
