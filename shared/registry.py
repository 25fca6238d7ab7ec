"""The model registry's records, as stored in the JetStream KV bucket `tensorbus_registry`.

Workers, the scheduler and the `tensorbus registry` CLI all read these, so they are part
of the wire contract: JSON (msgspec), new fields get defaults, a breaking change gets a
new key layout. Keys (dots in names and versions are written as `=`):

    model.<NAME>.v.<VERSION>   ModelVersion   one per pushed version
    model.<NAME>.aliases       Aliases        prod / canary; the key's KV history is the
                                              alias history (who served what, when)
    programs.<NAME>.<VERSION>.<FP>.<ENTRY>
                               CompiledProgram one compiled executable of that version,
                                              for processes of fingerprint FP

Weight files live in the Object Store bucket `tensorbus_models` as
`<NAME>/<VERSION>/<relative path>`, compiled programs as
`<NAME>/<VERSION>/.programs/<FP>/<ENTRY>`.
"""

from __future__ import annotations

import re
from datetime import datetime
from typing import Any

import msgspec

NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")
"""Model names and versions: letters, digits, `.`, `_`, `-` (they become KV key tokens)."""

FORMATS = ("safetensors", "torch-bin", "gguf")
KINDS = ("encoder", "decoder")
PENDING = "pending"  # version key reserved, files still uploading
READY = "ready"


class FileEntry(msgspec.Struct, frozen=True):
    path: str  # relative to the model directory, POSIX separators
    size: int  # bytes
    sha256: str  # hex digest of the file's bytes


class ModelVersion(msgspec.Struct, frozen=True, kw_only=True):
    name: str
    version: str
    kind: str  # encoder | decoder (shared.catalog.describe)
    format: str  # safetensors | torch-bin | gguf (one file, stored as it came)
    files: list[FileEntry] = []
    total_size: int = 0  # bytes, sum of files
    max_tokens: int = 0
    created_at: datetime  # aware UTC, when the push claimed this version
    created_by: str = ""  # user@host that pushed it
    lineage: dict[str, str] = {}  # source checkpoint, training data, free keys
    config: dict[str, Any] = {}  # the model's config.json (gguf: derived from its header)
    status: str = READY  # pending while its files upload
    # What a gateway reads (tokenizer, chat template, configs), fetchable without the
    # weights: a directory's files other than weights (the same objects as in `files`);
    # a GGUF file's header, its metadata and tensor table without tensor data, stored
    # as `NAME/VERSION/.header/FILE`. Empty in records pushed before it existed.
    tokenizer: list[FileEntry] = []


class CompiledProgram(msgspec.Struct, frozen=True, kw_only=True):
    """One compiled executable of a model version: an entry of JAX's persistent
    compilation cache, named as JAX names it (a hash of the program, its compile
    options and the jax version), shared by every worker whose `fingerprint` is equal
    (engine/jaxrt.py: jax and jaxlib, backend, device kind, CPU features)."""

    name: str
    version: str
    entry: str  # the cache entry's file name, e.g. "jit_step-<sha256>-cache"
    fingerprint: dict[str, str]  # what a process needs to load it
    size: int
    sha256: str
    created_at: datetime
    created_by: str = ""  # user@host of the process that compiled it


class CanaryGuard(msgspec.Struct, frozen=True, kw_only=True):
    """Opt-in automatic rollback of one canary (`registry canary ... --auto-rollback`).

    The telemetry service compares the canary with prod over the last `window_s`
    and clears the canary when, with at least `min_requests` canary requests seen,
    its error rate (status >= 500) exceeds prod's by more than `error_margin`, or its
    p95 latency exceeds prod's by more than `p95_margin` (a fraction: 0.5 = 50 %)."""

    window_s: float = 60.0
    min_requests: int = 20
    error_margin: float = 0.05
    p95_margin: float = 0.5


class Aliases(msgspec.Struct, frozen=True, kw_only=True):
    """Which versions of a model serve traffic. One KV revision per change."""

    prod: str = ""
    canary: str = ""
    canary_weight: float = 0.0  # share of requests sent to `canary`, in [0, 1]
    updated_at: datetime | None = None  # aware UTC
    previous: list[str] = []  # earlier prod versions, oldest first; rollback pops
    change: str = ""  # what made this revision: promote | canary | rollback | seed | auto-rollback
    by: str = ""  # user@host that made it
    guard: CanaryGuard | None = None  # the canary's automatic rollback, when opted in
    reason: str = ""  # why this revision was made, when a service made it (auto-rollback)
    figures: dict[str, float] = {}  # what the reason was judged on


class AliasChange(msgspec.Struct, frozen=True):
    """One entry of a model's alias history (a KV revision of its aliases key)."""

    revision: int
    at: datetime | None
    change: str
    prod: str
    canary: str
    canary_weight: float
    by: str
    reason: str = ""
    figures: dict[str, float] = {}
    guarded: bool = False  # the canary had automatic rollback on
