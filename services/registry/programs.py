"""Compiled programs in the registry: a model version's executables, compiled once for
the fleet.

An engine compiles dozens of programs (one per shape it serves); each takes seconds on
a CPU. They are entries of JAX's persistent compilation cache, one file each, named by
a hash of the program, its compile options and the jax version. The registry keeps the
entries a worker compiled under the version and the worker's fingerprint
(engine/jaxrt.py: jax and jaxlib, backend, device kind, CPU features), so the next
worker of the same kind reads them instead of compiling:

  pull     every entry recorded for (name, version, fingerprint) that the local cache
           folder lacks: its record's fingerprint compared field by field with this
           process's, its bytes checked against the record's sha256 and size as they
           arrive, then renamed into the folder (JAX never reads half a file). An entry
           that fails any check is skipped and logged; JAX compiles that program.
  publish  a file of the local folder: bytes to the object store first, then the
           record to the KV bucket, so a record never names missing bytes.

A stale entry (a program nobody asks for any more: another tensorbus, other settings)
is read by nobody: JAX looks entries up by the program's own hash.
"""

from __future__ import annotations

import hashlib
import os
import re
import tempfile
from datetime import UTC, datetime
from pathlib import Path

import msgspec

from services.registry import files as fs
from services.registry.errors import ChecksumError
from services.registry.keys import program_key, program_object_name, programs_pattern
from shared.logging import get_logger
from shared.registry import CompiledProgram

log = get_logger("registry.programs")

ENTRY_RE = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.-]{0,250}-cache$")
"""A cache entry's file name (JAX: `<module>-<hash>-cache`); nothing else is fetched
or published, so no record can name a path outside the cache folder."""


class Shelf:
    """Reads and writes compiled programs; `Registry` hands it its buckets."""

    def __init__(self, kv, objects, scan, actor: str) -> None:
        self._kv = kv
        self._obj = objects
        self._scan = scan  # Registry._scan: the latest entry of every key of a pattern
        self.actor = actor

    async def list(self, name: str, version: str, fingerprint_id: str) -> list[CompiledProgram]:
        out = []
        for entry in await self._scan(programs_pattern(name, version, fingerprint_id)):
            try:
                out.append(msgspec.json.decode(entry.value, type=CompiledProgram))
            except msgspec.DecodeError:
                log.warning("program_record_unreadable", key=entry.key)
        return out

    async def pull(self, name: str, version: str, fingerprint: dict[str, str],
                   fingerprint_id: str, dest: Path) -> tuple[int, int]:
        """The recorded programs `dest` lacks, checked, into `dest` -> (fetched,
        refused)."""
        dest.mkdir(parents=True, exist_ok=True)
        have = set(os.listdir(dest))
        fetched = refused = 0
        for rec in await self.list(name, version, fingerprint_id):
            if rec.entry in have:
                continue
            why = _refusal(rec, name, version, fingerprint)
            if why is None:
                why = await self._download(rec, fingerprint_id, dest)
            if why is not None:
                refused += 1
                log.warning("program_refused", model=name, version=version, entry=rec.entry,
                            reason=why)
                continue
            fetched += 1
        return fetched, refused

    async def _download(self, rec: CompiledProgram, fingerprint_id: str, dest: Path) -> str | None:
        """`rec`'s bytes renamed into `dest` once they match -> None, else why not."""
        obj = program_object_name(rec.name, rec.version, fingerprint_id, rec.entry)
        fd, tmp = tempfile.mkstemp(prefix=".fetch-", dir=dest)
        try:
            with os.fdopen(fd, "wb") as f:
                try:
                    await fs.get_checked(self._obj, obj, f, rec.size, rec.sha256)
                except ChecksumError as exc:
                    return str(exc)
            os.replace(tmp, dest / rec.entry)
            tmp = ""
            return None
        finally:
            if tmp:
                Path(tmp).unlink(missing_ok=True)

    async def publish(self, name: str, version: str, fingerprint: dict[str, str],
                      fingerprint_id: str, path: Path) -> CompiledProgram:
        """One cache entry (a file JAX wrote here) into the registry."""
        if not ENTRY_RE.match(path.name):
            raise ValueError(f"{path.name!r} is not a compilation cache entry")
        data = path.read_bytes()
        rec = CompiledProgram(
            name=name, version=version, entry=path.name, fingerprint=dict(fingerprint),
            size=len(data), sha256=hashlib.sha256(data).hexdigest(),
            created_at=datetime.now(UTC), created_by=self.actor)
        await self._obj.put(program_object_name(name, version, fingerprint_id, path.name), data)
        await self._kv.put(program_key(name, version, fingerprint_id, path.name),
                           msgspec.json.encode(rec))
        return rec


def _refusal(rec: CompiledProgram, name: str, version: str,
             fingerprint: dict[str, str]) -> str | None:
    """Why a record must not be loaded here (None: it may)."""
    if not ENTRY_RE.match(rec.entry):
        return f"{rec.entry!r} is not a compilation cache entry name"
    if (rec.name, rec.version) != (name, version):
        return f"its record is of {rec.name}@{rec.version}"
    if rec.fingerprint != fingerprint:
        differ = sorted(k for k in set(rec.fingerprint) | set(fingerprint)
                        if rec.fingerprint.get(k) != fingerprint.get(k))
        return f"compiled for another process ({', '.join(differ)} differ)"
    return None
