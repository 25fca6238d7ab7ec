"""Model directories on disk: what gets pushed, hashing while bytes move, safe paths.

The registry never parses weights: it moves bytes and checks their sha256. The format
is read from file names (safetensors, or torch `.bin` which engines load with
`weights_only=True`), except for a GGUF file, whose header (metadata, not tensors) is
read for its config.
"""

from __future__ import annotations

import hashlib
import io
import shutil
from pathlib import Path, PurePosixPath

import msgspec
from nats.js.errors import DigestMismatchError, ObjectNotFoundError

from services.registry.errors import ChecksumError, RegistryError
from shared import gguf
from shared.registry import FileEntry, ModelVersion

GGUF = "gguf"

WEIGHT_SUFFIXES = (".safetensors", ".bin", ".gguf", ".pt", ".pth", ".ckpt", ".h5", ".msgpack",
                   ".onnx", ".npz", ".ot")
"""File name endings of weights: a gateway never fetches these (`gateway_files`)."""

VERIFIED_MARKER = ".tensorbus-version.json"
"""Written into a fetched directory after every file matched its sha256."""


def scan(model_dir: Path) -> list[tuple[str, Path]]:
    """Every regular file under `model_dir` as (relative POSIX path, path), sorted.

    Hidden files and folders (.git, .gitattributes, caches, our marker) are skipped.
    """
    if not (model_dir / "config.json").is_file():
        hint = " (import a GGUF file with import-gguf)" if any(model_dir.glob("*.gguf")) else ""
        raise RegistryError(f"{model_dir} is not a model directory (no config.json){hint}")
    out = []
    for p in sorted(model_dir.rglob("*")):
        rel = p.relative_to(model_dir)
        if any(part.startswith(".") or part == "__pycache__" for part in rel.parts):
            continue
        if p.is_file():
            out.append((rel.as_posix(), p))
    return out


def weight_format(paths: list[str]) -> str:
    names = [PurePosixPath(p).name for p in paths]
    if any(n.endswith(".safetensors") for n in names):
        return "safetensors"
    if any(n.startswith("pytorch_model") and n.endswith(".bin") for n in names):
        return "torch-bin"
    raise RegistryError("no weights found (expected *.safetensors or pytorch_model*.bin)")


def read_gguf(path: Path) -> tuple[gguf.Header, dict]:
    """The header of a GGUF file this project can serve, and the config it stands for."""
    if not path.is_file():
        raise RegistryError(f"{path} is not a file")
    try:
        header = gguf.read_header(path)
        return header, gguf.hf_config(header)
    except (gguf.GGUFError, OSError, KeyError, TypeError) as exc:
        raise RegistryError(f"{path}: {exc}") from None


def gateway_files(entries: list[FileEntry]) -> list[FileEntry]:
    """A directory's files a gateway reads: all but the weights (tokenizer files, chat
    template, config.json, generation and sentence-transformers configs)."""
    return [e for e in entries if not PurePosixPath(e.path).name.endswith(WEIGHT_SUFFIXES)]


def gguf_header_bytes(path: Path, header: gguf.Header) -> bytes:
    """The first bytes of a GGUF file up to its tensor data: metadata (tokenizer and
    chat template included) and tensor table, readable alone as the same header."""
    with open(path, "rb") as f:
        data = f.read(header.size)
    if len(data) != header.size:
        raise RegistryError(f"{path} changed while it was read")
    return data


def sha256_file(path: Path) -> str:
    sha = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            sha.update(chunk)
    return sha.hexdigest()


def safe_join(root: Path, rel: str) -> Path:
    """`root / rel`, refusing paths that would leave `root` (metadata is not trusted)."""
    parts = PurePosixPath(rel).parts
    if not parts or PurePosixPath(rel).is_absolute() or ".." in parts:
        raise RegistryError(f"unsafe file path in metadata: {rel!r}")
    return root.joinpath(*parts)


class UploadAborted(Exception):
    """Raised inside the object store's read loop so that it purges the sent chunks."""


class HashingReader(io.RawIOBase):
    """A file reader that hashes and reports every byte the object store pulls from it.

    The digest is of the bytes actually uploaded, so a file edited mid-push cannot
    leave metadata that disagrees with the stored object. `abort()` makes the next
    read fail (the way to stop an upload at a chunk boundary).
    """

    def __init__(self, f, progress=None) -> None:
        self._f = f
        self._progress = progress
        self._aborted = False
        self.sha = hashlib.sha256()
        self.size = 0

    def readable(self) -> bool:
        return True

    def abort(self) -> None:
        self._aborted = True

    def readinto(self, buf) -> int:
        if self._aborted:
            raise UploadAborted("upload cancelled")
        n = self._f.readinto(buf)
        if n:
            self.sha.update(memoryview(buf)[:n])
            self.size += n
            if self._progress is not None:
                self._progress.update(n)
        return n or 0


class HashingWriter:
    """A file writer that hashes and reports every byte the object store hands it."""

    def __init__(self, f, progress=None) -> None:
        self._f = f
        self._progress = progress
        self.sha = hashlib.sha256()
        self.size = 0

    def write(self, data: bytes) -> int:
        self.sha.update(data)
        self.size += len(data)
        if self._progress is not None:
            self._progress.update(len(data))
        return self._f.write(data)


async def get_checked(objects, obj: str, f, size: int, sha256: str, progress=None) -> None:
    """Object `obj` written into the open file `f`, its bytes hashed as they arrive;
    ChecksumError when it is missing, corrupted, or not `size` bytes of `sha256`."""
    writer = HashingWriter(f, progress)
    try:
        await objects.get(obj, writeinto=writer)
    except ObjectNotFoundError:
        raise ChecksumError(f"{obj} is missing from the object store") from None
    except DigestMismatchError:
        raise ChecksumError(f"{obj} is corrupted in the object store") from None
    if (writer.size, writer.sha.hexdigest()) != (size, sha256):
        raise ChecksumError(f"{obj}: sha256 {writer.sha.hexdigest()} ({writer.size} bytes) does "
                            f"not match the registry's {sha256} ({size} bytes)")


def write_marker(model_dir: Path, mv: ModelVersion) -> None:
    (model_dir / VERIFIED_MARKER).write_bytes(msgspec.json.encode(mv))


def is_verified_copy(model_dir: Path, mv: ModelVersion) -> bool:
    """True when `model_dir` was fetched and verified for exactly this version.

    Sizes are re-checked (cheap); hashes were checked when the copy was made, and
    the directory only became visible after that.
    """
    try:
        seen = msgspec.json.decode((model_dir / VERIFIED_MARKER).read_bytes(), type=ModelVersion)
    except (OSError, msgspec.DecodeError, msgspec.ValidationError):
        return False
    if (seen.name, seen.version, seen.files) != (mv.name, mv.version, mv.files):
        return False
    try:
        return all(safe_join(model_dir, f.path).stat().st_size == f.size for f in mv.files)
    except OSError:
        return False


def file_entry(rel: str, reader: HashingReader | HashingWriter) -> FileEntry:
    return FileEntry(rel, reader.size, reader.sha.hexdigest())


def copy_if_same(local_dir: Path, entry: FileEntry, dest: Path) -> bool:
    """Copy `local_dir`'s file at `entry.path` to `dest` if it has the entry's size and
    sha256 -> whether it did (a bundled model's file is the registry's seed: a worker
    on an empty disk had downloaded the same 98 MB back over the bus, about 2 s)."""
    try:
        src = safe_join(Path(local_dir), entry.path)
        if not src.is_file() or src.stat().st_size != entry.size:
            return False
        if sha256_file(src) != entry.sha256:
            return False
        shutil.copyfile(src, dest)
        return True
    except (OSError, RegistryError):
        return False
