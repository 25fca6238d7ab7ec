"""OpenAI's Files and Batch API over HTTP: `/v1/files` and `/v1/batches`.

The gateway only stores and reads (services/batchstore.py: bytes in the Object Store
`tensorbus_files`, records in the KV bucket `tensorbus_batches`); the batch runner
(`python -m services.batch`) validates and runs each batch and writes its output.

  1. `POST /v1/files`: a multipart upload (`purpose`, `file`), at most
     TENSORBUS_MAX_FILE_BYTES; `purpose` must be `batch`. Its lines are checked when
     a batch uses it (the runner), as OpenAI does.
  2. `POST /v1/batches`: the input file must exist with purpose `batch`; `endpoint`
     one of /v1/chat/completions, /v1/completions, /v1/embeddings;
     `completion_window` `24h`. The batch is stored `validating`; the runner's KV
     watch picks it up.
  3. `POST /v1/batches/{id}/cancel`: the record turns `cancelling` (compare-and-set,
     so the runner's progress writes never undo it); the runner stops feeding it.
"""

from __future__ import annotations

import asyncio
import email
from typing import Callable

import msgspec
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

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
)
from shared.config import Config
from shared.errors import ServiceError, bad_request, too_large
from shared.logging import get_logger

log = get_logger("gateway.batches")

_json = msgspec.json.Encoder()
_create = msgspec.json.Decoder(CreateBatch).decode
MULTIPART_SLACK = 65_536  # form fields and part headers around the file's bytes
MAX_METADATA = 16  # OpenAI's: pairs, keys of 64 characters, values of 512


def routes(nc, config: Config, authorised: Callable[[Request], bool]) -> list[Route]:
    api = BatchApi(nc, config, authorised)
    return [
        Route("/v1/files", api.guard(api.files), methods=["GET", "POST"]),
        Route("/v1/files/{id}", api.guard(api.file), methods=["GET", "DELETE"]),
        Route("/v1/files/{id}/content", api.guard(api.content), methods=["GET"]),
        Route("/v1/batches", api.guard(api.batches), methods=["GET", "POST"]),
        Route("/v1/batches/{id}", api.guard(api.batch), methods=["GET"]),
        Route("/v1/batches/{id}/cancel", api.guard(api.cancel), methods=["POST"]),
    ]


class BatchApi:
    def __init__(self, nc, config: Config, authorised: Callable[[Request], bool]) -> None:
        self.nc = nc
        self.config = config
        self.authorised = authorised
        self._store: BatchStore | None = None
        self._lock = asyncio.Lock()

    def guard(self, handler):
        """The handler behind the API key check, its ServiceErrors as error responses."""
        async def endpoint(request: Request) -> Response:
            try:
                if not self.authorised(request):
                    raise ServiceError(401, "a valid API key is required (Authorization: "
                                       "Bearer KEY)", code="invalid_api_key")
                return await handler(request)
            except ServiceError as err:
                return Response(_json.encode(err.to_body()), status_code=err.status,
                                media_type="application/json")
        return endpoint

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

    # --- files

    async def files(self, request: Request) -> Response:
        store = await self.store()
        if request.method == "GET":
            purpose = request.query_params.get("purpose")
            found = [f for f in await store.files() if purpose in (None, f.purpose)]
            page, more = _page(found, request, 10_000)
            return _reply(FileList(data=page, has_more=more, first_id=_first(page),
                                   last_id=_last(page)))
        filename, purpose, data = await self._upload(request)
        if purpose != "batch":
            raise bad_request(f"purpose '{purpose}' is not served; only 'batch' is")
        f = await store.put_file(filename, purpose, data)
        log.info("file_uploaded", file_id=f.id, bytes=f.bytes)
        return _reply(f)

    async def file(self, request: Request) -> Response:
        store, fid = await self.store(), request.path_params["id"]
        if request.method == "DELETE":
            if not await store.delete_file(fid):
                raise _no_file(fid)
            return _reply(FileDeleted(id=fid))
        f = await store.file(fid)
        if f is None:
            raise _no_file(fid)
        return _reply(f)

    async def content(self, request: Request) -> Response:
        fid = request.path_params["id"]
        data = await (await self.store()).file_bytes(fid)
        if data is None:
            raise _no_file(fid)
        return Response(data, media_type="application/octet-stream")

    async def _upload(self, request: Request) -> tuple[str, str, bytes]:
        """(filename, purpose, bytes) of a multipart/form-data upload."""
        ctype = request.headers.get("content-type", "")
        head = email.message_from_string(f"Content-Type: {ctype}\r\n\r\n")
        boundary = head.get_param("boundary")
        if head.get_content_type() != "multipart/form-data" or not boundary:
            raise bad_request("a file is uploaded as multipart/form-data")
        limit = self.config.max_file_bytes + MULTIPART_SLACK
        chunks, size = [], 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise too_large(f"the upload exceeds the limit of {self.config.max_file_bytes}"
                                " bytes (TENSORBUS_MAX_FILE_BYTES)")
            chunks.append(chunk)
        fields = _multipart(b"".join(chunks), str(boundary).encode())
        if "file" not in fields:
            raise bad_request("the form has no `file` field")
        filename, data = fields["file"]
        if len(data) > self.config.max_file_bytes:
            raise too_large(f"the file is {len(data)} bytes; the limit is "
                            f"{self.config.max_file_bytes} (TENSORBUS_MAX_FILE_BYTES)")
        purpose = fields.get("purpose", ("", b""))[1].decode(errors="replace").strip()
        return filename or "upload.jsonl", purpose, data

    # --- batches

    async def batches(self, request: Request) -> Response:
        store = await self.store()
        if request.method == "GET":
            page, more = _page(await store.batches(), request, 100)
            return _reply(BatchList(data=page, has_more=more, first_id=_first(page),
                                    last_id=_last(page)))
        try:
            req = _create(await request.body())
        except msgspec.ValidationError as exc:
            raise bad_request(f"invalid batch request: {exc}") from None
        except msgspec.DecodeError:
            raise bad_request("the body is not valid JSON") from None
        _check(req)
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
        return _reply(batch)

    async def batch(self, request: Request) -> Response:
        bid = request.path_params["id"]
        batch = await (await self.store()).batch(bid)
        if batch is None:
            raise _no_batch(bid)
        return _reply(batch)

    async def cancel(self, request: Request) -> Response:
        bid = request.path_params["id"]
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
        return _reply(batch)


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


def _multipart(body: bytes, boundary: bytes) -> dict[str, tuple[str, bytes]]:
    """{field name: (filename, bytes)} of a multipart/form-data body, bytes exact."""
    out = {}
    for part in body.split(b"--" + boundary)[1:]:
        if part.startswith(b"--"):
            break
        head, _, data = part.removeprefix(b"\r\n").partition(b"\r\n\r\n")
        msg = email.message_from_bytes(head + b"\r\n\r\n")
        name = msg.get_param("name", header="content-disposition")
        if name:
            out[str(name)] = (msg.get_filename() or "", data.removesuffix(b"\r\n"))
    return out


def _page(items: list, request: Request, most: int) -> tuple[list, bool]:
    """OpenAI's cursor pages: `limit` (default 20) items after the id `after`."""
    try:
        limit = min(most, max(1, int(request.query_params.get("limit", 20))))
    except ValueError:
        raise bad_request("limit must be an integer") from None
    after = request.query_params.get("after")
    if after:
        ids = [x.id for x in items]
        items = items[ids.index(after) + 1:] if after in ids else []
    return items[:limit], len(items) > limit


def _first(page: list) -> str | None:
    return page[0].id if page else None


def _last(page: list) -> str | None:
    return page[-1].id if page else None


def _reply(obj) -> Response:
    return Response(_json.encode(obj), media_type="application/json")


def _no_file(fid: str) -> ServiceError:
    return ServiceError(404, f"no file has id '{fid}'", code="file_not_found")


def _no_batch(bid: str) -> ServiceError:
    return ServiceError(404, f"no batch has id '{bid}'", code="batch_not_found")
