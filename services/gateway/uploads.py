"""Multipart uploads over NATS: `inference.v1.files.put` with Tensorbus-Upload-*
headers (the contract: shared/api_uploads.py), for a file larger than one bus
message. Any gateway of the queue group may take any part: the state is in JetStream.

  1. Part 1 checks the purpose and the declared size (as a single put does) and
     sha256, stores the `uploads.<id>` record, then its bytes as the first chunks.
     A part 1 that is the whole file is checked and stored at once (no record).
  2. Part n is taken only when n is the record's next part: the record is moved on
     by compare-and-set first (two copies of one part: one wins, the other is a
     400), then the bytes are appended. Before anything is written, a part that
     would go past the declared size cancels the upload.
  3. The part that reaches the declared size completes it: the chunks are read
     back, their size and sha256 compared with the declared ones; a match becomes
     the file (its Object Store meta and record), a mismatch cancels the upload.
  4. Cancelling drops the chunks at once and keeps the record (`cancelled`) for
     UPLOAD_TTL_S, so a late part hears why; a completed upload's record names its
     file as long. `sweep` drops what expired: the gateway runs it at start and
     every SWEEP_S.
"""

from __future__ import annotations

import asyncio
import hashlib
import re
import time

import msgspec
from nats.js.errors import KeyWrongLastSequenceError

from services.batchstore import BatchStore, new_id, now
from services.gateway.batch_ops import BatchOps
from shared.api_batches import FILENAME_HEADER, PURPOSE_HEADER, FileObject
from shared.api_uploads import (
    UPLOAD_BYTES_HEADER,
    UPLOAD_ID_HEADER,
    UPLOAD_PART_HEADER,
    UPLOAD_SHA256_HEADER,
    UPLOAD_TTL_S,
    Upload,
)
from shared.errors import ServiceError, bad_request
from shared.logging import get_logger

log = get_logger("gateway.uploads")

SWEEP_S = 300.0
_SHA256 = re.compile(r"^[0-9a-f]{64}$")


class Uploads:
    def __init__(self, ops: BatchOps, ttl_s: int = UPLOAD_TTL_S) -> None:
        self.ops = ops
        self.ttl_s = ttl_s

    async def put_part(self, headers: dict[str, str], data: bytes) -> Upload | FileObject:
        """One part of a multipart upload: the Upload while parts remain, the file
        object once the last is in."""
        n = _count(headers, UPLOAD_PART_HEADER, 1)
        uid = headers.get(UPLOAD_ID_HEADER, "").strip()
        if n == 1:
            if uid:
                raise bad_request(f"part 1 starts an upload and carries no {UPLOAD_ID_HEADER}; "
                                  f"a later part carries its number in {UPLOAD_PART_HEADER}")
            return await self._begin(headers, data)
        if not uid:
            raise bad_request(f"part {n} carries the {UPLOAD_ID_HEADER} that the reply to "
                              "part 1 named")
        return await self._next(uid, n, data)

    async def _begin(self, headers: dict[str, str], data: bytes) -> Upload | FileObject:
        purpose = headers.get(PURPOSE_HEADER, "").strip()
        if not purpose:
            raise bad_request(f"files.put takes the file's purpose ('batch') in the "
                              f"{PURPOSE_HEADER} header")
        size = _count(headers, UPLOAD_BYTES_HEADER, 0)
        sha = headers.get(UPLOAD_SHA256_HEADER, "").strip().lower()
        if not _SHA256.match(sha):
            raise bad_request(f"part 1 carries the whole file's sha256, 64 hex digits, in "
                              f"the {UPLOAD_SHA256_HEADER} header")
        self.ops.check_new_file(size, purpose)
        filename = headers.get(FILENAME_HEADER, "") or "upload.jsonl"
        if len(data) > size:
            raise _mismatch(f"part 1 carries {len(data)} bytes, more than the "
                            f"{size} declared in {UPLOAD_BYTES_HEADER}")
        if len(data) == size:  # the whole file in one part
            if hashlib.sha256(data).hexdigest() != sha:
                raise _digest(hashlib.sha256(data).hexdigest(), sha)
            return await self.ops.put_file(filename, purpose, data)
        if not data:
            raise bad_request("a part carries at least one byte")
        store = await self.ops.store()
        t = now()
        up = Upload(id=new_id("upload_"), bytes=size, filename=filename, purpose=purpose,
                    created_at=t, expires_at=t + self.ttl_s, sha256=sha,
                    received=len(data), parts=1)
        await store.create_upload(up)
        await self._append(store, up, data)
        log.info("upload_started", upload_id=up.id, bytes=size)
        return up

    async def _next(self, uid: str, n: int, data: bytes) -> Upload | FileObject:
        store = await self.ops.store()
        found = await store.upload(uid)
        if found is None:
            raise ServiceError(404, f"no upload has id '{uid}' (an upload with no part for "
                               f"{self.ttl_s} s is dropped)", code="upload_not_found")
        up, revision = found
        if up.status == "completed":
            raise bad_request(f"upload '{uid}' is complete (file '{up.file_id}'); it takes "
                              "no more parts", code="upload_completed")
        if up.status == "pending" and up.expires_at <= now():
            await self._cancel(store, up, "expired")
            up.status = "expired"
        if up.status != "pending":
            raise bad_request(f"upload '{uid}' was {up.status} and its bytes dropped; start "
                              "again with part 1", code="upload_cancelled")
        if n != up.parts + 1:
            what = "a duplicate" if n <= up.parts else "out of order"
            raise bad_request(f"part {n} of upload '{uid}' is {what}: it holds parts 1 to "
                              f"{up.parts} ({up.received} bytes); send part {up.parts + 1}",
                              code="upload_part_out_of_order")
        if not data:
            raise bad_request("a part carries at least one byte")
        if up.received + len(data) > up.bytes:
            await self._cancel(store, up, "cancelled")
            raise _mismatch(f"part {n} takes upload '{uid}' to {up.received + len(data)} "
                            f"bytes, past the {up.bytes} declared; the upload is cancelled "
                            "and nothing was stored")
        moved = msgspec.structs.replace(up, received=up.received + len(data), parts=n,
                                        expires_at=now() + self.ttl_s)
        try:
            await store.update_upload(moved, revision)
        except KeyWrongLastSequenceError:
            raise bad_request(f"part {n} of upload '{uid}' came twice at once; one copy was "
                              f"taken: send part {n + 1} next",
                              code="upload_part_out_of_order") from None
        await self._append(store, moved, data)
        if moved.received < moved.bytes:
            return moved
        return await self._complete(store, moved)

    async def _append(self, store: BatchStore, up: Upload, data: bytes) -> None:
        try:
            await store.put_chunks(up.id, data)
        except Exception:
            await self._cancel(store, up, "cancelled")
            raise

    async def _complete(self, store: BatchStore, up: Upload) -> FileObject:
        size, chunks, digest = await store.chunks_digest(up.id)
        if size != up.bytes:
            await self._cancel(store, up, "cancelled")
            raise _mismatch(f"the parts stored for upload '{up.id}' come to {size} bytes, "
                            f"not the {up.bytes} declared (a part was lost); the upload is "
                            "cancelled: start again with part 1")
        if digest.hex() != up.sha256:
            await self._cancel(store, up, "cancelled")
            raise _digest(digest.hex(), up.sha256)
        f = FileObject(id=new_id("file-"), bytes=size, created_at=now(), filename=up.filename,
                       purpose=up.purpose)
        await store.commit_chunks(up.id, f, chunks, digest)
        await store.update_upload(msgspec.structs.replace(
            up, status="completed", file_id=f.id, expires_at=now() + self.ttl_s))
        log.info("file_uploaded", file_id=f.id, bytes=f.bytes, upload_id=up.id, parts=up.parts)
        return f

    async def _cancel(self, store: BatchStore, up: Upload, status: str) -> None:
        """Drop its bytes; keep the record, `status`, to answer late parts."""
        await store.drop_chunks(up.id)
        await store.update_upload(msgspec.structs.replace(
            up, status=status, expires_at=now() + self.ttl_s))
        log.info("upload_dropped", upload_id=up.id, status=status)

    async def sweep(self, at: float | None = None) -> int:
        """Drop every upload (its bytes and record) expired by `at` (now); how many."""
        store = await self.ops.store()
        at = time.time() if at is None else at
        gone = 0
        for up in await store.uploads():
            if up.expires_at <= at:
                await store.forget_upload(up.id, drop_chunks=up.status == "pending")
                gone += 1
        return gone

    async def sweep_forever(self) -> None:
        """`sweep` now and every SWEEP_S, once the files store exists (a gateway that
        never serves files never creates it)."""
        while True:
            if await self.ops.store_exists():
                try:
                    if n := await self.sweep():
                        log.info("uploads_swept", dropped=n)
                except Exception as exc:  # noqa: BLE001 - JetStream away: next time
                    log.warning("uploads_sweep_failed", error=str(exc) or type(exc).__name__)
            await asyncio.sleep(SWEEP_S)


def _count(headers: dict[str, str], name: str, least: int) -> int:
    raw = headers.get(name, "").strip()
    if not (raw.isascii() and raw.isdigit()) or int(raw) < least:
        raise bad_request(f"the {name} header is a whole number of at least {least}, "
                          f"not '{raw}'")
    return int(raw)


def _mismatch(message: str) -> ServiceError:
    return bad_request(message, code="upload_size_mismatch")


def _digest(got: str, declared: str) -> ServiceError:
    return bad_request(f"the file's sha256 is {got}, not the {declared} declared in "
                       f"{UPLOAD_SHA256_HEADER}; the upload is cancelled and nothing was "
                       "stored", code="upload_digest_mismatch")
