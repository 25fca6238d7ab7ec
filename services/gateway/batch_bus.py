"""OpenAI's Files and Batch API over NATS: `inference.v1.files.<op>` and
`inference.v1.batches.<op>` (request/reply, queue group `gateway`), the same
operations, bodies and errors as the HTTP routes (services/gateway/batch_ops.py).

  1. Each op is an endpoint of the gateway's micro service, served in its own task.
  2. `files.put`: the body is the file's bytes, its purpose and name in headers
     (shared.api_batches.PURPOSE_HEADER, FILENAME_HEADER); with an
     UPLOAD_PART_HEADER, one part of a multipart upload (services/gateway/uploads.py).
     `batches.create`: a CreateBatch. The others: the HTTP path's id and query as a
     small body (FileRef, FileContent, BatchRef, ListFiles, ListBatches), JSON or
     msgpack.
  3. The answer is the HTTP route's: the object (JSON, or msgpack when asked), or
     for `files.content` the file's bytes as stored, or the range asked for, with
     the file's size and the range's offset in headers. A file or range larger than
     one bus message (the server's `max_payload` less api_uploads.HEADROOM) is a 413
     that says how large a range may be.
  4. A failure is the error contract: `Nats-Service-Error-Code` / `Nats-Service-Error`
     headers and the body; anything unexpected is a 500, never a dropped request.
"""

from __future__ import annotations

from typing import Any, Awaitable, Callable, NamedTuple

from nats.aio.msg import Msg

from services.gateway import codec
from services.gateway.batch_ops import BatchOps
from services.gateway.uploads import Uploads
from shared import subjects
from shared.api_batches import (
    FILENAME_HEADER,
    PURPOSE_HEADER,
    BatchRef,
    CreateBatch,
    FileContent,
    FileRef,
    ListBatches,
    ListFiles,
)
from shared.api_uploads import (
    FILE_BYTES_HEADER,
    FILE_OFFSET_HEADER,
    UPLOAD_PART_HEADER,
    max_chunk,
)
from shared.errors import ServiceError, bad_request, internal, too_large
from shared.logging import get_logger

log = get_logger("gateway.batches")

Op = Callable[[Msg, bool], Awaitable[Any]]  # (message, msgpack) -> object or Raw


class Raw(NamedTuple):
    """An answer of bytes as they are (a file's content), with its headers."""

    data: bytes
    headers: dict[str, str]


class BatchBus:
    def __init__(self, nc, ops: BatchOps) -> None:
        self.nc = nc
        self.ops = ops
        self.uploads = Uploads(ops)

    def endpoints(self) -> list[tuple[str, str, Callable[[Msg], Awaitable[bool]]]]:
        """(micro endpoint name, subject, handler) for each op."""
        ops = self.ops
        files: dict[str, Op] = {
            "put": self._put_file,
            "get": lambda m, mp: ops.get_file(_decode(m, mp, FileRef).file_id),
            "list": self._list_files,
            "delete": lambda m, mp: ops.delete_file(_decode(m, mp, FileRef).file_id),
            "content": self._file_content,
        }
        batches: dict[str, Op] = {
            "create": self._create_batch,
            "get": lambda m, mp: ops.get_batch(_decode(m, mp, BatchRef).batch_id),
            "list": self._list_batches,
            "cancel": lambda m, mp: ops.cancel_batch(_decode(m, mp, BatchRef).batch_id),
        }
        assert tuple(files) == subjects.FILE_OPS and tuple(batches) == subjects.BATCH_OPS
        return [(f"files-{op}", subjects.files(op), self._handler(f)) for op, f in files.items()] \
            + [(f"batches-{op}", subjects.batches(op), self._handler(f))
               for op, f in batches.items()]

    def _handler(self, op: Op) -> Callable[[Msg], Awaitable[bool]]:
        async def serve(msg: Msg) -> bool:
            return await self._serve(op, msg)
        return serve

    async def _serve(self, op: Op, msg: Msg) -> bool:
        """Answer one request; False when the answer is an error."""
        mp = codec.is_msgpack(msg.headers)
        try:
            out = await op(msg, mp)
            body = out.data if isinstance(out, Raw) else codec.encode(out, mp)
            if len(body) > self.nc.max_payload > 0:
                raise too_large(f"the answer takes {len(body)} bytes and one bus message "
                                f"carries at most {self.nc.max_payload} (the server's "
                                "max_payload); read it over HTTP")
            headers = out.headers if isinstance(out, Raw) else codec.reply_headers(mp)
            if msg.reply:
                await self.nc.publish(msg.reply, body, headers=headers)
            return True
        except ServiceError as err:
            error = err
        except Exception:  # noqa: BLE001 - a bug answers 500, the request is not dropped
            log.exception("batch_api_failed", subject=msg.subject)
            error = internal()
        if msg.reply:
            body, headers = codec.error_reply(error, mp)
            await self.nc.publish(msg.reply, body, headers=headers)
        return False

    async def _put_file(self, msg: Msg, mp: bool):
        hdrs = msg.headers or {}
        if UPLOAD_PART_HEADER in hdrs:
            return await self.uploads.put_part(hdrs, msg.data)
        purpose = hdrs.get(PURPOSE_HEADER, "").strip()
        if not purpose:
            raise bad_request(f"files.put takes the file's purpose ('batch') in the "
                              f"{PURPOSE_HEADER} header")
        return await self.ops.put_file(hdrs.get(FILENAME_HEADER, ""), purpose, msg.data)

    async def _file_content(self, msg: Msg, mp: bool) -> Raw:
        """The file's bytes, or `length` of them from `offset`; a 413 past one message."""
        req = _decode(msg, mp, FileContent)
        if (req.offset or 0) < 0 or (req.length is not None and req.length < 1):
            raise bad_request("offset is at least 0 and length at least 1")
        size = (await self.ops.get_file(req.file_id)).bytes
        offset = req.offset or 0
        if offset > size:
            raise bad_request(f"offset {offset} is past the end of the file ({size} bytes)")
        end = size if req.length is None else min(size, offset + req.length)
        most = max_chunk(self.nc.max_payload) if self.nc.max_payload > 0 else end - offset
        ranged = req.offset is not None or req.length is not None
        if end - offset > most:
            asked = f"the range asks for {end - offset} bytes" if ranged else \
                f"the file is {size} bytes"
            raise too_large(f"{asked} and one bus message carries at most {most} of them "
                            f"(the server's max_payload, {self.nc.max_payload}, less room for "
                            "headers); read it in ranges: {\"file_id\", \"offset\", "
                            f"\"length\"}} with a length of at most {most} (or over HTTP)")
        data = await (self.ops.file_range(req.file_id, offset, end - offset) if ranged
                      else self.ops.file_content(req.file_id))
        return Raw(data, {FILE_BYTES_HEADER: str(size), FILE_OFFSET_HEADER: str(offset)})

    async def _create_batch(self, msg: Msg, mp: bool):
        if mp:
            return await self.ops.create(codec.decode(msg.data, CreateBatch, mp))
        return await self.ops.create_batch(msg.data)  # as POST /v1/batches reads it

    async def _list_files(self, msg: Msg, mp: bool):
        q = _query(msg, mp, ListFiles)
        return await self.ops.list_files(q.purpose, q.limit, q.after)

    async def _list_batches(self, msg: Msg, mp: bool):
        q = _query(msg, mp, ListBatches)
        return await self.ops.list_batches(q.limit, q.after)


def _decode(msg: Msg, mp: bool, typ: type):
    return codec.decode(msg.data, typ, mp)


def _query(msg: Msg, mp: bool, typ: type):
    """A list's query; an empty body asks for the defaults."""
    return typ() if not msg.data else codec.decode(msg.data, typ, mp)
