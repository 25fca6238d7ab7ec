"""A client of the Files API over NATS for files of any size (the contract:
shared/api_uploads.py): `upload` sends a file in parts that each fit the server's
`max_payload`, `pieces` and `download` read one back in ranges.

    f = await upload(nc, data, "input.jsonl")     # the file object, as a dict
    data = await download(nc, f["id"])

A reply in the error contract raises its ServiceError (status, message, code).
"""

from __future__ import annotations

import hashlib
import json
from typing import AsyncIterator

from shared import subjects
from shared.api_batches import FILENAME_HEADER, PURPOSE_HEADER
from shared.api_uploads import (
    FILE_BYTES_HEADER,
    UPLOAD_BYTES_HEADER,
    UPLOAD_ID_HEADER,
    UPLOAD_PART_HEADER,
    UPLOAD_SHA256_HEADER,
    max_chunk,
)
from shared.errors import HEADER_CODE, HEADER_MESSAGE, ServiceError


async def upload(nc, data: bytes, filename: str, purpose: str = "batch",
                 part_bytes: int | None = None, timeout: float = 30.0) -> dict:
    """Store `data` as a file, in parts of `part_bytes` (the most one message
    carries when not given); the file object."""
    step = part_bytes or max_chunk(nc.max_payload)
    headers = {PURPOSE_HEADER: purpose, FILENAME_HEADER: filename, UPLOAD_PART_HEADER: "1",
               UPLOAD_BYTES_HEADER: str(len(data)),
               UPLOAD_SHA256_HEADER: hashlib.sha256(data).hexdigest()}
    reply = await _ask(nc, subjects.files("put"), data[:step], headers, timeout)
    n = 1
    while reply.get("object") == "upload":
        n += 1
        part = data[reply["received"]:reply["received"] + step]
        reply = await _ask(nc, subjects.files("put"), part,
                           {UPLOAD_PART_HEADER: str(n), UPLOAD_ID_HEADER: reply["id"]}, timeout)
    return reply


async def pieces(nc, file_id: str, part_bytes: int | None = None,
                 timeout: float = 30.0) -> AsyncIterator[bytes]:
    """The file's bytes, in ranges of `part_bytes` (the most one message carries)."""
    step = part_bytes or max_chunk(nc.max_payload)
    offset, size = 0, None
    while size is None or offset < size:
        body = json.dumps({"file_id": file_id, "offset": offset, "length": step}).encode()
        msg = await nc.request(subjects.files("content"), body, timeout=timeout)
        _raise_error(msg)
        size = int(msg.headers[FILE_BYTES_HEADER])
        if not msg.data:
            return
        offset += len(msg.data)
        yield msg.data


async def download(nc, file_id: str, part_bytes: int | None = None,
                   timeout: float = 30.0) -> bytes:
    return b"".join([p async for p in pieces(nc, file_id, part_bytes, timeout)])


async def _ask(nc, subject: str, body: bytes, headers: dict, timeout: float) -> dict:
    msg = await nc.request(subject, body, headers=headers, timeout=timeout)
    _raise_error(msg)
    return json.loads(msg.data)


def _raise_error(msg) -> None:
    hdrs = msg.headers or {}
    if HEADER_CODE in hdrs:
        code = None
        try:
            code = json.loads(msg.data)["error"]["code"]
        except (ValueError, KeyError, TypeError):
            pass
        raise ServiceError(int(hdrs[HEADER_CODE]), hdrs.get(HEADER_MESSAGE, ""), code=code)
