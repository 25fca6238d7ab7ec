"""Files and batches in JetStream: what the gateway's `/v1/files` and `/v1/batches`
write and the batch runner (services/batch) works through.

Two buckets, created by whichever process binds them first (safe to race):

- Object Store `tensorbus_files` (shared.subjects.FILES_BUCKET): a file's bytes, as
  uploaded or as the runner wrote them, under the file's id. Raw bytes, never
  unpickled.
- KV `tensorbus_batches` (shared.subjects.BATCHES_BUCKET), msgspec JSON values:
    files.<file_id>                  the FileObject
    batches.<batch_id>               the Batch (status, counts, file ids)
    lines.<batch_id>.<ok|err>.<n>    the OutputLine of input line n (0-based), written
                                     once (created: the first answer stays), when its
                                     request finished
    leases.<batch_id>                the batch runner working on it (services/batch/lease.py)
    uploads.<upload_id>              a multipart upload over NATS (shared.api_uploads.Upload)

A multipart upload's parts go straight into the Object Store's stream, as the chunks
of an object whose nuid is the upload's id (`$O.tensorbus_files.C.<upload_id>`, the
store's own 128 KiB chunks); the last part publishes the object's meta message, as
`ObjectStore.put` does, and the file is then like any other. Nothing holds a whole
file in memory: parts are written as they come, the digest and a range are read
chunk by chunk.

A batch record changes by compare-and-set (`change`): the gateway (cancel) and the
runner (progress, status) both read, modify and write it at its last revision, so
neither overwrites the other's change. Which lines are done is the set of `lines.`
keys, read from the stream's subject index, so a restarted runner knows exactly
what to skip.
"""

from __future__ import annotations

import asyncio
import base64
import hashlib
import json
import re
import secrets
import time
from contextlib import aclosing
from typing import Callable

import msgspec
from nats.js import api
from nats.js.errors import (
    BucketNotFoundError,
    KeyDeletedError,
    KeyNotFoundError,
    KeyWrongLastSequenceError,
    NotFoundError,
)

from shared import subjects
from shared.api_batches import Batch, FileObject, OutputLine
from shared.api_uploads import Upload, max_chunk
from shared.jetstream import check_replicas, replicas

KV_STREAM = f"KV_{subjects.BATCHES_BUCKET}"
OBJ_STREAM = f"OBJ_{subjects.FILES_BUCKET}"
CHUNK = 128 * 1024  # the Object Store's own chunk size (nats.js.object_store)
_PRE = f"$KV.{subjects.BATCHES_BUCKET}."
_ID = re.compile(r"^[A-Za-z0-9_-]{1,200}$")
_line = msgspec.json.Decoder(OutputLine).decode
_file = msgspec.json.Decoder(FileObject).decode
_batch = msgspec.json.Decoder(Batch).decode
_upload = msgspec.json.Decoder(Upload).decode
_encode = msgspec.json.Encoder().encode


def new_id(prefix: str) -> str:
    return f"{prefix}{secrets.token_hex(12)}"


def now() -> int:
    return int(time.time())


class BatchStore:
    """Both buckets behind one object. Build it with `await BatchStore.open(nc)`."""

    def __init__(self, js, kv, objects, chunk: int = CHUNK) -> None:
        self._js = js
        self._kv = kv
        self._obj = objects
        self._chunk = chunk  # what put_chunks writes: CHUNK, less on a smaller bus

    @property
    def kv(self):
        """The KV bucket itself, for the batch runners' leases (services/batch/lease.py)."""
        return self._kv

    @classmethod
    async def open(cls, nc) -> "BatchStore":
        js = nc.jetstream()
        try:
            kv = await js.key_value(subjects.BATCHES_BUCKET)
        except BucketNotFoundError:
            kv = await js.create_key_value(
                bucket=subjects.BATCHES_BUCKET, history=1, replicas=replicas(nc),
                description="tensorbus files and batches: records and progress")
        try:
            obj = await js.object_store(subjects.FILES_BUCKET)
        except BucketNotFoundError:
            obj = await js.create_object_store(
                subjects.FILES_BUCKET, description="tensorbus /v1/files contents",
                replicas=replicas(nc))
        await check_replicas(nc, (f"KV_{subjects.BATCHES_BUCKET}", f"OBJ_{subjects.FILES_BUCKET}"))
        return cls(js, kv, obj, chunk=min(CHUNK, max_chunk(nc.max_payload or CHUNK)))

    @staticmethod
    async def exists(nc) -> bool:
        """Whether someone created the buckets already (`open` creates them)."""
        try:
            await nc.jetstream().key_value(subjects.BATCHES_BUCKET)
            return True
        except Exception:  # noqa: BLE001 - not there, or JetStream away or not allowed
            return False

    # --- files

    async def put_file(self, filename: str, purpose: str, data: bytes) -> FileObject:
        f = FileObject(id=new_id("file-"), bytes=len(data), created_at=now(),
                       filename=filename, purpose=purpose)
        await self._obj.put(f.id, data)
        await self._kv.put(f"files.{f.id}", _encode(f))
        return f

    async def file(self, file_id: str) -> FileObject | None:
        raw = await self._get(f"files.{file_id}") if _ID.match(file_id) else None
        return _file(raw) if raw else None

    async def file_bytes(self, file_id: str) -> bytes | None:
        if await self.file(file_id) is None:
            return None
        try:
            return (await self._obj.get(file_id)).data
        except NotFoundError:
            return None

    async def delete_file(self, file_id: str) -> bool:
        if await self.file(file_id) is None:
            return False
        await self._kv.purge(f"files.{file_id}")
        try:
            await self._obj.delete(file_id)
        except NotFoundError:
            pass  # the record was written after the bytes; only the record was left
        return True

    async def files(self) -> list[FileObject]:
        """Every file, newest first."""
        out = [_file(raw) for raw in await self._scan("files.*")]
        return sorted(out, key=lambda f: (f.created_at, f.id), reverse=True)

    async def file_range(self, file_id: str, offset: int, length: int) -> bytes | None:
        """`length` bytes of the file from `offset` (fewer at its end), read chunk by
        chunk; None when there is no such file."""
        if await self.file(file_id) is None:
            return None
        try:
            info = await self._obj.get_info(file_id)
        except NotFoundError:
            return None
        end = min(offset + length, info.size or 0)
        out = bytearray()
        if offset >= end:
            return bytes(out)
        pos = 0
        async with aclosing(self._chunks(info.nuid)) as chunks:
            async for chunk in chunks:
                if pos + len(chunk) > offset:
                    out += chunk[max(0, offset - pos):end - pos]
                pos += len(chunk)
                if pos >= end:
                    break
        return bytes(out)

    # --- multipart uploads (services/gateway/uploads.py)

    async def upload(self, upload_id: str) -> tuple[Upload, int] | None:
        """The upload's record and its revision (for `update_upload`)."""
        if not _ID.match(upload_id):
            return None
        try:
            entry = await self._kv.get(f"uploads.{upload_id}")
        except (KeyNotFoundError, KeyDeletedError):
            return None
        return (_upload(entry.value), entry.revision) if entry.value else None

    async def create_upload(self, up: Upload) -> None:
        await self._kv.create(f"uploads.{up.id}", _encode(up))

    async def update_upload(self, up: Upload, revision: int | None = None) -> None:
        """Write the record; at `revision` only (KeyWrongLastSequenceError otherwise)."""
        if revision is None:
            await self._kv.put(f"uploads.{up.id}", _encode(up))
        else:
            await self._kv.update(f"uploads.{up.id}", _encode(up), last=revision)

    async def uploads(self) -> list[Upload]:
        return [_upload(raw) for raw in await self._scan("uploads.*")]

    async def forget_upload(self, upload_id: str, drop_chunks: bool) -> None:
        """Drop the upload's record, after its chunks when `drop_chunks` (those of a
        completed upload are its file's)."""
        if drop_chunks:
            await self.drop_chunks(upload_id)
        await self._kv.purge(f"uploads.{upload_id}")

    async def put_chunks(self, nuid: str, data: bytes) -> None:
        """Append `data` to the chunks of object `nuid`, in the store's chunk size."""
        subject = _chunks(nuid)
        for i in range(0, len(data), self._chunk):
            await self._js.publish(subject, data[i:i + self._chunk])

    async def drop_chunks(self, nuid: str) -> None:
        await self._js.purge_stream(OBJ_STREAM, subject=_chunks(nuid))

    async def chunks_digest(self, nuid: str) -> tuple[int, int, bytes]:
        """(bytes, chunks, sha256 digest) of the chunks of object `nuid`."""
        h, size, count = hashlib.sha256(), 0, 0
        async for chunk in self._chunks(nuid):
            h.update(chunk)
            size += len(chunk)
            count += 1
        return size, count, h.digest()

    async def commit_chunks(self, nuid: str, f: FileObject, chunks: int, digest: bytes) -> None:
        """Make the chunks of `nuid` the object `f.id` (its meta message, as
        ObjectStore.put writes it), then write the file's record."""
        info = api.ObjectInfo(
            name=f.id, bucket=subjects.FILES_BUCKET, nuid=nuid, size=f.bytes, chunks=chunks,
            digest="SHA-256=" + base64.urlsafe_b64encode(digest).decode(),
            options=api.ObjectMetaOptions(max_chunk_size=self._chunk))
        meta = f"$O.{subjects.FILES_BUCKET}.M.{base64.urlsafe_b64encode(f.id.encode()).decode()}"
        await self._js.publish(meta, json.dumps(info.as_dict()).encode(),
                               headers={api.Header.ROLLUP: "sub"})
        await self._kv.put(f"files.{f.id}", _encode(f))

    async def _chunks(self, nuid: str):
        """The chunks of object `nuid`, in order (an ordered consumer, as
        ObjectStore.get reads them); nothing when it has none."""
        info = await self._js.stream_info(OBJ_STREAM, subjects_filter=_chunks(nuid))
        if not (info.state.subjects or {}).get(_chunks(nuid)):
            return
        sub = await self._js.subscribe(_chunks(nuid), ordered_consumer=True)
        try:
            async for msg in sub.messages:
                yield msg.data
                if msg.metadata.num_pending == 0:
                    return
        finally:
            await sub.unsubscribe()

    # --- batches

    async def create_batch(self, batch: Batch) -> None:
        await self._kv.create(f"batches.{batch.id}", _encode(batch))

    async def batch(self, batch_id: str) -> Batch | None:
        raw = await self._get(f"batches.{batch_id}") if _ID.match(batch_id) else None
        return _batch(raw) if raw else None

    async def batches(self) -> list[Batch]:
        """Every batch, newest first."""
        out = [_batch(raw) for raw in await self._scan("batches.*")]
        return sorted(out, key=lambda b: (b.created_at, b.id), reverse=True)

    async def change(self, batch_id: str, fn: Callable[[Batch], Batch | None]) -> Batch | None:
        """Apply `fn` to the batch's latest record and write it at that revision,
        again on a conflict. `fn` returns the new record, or None to leave it as it
        is. The record as it stands afterwards, or None when there is no such batch
        (an id no batch could have, a key KV refuses, among them)."""
        if not _ID.match(batch_id):
            return None
        while True:
            try:
                entry = await self._kv.get(f"batches.{batch_id}")
            except (KeyNotFoundError, KeyDeletedError):
                return None
            current = _batch(entry.value)
            new = fn(msgspec.structs.replace(current))
            if new is None:
                return current
            try:
                await self._kv.update(f"batches.{batch_id}", _encode(new), last=entry.revision)
                return new
            except KeyWrongLastSequenceError:
                await asyncio.sleep(0)  # someone else wrote it: read again

    async def watch_batches(self):
        """A KV watcher of every batch record: the current ones, then each change."""
        return await self._kv.watch("batches.*")

    @staticmethod
    def decode_batch(raw: bytes) -> Batch:
        return _batch(raw)

    # --- per-line progress

    async def put_line(self, batch_id: str, n: int, line: OutputLine) -> bool:
        """Store line n's answer; False (nothing written) when it has one already:
        the first answer stays."""
        try:
            await self._kv.create(f"lines.{batch_id}.{'ok' if line.ok else 'err'}.{n}",
                                  _encode(line))
        except KeyWrongLastSequenceError:
            return False
        return True

    async def lines_done(self, batch_id: str) -> dict[int, bool]:
        """{input line index: answered with status 200} for every line answered."""
        info = await self._js.stream_info(KV_STREAM,
                                          subjects_filter=f"{_PRE}lines.{batch_id}.*.*")
        out: dict[int, bool] = {}
        for subject in info.state.subjects or {}:
            *_, kind, n = subject.split(".")
            out[int(n)] = out.get(int(n), False) or kind == "ok"  # an ok answer wins
        return out

    async def line(self, batch_id: str, n: int, ok: bool) -> bytes:
        return await self._get(f"lines.{batch_id}.{'ok' if ok else 'err'}.{n}") or b""

    # --- helpers

    async def _get(self, key: str) -> bytes | None:
        try:
            return (await self._kv.get(key)).value or None
        except (KeyNotFoundError, KeyDeletedError):
            return None

    async def _scan(self, pattern: str) -> list[bytes]:
        """The values of every key matching `pattern` (deleted ones left out), keys from
        the stream's subject index (as services/registry/store.py lists versions)."""
        info = await self._js.stream_info(KV_STREAM, subjects_filter=_PRE + pattern)
        out = []
        for subject in sorted(info.state.subjects or {}):
            raw = await self._get(subject[len(_PRE):])
            if raw:
                out.append(raw)
        return out


def _chunks(nuid: str) -> str:
    return f"$O.{subjects.FILES_BUCKET}.C.{nuid}"
