"""OpenAI's Files and Batch API over HTTP: `/v1/files` and `/v1/batches`.

The routes parse the request (a multipart upload, path ids, the query string) and
call the operations of services/gateway/batch_ops.py, which the NATS subjects
(services/gateway/batch_bus.py) share.

  1. `POST /v1/files`: a multipart upload (`purpose`, `file`), at most
     TENSORBUS_MAX_FILE_BYTES (plus the form around it) read before it is parsed.
  2. `POST /v1/batches`: a CreateBatch body.
  3. `POST /v1/batches/{id}/cancel`: the batch turns `cancelling`.
"""

from __future__ import annotations

import email
from typing import Callable

import msgspec
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from services.gateway.batch_ops import BatchOps
from shared.config import Config
from shared.errors import ServiceError, bad_request, too_large

_json = msgspec.json.Encoder()
MULTIPART_SLACK = 65_536  # form fields and part headers around the file's bytes


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
        self.config = config
        self.authorised = authorised
        self.ops = BatchOps(nc, config)

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

    # --- files

    async def files(self, request: Request) -> Response:
        if request.method == "GET":
            q = request.query_params
            return _reply(await self.ops.list_files(q.get("purpose"), _limit(request),
                                                    q.get("after")))
        await self.ops.store()  # a store that is down answers 503 before the upload is read
        filename, purpose, data = await self._upload(request)
        return _reply(await self.ops.put_file(filename, purpose, data))

    async def file(self, request: Request) -> Response:
        fid = request.path_params["id"]
        if request.method == "DELETE":
            return _reply(await self.ops.delete_file(fid))
        return _reply(await self.ops.get_file(fid))

    async def content(self, request: Request) -> Response:
        data = await self.ops.file_content(request.path_params["id"])
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
        purpose = fields.get("purpose", ("", b""))[1].decode(errors="replace").strip()
        return filename, purpose, data

    # --- batches

    async def batches(self, request: Request) -> Response:
        if request.method == "GET":
            return _reply(await self.ops.list_batches(_limit(request),
                                                      request.query_params.get("after")))
        return _reply(await self.ops.create_batch(await request.body()))

    async def batch(self, request: Request) -> Response:
        return _reply(await self.ops.get_batch(request.path_params["id"]))

    async def cancel(self, request: Request) -> Response:
        return _reply(await self.ops.cancel_batch(request.path_params["id"]))


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


def _limit(request: Request) -> int | None:
    raw = request.query_params.get("limit")
    if raw is None:
        return None
    try:
        return int(raw)
    except ValueError:
        raise bad_request("limit must be an integer") from None


def _reply(obj) -> Response:
    return Response(_json.encode(obj), media_type="application/json")
