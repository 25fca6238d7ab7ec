"""Files larger than one bus message over NATS (docs/protocol.md, "Files and
batches"): a multipart upload on `inference.v1.files.put` and ranged reads on
`inference.v1.files.content`. HTTP needs neither (one request carries any size).

Upload, one part per request, each sent after the reply to the one before:

  part 1   headers UPLOAD_PART_HEADER: 1, UPLOAD_BYTES_HEADER (the whole file's size),
           UPLOAD_SHA256_HEADER (its sha256, hex), the file's purpose and name
           (shared.api_batches.PURPOSE_HEADER, FILENAME_HEADER); the body its first
           bytes. The reply is an `Upload` (`object: "upload"`) naming its `id`.
  part n   headers UPLOAD_PART_HEADER: n, UPLOAD_ID_HEADER: that id; the next bytes.
           The reply is the `Upload`, `received` so far.
  last     the part whose bytes reach the declared size: the gateway checks the
           size and sha256 and answers the `file` object (`object: "file"`).

Each part carries at least one byte and at most the bus's max_payload less HEADROOM.
A part number other than the next is refused (400 `upload_part_out_of_order`) and
the upload stays as it was, so a client that lost a reply sends the part the error
names. Bytes past the declared size or another sha256 cancel the upload (nothing is
stored). An upload with no part for UPLOAD_TTL_S is dropped with its bytes.

Read: `files.content` with `offset` and `length` (FileContent) answers those bytes
(fewer at the end of the file), with FILE_BYTES_HEADER (the file's size) and
FILE_OFFSET_HEADER on every reply.
"""

from __future__ import annotations

from typing import Literal

import msgspec

UPLOAD_PART_HEADER = "Tensorbus-Upload-Part"  # 1, 2, ...: this request is that part
UPLOAD_ID_HEADER = "Tensorbus-Upload-Id"  # parts after the first: the Upload's id
UPLOAD_BYTES_HEADER = "Tensorbus-Upload-Bytes"  # part 1: the whole file's size
UPLOAD_SHA256_HEADER = "Tensorbus-Upload-Sha256"  # part 1: the whole file's sha256 (hex)
FILE_BYTES_HEADER = "Tensorbus-File-Bytes"  # files.content reply: the whole file's size
FILE_OFFSET_HEADER = "Tensorbus-File-Offset"  # files.content reply: its first byte's offset

HEADROOM = 1024
"""Bytes of a bus message kept for headers: a part or a range is at most the
server's max_payload less this."""
UPLOAD_TTL_S = 3600
"""An upload with no part for this long is dropped (OpenAI's uploads expire after an
hour too); a completed or cancelled one is remembered this long, to answer late parts."""


class Upload(msgspec.Struct, kw_only=True):
    """A multipart upload (the shape of OpenAI's Upload object, with `received` and
    `parts`): `pending` until its last part, then `completed` (`file_id` set), or
    `cancelled` (a bad part) or `expired`."""

    id: str
    bytes: int
    filename: str
    purpose: str
    created_at: int
    expires_at: int
    sha256: str
    object: Literal["upload"] = "upload"
    status: str = "pending"
    received: int = 0
    parts: int = 0
    file_id: str | None = None


def max_chunk(max_payload: int) -> int:
    """The most bytes one part or one range may carry on a bus of `max_payload`."""
    return max(1, max_payload - HEADROOM)
