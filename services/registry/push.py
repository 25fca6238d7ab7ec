"""Pushing one version into the registry, and undoing a push that did not finish.

1. Scan the directory (HF layout), read kind from config.json, format from file names.
   (`import_gguf`: one GGUF file, kind and config from its header, sha256 first.)
2. Reserve the version key in KV with `create` (status pending): two pushers can never
   take the same version; auto versions retry with the next integer. An explicit
   version whose reservation was abandoned long ago is taken over.
3. Stream every file into the Object Store as `NAME/VERSION/PATH`, hashing the bytes
   as they are uploaded. The record's `tokenizer` lists what a gateway reads without
   the weights: a directory's other files; for a GGUF file, its header, uploaded on
   its own as `NAME/VERSION/.header/FILE`.
4. Replace the pending record with the ready one (revision-checked update).

Any failure or cancellation after step 2 runs the undo: delete the uploaded objects,
then purge the reservation, stopping at the first call that fails.
"""

from __future__ import annotations

import asyncio
import contextlib
import io
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Awaitable, Callable

import msgspec
from nats.js import api
from nats.js.errors import KeyNotFoundError, KeyWrongLastSequenceError, ObjectNotFoundError
from tqdm import tqdm

from services.registry import files as fs
from services.registry.election import through
from services.registry.errors import RegistryError, VersionExists
from services.registry.keys import HEADER_DIR, check_name, object_name, version_key
from shared import catalog, gguf
from shared.logging import get_logger
from shared.registry import PENDING, READY, FileEntry, ModelVersion

log = get_logger("registry")

CHUNK_SIZE = 256 * 1024  # below the server's default 1 MiB max payload
STALE_PENDING = timedelta(minutes=15)  # a reservation this old was abandoned
_CAS_ATTEMPTS = 16

Records = Callable[[str], Awaitable[list[ModelVersion]]]
"""Every version record of a model, pending ones included (`Registry.records`)."""


class Pusher:
    """Uploads versions; `records` tells which versions a model has already."""

    def __init__(self, kv, objects, records: Records, actor: str, nc=None) -> None:
        self._kv = kv
        self._obj = objects
        self._records = records
        self._actor = actor
        self._nc = nc  # the connection, where known: the undo skips calls while it is down

    async def push(self, model_dir: str | Path, name: str, version: str | None = None,
                   lineage: dict[str, str] | None = None, progress: bool = True) -> ModelVersion:
        """Upload a model directory as a new version; returns its metadata."""
        check_name("model name", name)
        if version is not None:
            check_name("version", version)
        model_dir = Path(model_dir)
        paths = fs.scan(model_dir)
        info = catalog.describe(name, model_dir)
        fmt = fs.weight_format([rel for rel, _ in paths])
        config = msgspec.json.decode((model_dir / "config.json").read_bytes())
        draft = ModelVersion(
            name=name, version=version or "", kind=info.kind, format=fmt,
            max_tokens=info.max_tokens, created_at=_now(), created_by=self._actor,
            lineage=dict(lineage or {}), config=config, status=PENDING,
        )
        return await self._publish(draft, paths, progress, explicit=version is not None)

    async def import_gguf(self, path: str | Path, name: str, version: str | None = None,
                          lineage: dict[str, str] | None = None,
                          progress: bool = True) -> ModelVersion:
        """Upload one GGUF file, byte for byte, as a new version (format `gguf`).

        Its config is read from the header (a Llama-family decoder), the lineage gets
        the source file's name and sha256; a fetch gives a directory holding the file,
        which the engines load as a model directory.
        """
        check_name("model name", name)
        if version is not None:
            check_name("version", version)
        path = Path(path)
        header, config = fs.read_gguf(path)
        head = await asyncio.to_thread(fs.gguf_header_bytes, path, header)
        digest = await asyncio.to_thread(fs.sha256_file, path)
        lineage = {**(lineage or {}), "source_file": path.name, "source_sha256": digest}
        draft = ModelVersion(
            name=name, version=version or "", kind="decoder", format=fs.GGUF,
            max_tokens=gguf.context_length(header), created_at=_now(), created_by=self._actor,
            lineage=lineage, config=config, status=PENDING,
        )
        return await self._publish(draft, [(path.name, path)], progress,
                                   explicit=version is not None, expect_sha256=digest,
                                   header=head)

    async def _publish(self, draft: ModelVersion, paths: list[tuple[str, Path]], progress: bool,
                       explicit: bool, expect_sha256: str | None = None,
                       header: bytes | None = None) -> ModelVersion:
        """Steps 2-4, with the undo on any failure. `header`: a GGUF file's header
        bytes, stored as its own object for gateways."""
        name = draft.name
        draft, rev = await self._reserve(draft, explicit=explicit)
        rels = [rel for rel, _ in paths]
        if header is not None:
            rels.append(f"{HEADER_DIR}/{paths[0][0]}")
        try:
            entries = await self._upload(draft, paths, progress)
            if expect_sha256 is not None and entries[0].sha256 != expect_sha256:
                raise RegistryError(f"{paths[0][1]} changed while it was uploaded; try again")
            if header is None:
                light = fs.gateway_files(entries)
            else:
                reader = fs.HashingReader(io.BytesIO(header))
                await self._put_file(object_name(name, draft.version, rels[-1]), reader)
                light = [fs.file_entry(paths[0][0], reader)]
            ready = msgspec.structs.replace(
                draft, files=entries, total_size=sum(e.size for e in entries), status=READY,
                tokenizer=light,
            )
            await self._kv.update(version_key(name, draft.version),
                                  msgspec.json.encode(ready), last=rev)
        except BaseException:
            await asyncio.shield(self._abandon(draft, rels))
            raise
        log.info("model_pushed", model=name, version=ready.version, files=len(entries),
                 bytes=ready.total_size, format=ready.format, kind=ready.kind)
        return ready

    async def _reserve(self, draft: ModelVersion, explicit: bool) -> tuple[ModelVersion, int]:
        """Claim the version key (KV create); auto versions take the next free integer."""
        for _ in range(_CAS_ATTEMPTS):
            if explicit:
                version = draft.version
            else:
                taken = [int(m.version) for m in await self._records(draft.name)
                         if m.version.isdigit()]
                version = str(max(taken, default=0) + 1)
            mv = msgspec.structs.replace(draft, version=version)
            key = version_key(mv.name, version)
            try:
                return mv, await self._kv.create(key, msgspec.json.encode(mv))
            except KeyWrongLastSequenceError:
                pass
            if explicit:
                rev = await self._take_stale(key, mv)
                if rev is None:
                    raise VersionExists(f"{mv.name}@{version} already exists")
                return mv, rev
        raise RegistryError(f"could not reserve a version of {draft.name}: too much contention")

    async def _take_stale(self, key: str, mv: ModelVersion) -> int | None:
        """Take over a pending reservation whose pusher gave up long ago."""
        try:
            entry = await self._kv.get(key)
        except KeyNotFoundError:
            return None
        old = msgspec.json.decode(entry.value, type=ModelVersion)
        if old.status != PENDING or _now() - old.created_at < STALE_PENDING:
            return None
        try:
            return await self._kv.update(key, msgspec.json.encode(mv), last=entry.revision)
        except KeyWrongLastSequenceError:
            return None

    async def _upload(self, mv: ModelVersion, paths: list[tuple[str, Path]],
                      progress: bool) -> list[FileEntry]:
        total = sum(p.stat().st_size for _, p in paths)
        entries = []
        with tqdm(total=total, unit="B", unit_scale=True, unit_divisor=1024,
                  desc=f"push {mv.name}@{mv.version}", disable=not progress) as bar:
            for rel, path in paths:
                name = object_name(mv.name, mv.version, rel)

                async def put(path=path, name=name) -> fs.HashingReader:
                    with open(path, "rb") as f:  # each try from the first byte
                        reader = fs.HashingReader(f, bar)
                        await self._put_file(name, reader)
                    return reader
                reader = await through(put, f"put {name}")
                entries.append(fs.file_entry(rel, reader))
        return entries

    async def _put_file(self, name: str, reader: fs.HashingReader) -> None:
        """Upload one object; a cancellation stops it at the next chunk.

        nats-py's publish path can swallow a CancelledError, and a put cancelled at an
        await leaves its chunks behind. So the put runs shielded, and a cancellation
        aborts its reader instead: the put then fails the ordinary way, purging the
        chunks it sent, and the cancellation carries on from here.
        """
        meta = api.ObjectMeta(name=name, options=api.ObjectMetaOptions(max_chunk_size=CHUNK_SIZE))
        put = asyncio.ensure_future(self._obj.put(name, reader, meta=meta))
        try:
            await asyncio.shield(put)
        except asyncio.CancelledError:
            reader.abort()
            if self._bus_down():  # its publishes would each wait out their timeout
                put.add_done_callback(lambda t: t.cancelled() or t.exception())
                put.cancel()
            else:
                await asyncio.gather(put, return_exceptions=True)
            raise

    async def _abandon(self, mv: ModelVersion, rels: list[str]) -> None:
        """Undo a failed push: drop uploaded objects and the reservation. Best effort:
        the first call that fails stops the rest (the bus is likely gone, and each call
        would wait out its own timeout, holding a stopping service for a minute); what
        is left behind is a pending reservation, which a later push of that version
        takes over once it is stale (`_take_stale`), and orphaned chunks."""
        try:
            for rel in rels:
                self._require_bus()
                with contextlib.suppress(ObjectNotFoundError):
                    await self._obj.delete(object_name(mv.name, mv.version, rel))
            self._require_bus()
            await self._kv.purge(version_key(mv.name, mv.version))
        except Exception as exc:  # noqa: BLE001 - best effort
            log.warning("abandon_failed", model=mv.name, version=mv.version,
                        error=str(exc) or type(exc).__name__)

    def _bus_down(self) -> bool:
        return self._nc is not None and not self._nc.is_connected

    def _require_bus(self) -> None:
        if self._bus_down():
            raise ConnectionError("not connected to nats-server")


def _now() -> datetime:
    return datetime.now(timezone.utc)
