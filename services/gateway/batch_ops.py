"""The Files and Batch API's operations, whatever carried the request: the HTTP
routes (services/gateway/batches.py) and the NATS subjects
(services/gateway/batch_bus.py) parse their requests into these calls, which
answer OpenAI's objects or raise the ServiceError of the error contract.

The gateway only stores and reads (services/batchstore.py: bytes in the Object Store
`tensorbus_files`, records in the KV bucket `tensorbus_batches`); the batch runner
(`python -m services.batch`) validates and runs each batch and writes its output.

  1. put_file: at most TENSORBUS_MAX_FILE_BYTES; `purpose` must be `batch`. Its
     lines are checked when a batch uses it (the runner), as OpenAI does.
  2. create_batch: the input file must exist with purpose `batch`; `endpoint` one of
     /v1/chat/completions, /v1/completions, /v1/embeddings; `completion_window`
     `24h`. The batch is stored `validating`; the runner's KV watch picks it up.
  3. cancel_batch: the record turns `cancelling` (compare-and-set, so the runner's
     progress writes never undo it); the runner stops feeding it.
"""

from __future__ import annotations

import asyncio

import msgspec

from services.batchstore import BatchStore, new_id, now
from shared.api_batches import (
    BATCH_ENDPOINTS,
    COMPLETION_WINDOW,
    WINDOW_S,
    Batch,
    BatchList,
    CreateBatch,
    FileDeleted,
    FileList,
    FileObject,
)
from shared.config import Config
from shared.errors import ServiceError, bad_request, too_large
from shared.logging import get_logger

log = get_logger("gateway.batches")

_create = msgspec.json.Decoder(CreateBatch).decode
MAX_METADATA = 16  # OpenAI's: pairs, keys of 64 characters, values of 512
MOST_FILES = 10_000  # a page of files.list, at most
MOST_BATCHES = 100


class BatchOps:
    def __init__(self, nc, config: Config) -> None:
        self.nc = nc
        self.config = config
        self._store: BatchStore | None = None
        self._lock = asyncio.Lock()

    async def store(self) -> BatchStore:
        if self._store is None:
            async with self._lock:
                if self._store is None:
                    try:
                        self._store = await BatchStore.open(self.nc)
                    except Exception as exc:  # noqa: BLE001 - JetStream down or not allowed
                        log.warning("batch_store_unavailable", error=str(exc) or type(exc).__name__)
                        raise ServiceError(503, "the files and batches store (JetStream) is "
                                           "unavailable", code="store_unavailable") from None
        return self._store

    async def store_exists(self) -> bool:
        return self._store is not None or await BatchStore.exists(self.nc)

    # --- files

    async def list_files(self, purpose: str | None, limit: int | None,
                         after: str | None) -> FileList:
        found = [f for f in await (await self.store()).files() if purpose in (None, f.purpose)]
        page, more = _page(found, limit, after, MOST_FILES)
        return FileList(data=page, has_more=more, first_id=_first(page), last_id=_last(page))

    def check_new_file(self, size: int, purpose: str) -> None:
        """A new file of `size` bytes for `purpose`, or the 413 or 400 that refuses it."""
        if size > self.config.max_file_bytes:
            raise too_large(f"the file is {size} bytes; the limit is "
                            f"{self.config.max_file_bytes} (TENSORBUS_MAX_FILE_BYTES)")
        if purpose != "batch":
            raise bad_request(f"purpose '{purpose}' is not served; only 'batch' is")

    async def put_file(self, filename: str, purpose: str, data: bytes) -> FileObject:
        self.check_new_file(len(data), purpose)
        f = await (await self.store()).put_file(filename or "upload.jsonl", purpose, data)
        log.info("file_uploaded", file_id=f.id, bytes=f.bytes)
        return f

    async def get_file(self, fid: str) -> FileObject:
        f = await (await self.store()).file(fid)
        if f is None:
            raise _no_file(fid)
        return f

    async def delete_file(self, fid: str) -> FileDeleted:
        if not await (await self.store()).delete_file(fid):
            raise _no_file(fid)
        return FileDeleted(id=fid)

    async def file_content(self, fid: str) -> bytes:
        data = await (await self.store()).file_bytes(fid)
        if data is None:
            raise _no_file(fid)
        return data

    async def file_range(self, fid: str, offset: int, length: int) -> bytes:
        data = await (await self.store()).file_range(fid, offset, length)
        if data is None:
            raise _no_file(fid)
        return data

    # --- batches

    async def list_batches(self, limit: int | None, after: str | None) -> BatchList:
        page, more = _page(await (await self.store()).batches(), limit, after, MOST_BATCHES)
        return BatchList(data=page, has_more=more, first_id=_first(page), last_id=_last(page))

    async def create_batch(self, body: bytes) -> Batch:
        """`body`: CreateBatch as JSON (msgpack callers decode it first: `create`)."""
        try:
            req = _create(body)
        except msgspec.ValidationError as exc:
            raise bad_request(f"invalid batch request: {exc}") from None
        except msgspec.DecodeError:
            raise bad_request("the body is not valid JSON") from None
        return await self.create(req)

    async def create(self, req: CreateBatch) -> Batch:
        _check(req)
        store = await self.store()
        f = await store.file(req.input_file_id)
        if f is None or f.purpose != "batch":
            raise bad_request(f"input_file_id '{req.input_file_id}' is not a file uploaded "
                              "with purpose 'batch'")
        created = now()
        batch = Batch(id=new_id("batch_"), endpoint=req.endpoint,
                      input_file_id=req.input_file_id, completion_window=req.completion_window,
                      created_at=created, expires_at=created + WINDOW_S, metadata=req.metadata)
        await store.create_batch(batch)
        log.info("batch_created", batch_id=batch.id, endpoint=batch.endpoint)
        return batch

    async def get_batch(self, bid: str) -> Batch:
        batch = await (await self.store()).batch(bid)
        if batch is None:
            raise _no_batch(bid)
        return batch

    async def cancel_batch(self, bid: str) -> Batch:
        refused: list[str] = []

        def cancelling(b: Batch) -> Batch | None:
            if b.status in ("validating", "in_progress"):
                b.status, b.cancelling_at = "cancelling", now()
                return b
            if b.status not in ("cancelling", "cancelled"):
                refused.append(b.status)
            return None

        batch = await (await self.store()).change(bid, cancelling)
        if batch is None:
            raise _no_batch(bid)
        if refused:
            raise bad_request(f"the batch is {refused[-1]}; only a validating or in_progress "
                              "batch can be cancelled")
        return batch


def _check(req: CreateBatch) -> None:
    if req.endpoint not in BATCH_ENDPOINTS:
        raise bad_request(f"endpoint '{req.endpoint}' is not served in batches; use one of "
                          f"{', '.join(BATCH_ENDPOINTS)}")
    if req.completion_window != COMPLETION_WINDOW:
        raise bad_request(f"completion_window must be '{COMPLETION_WINDOW}'")
    meta = req.metadata or {}
    if len(meta) > MAX_METADATA or any(len(k) > 64 or len(v) > 512 for k, v in meta.items()):
        raise bad_request(f"metadata holds at most {MAX_METADATA} pairs, keys of up to 64 "
                          "characters and values of up to 512")


def _page(items: list, limit: int | None, after: str | None, most: int) -> tuple[list, bool]:
    """OpenAI's cursor pages: `limit` (default 20) items after the id `after`."""
    limit = min(most, max(1, 20 if limit is None else limit))
    if after:
        ids = [x.id for x in items]
        items = items[ids.index(after) + 1:] if after in ids else []
    return items[:limit], len(items) > limit


def _first(page: list) -> str | None:
    return page[0].id if page else None


def _last(page: list) -> str | None:
    return page[-1].id if page else None


def _no_file(fid: str) -> ServiceError:
    return ServiceError(404, f"no file has id '{fid}'", code="file_not_found")


def _no_batch(bid: str) -> ServiceError:
    return ServiceError(404, f"no batch has id '{bid}'", code="batch_not_found")
