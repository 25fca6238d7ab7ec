"""Where the registry keeps things: KV keys, object names, the stream behind the bucket.

The layout itself is documented with the records (`shared/registry.py`). Reading,
pushing and aliases all build keys here, so the three agree by construction.
"""

from __future__ import annotations

from services.registry.errors import RegistryError
from shared import subjects
from shared.registry import NAME_RE, FileEntry, ModelVersion

META_STREAM = f"KV_{subjects.REGISTRY_META}"  # the stream behind the metadata bucket
META_PREFIX = f"$KV.{subjects.REGISTRY_META}."  # its keys' subjects start with this


def _token(s: str) -> str:
    # Dots separate subject tokens; names may contain them, `=` never appears in one.
    return s.replace(".", "=")


def name_of(key: str) -> str:
    """The model name inside a `model.<NAME>...` key."""
    return key.split(".")[1].replace("=", ".")


def version_key(name: str, version: str) -> str:
    return f"model.{_token(name)}.v.{_token(version)}"


def versions_pattern(name: str = "*") -> str:
    """Every version key of `name` (of every model with the default)."""
    return f"model.{_token(name)}.v.*"


def alias_key(name: str) -> str:
    return f"model.{_token(name)}.aliases"


def programs_pattern(name: str, version: str, fingerprint_id: str) -> str:
    """Every compiled program of `name@version` for processes of one fingerprint."""
    return f"programs.{_token(name)}.{_token(version)}.{fingerprint_id}.*"


def program_key(name: str, version: str, fingerprint_id: str, entry: str) -> str:
    return f"programs.{_token(name)}.{_token(version)}.{fingerprint_id}.{_token(entry)}"


def program_object_name(name: str, version: str, fingerprint_id: str, entry: str) -> str:
    """A hidden folder of the version (a push skips hidden folders: no clash)."""
    return object_name(name, version, f".programs/{fingerprint_id}/{entry}")


def object_name(name: str, version: str, path: str) -> str:
    return f"{name}/{version}/{path}"


HEADER_DIR = ".header"
"""Where a GGUF version's header object lives (`NAME/VERSION/.header/FILE`): a push
skips hidden folders, so no pushed file can take that name."""


def tokenizer_object_name(mv: ModelVersion, entry: FileEntry) -> str:
    """The object holding one of `mv.tokenizer`: the version's own file when it is one
    of `mv.files` (a directory's tokenizer.json), else a GGUF file's header."""
    if entry in mv.files:
        return object_name(mv.name, mv.version, entry.path)
    return object_name(mv.name, mv.version, f"{HEADER_DIR}/{entry.path}")


def check_name(what: str, value: str) -> None:
    if not NAME_RE.match(value):
        raise RegistryError(f"invalid {what} {value!r}: use letters, digits, '.', '_', '-'")
