"""OpenAI's Files and Batch API shapes (`/v1/files`, `/v1/batches`), as msgspec Structs.

The objects are OpenAI's (the `openai` package's `FileObject` and `Batch` read them
unchanged); `InputLine` is one line of a batch's input file and `OutputLine` one line
of its output or error file. Records are stored as these Structs' JSON (KV bucket
`tensorbus_batches`, services/batchstore.py); nothing is pickled.
"""

from __future__ import annotations

from typing import Any, Literal

import msgspec

BATCH_ENDPOINTS = ("/v1/chat/completions", "/v1/completions", "/v1/embeddings")
COMPLETION_WINDOW = "24h"
WINDOW_S = 24 * 3600

ACTIVE = ("validating", "in_progress", "finalizing", "cancelling")
"""Statuses a runner still has work for; the others are final."""


class FileObject(msgspec.Struct, kw_only=True):
    id: str
    bytes: int
    created_at: int
    filename: str
    purpose: str
    object: Literal["file"] = "file"
    status: str = "processed"
    expires_at: int | None = None
    status_details: str | None = None


class FileList(msgspec.Struct, kw_only=True):
    data: list[FileObject]
    has_more: bool = False
    object: Literal["list"] = "list"
    first_id: str | None = None
    last_id: str | None = None


class FileDeleted(msgspec.Struct, kw_only=True):
    id: str
    deleted: bool = True
    object: Literal["file"] = "file"


class RequestCounts(msgspec.Struct, kw_only=True):
    total: int = 0
    completed: int = 0
    failed: int = 0


class BatchError(msgspec.Struct, kw_only=True, omit_defaults=True):
    code: str
    message: str
    line: int | None = None  # 1-based line of the input file
    param: str | None = None


class BatchErrors(msgspec.Struct, kw_only=True):
    data: list[BatchError]
    object: Literal["list"] = "list"


class Batch(msgspec.Struct, kw_only=True):
    id: str
    endpoint: str
    input_file_id: str
    completion_window: str
    created_at: int
    status: str = "validating"
    object: Literal["batch"] = "batch"
    errors: BatchErrors | None = None
    output_file_id: str | None = None
    error_file_id: str | None = None
    in_progress_at: int | None = None
    expires_at: int | None = None
    finalizing_at: int | None = None
    completed_at: int | None = None
    failed_at: int | None = None
    expired_at: int | None = None
    cancelling_at: int | None = None
    cancelled_at: int | None = None
    request_counts: RequestCounts = msgspec.field(default_factory=RequestCounts)
    metadata: dict[str, str] | None = None


class BatchList(msgspec.Struct, kw_only=True):
    data: list[Batch]
    has_more: bool = False
    object: Literal["list"] = "list"
    first_id: str | None = None
    last_id: str | None = None


class CreateBatch(msgspec.Struct, kw_only=True):
    """`POST /v1/batches`."""

    input_file_id: str
    endpoint: str
    completion_window: str
    metadata: dict[str, str] | None = None


class InputLine(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """One line of a batch input file."""

    custom_id: str
    method: str
    url: str
    body: dict[str, Any]


class LineResponse(msgspec.Struct, kw_only=True):
    status_code: int
    request_id: str
    body: Any


class LineError(msgspec.Struct, kw_only=True):
    code: str
    message: str


class OutputLine(msgspec.Struct, kw_only=True):
    """One line of an output file (`response` with status 200) or an error file (a
    non-200 `response`, or `response` null and an `error`)."""

    id: str
    custom_id: str
    response: LineResponse | None = None
    error: LineError | None = None

    @property
    def ok(self) -> bool:
        return self.error is None and self.response is not None \
            and self.response.status_code == 200


# --- over NATS (`inference.v1.files.*`, `inference.v1.batches.*`): what the HTTP
# route carries in its path and query string travels in a JSON (or msgpack) body.
# `files.put` sends the file's bytes as the body, its purpose and name in headers;
# `batches.create` sends CreateBatch, as `POST /v1/batches` does.

PURPOSE_HEADER = "Tensorbus-File-Purpose"  # files.put: the form's `purpose` (required)
FILENAME_HEADER = "Tensorbus-File-Name"  # files.put: the form's file name (optional)


class _BusRequest(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    pass


class FileRef(_BusRequest):
    """files.get, files.delete: `GET|DELETE /v1/files/{file_id}`."""

    file_id: str


class FileContent(_BusRequest):
    """files.content: `GET /v1/files/{file_id}/content`, or `length` bytes of it from
    `offset` (both optional: from 0, to the end) for a file larger than one bus
    message (shared/api_uploads.py)."""

    file_id: str
    offset: int | None = None
    length: int | None = None


class BatchRef(_BusRequest):
    """batches.get, batches.cancel: `GET /v1/batches/{batch_id}`, `POST .../cancel`."""

    batch_id: str


class ListFiles(_BusRequest):
    """files.list (an empty body: the defaults): `GET /v1/files`'s query."""

    purpose: str | None = None
    limit: int | None = None
    after: str | None = None


class ListBatches(_BusRequest):
    """batches.list (an empty body: the defaults): `GET /v1/batches`'s query."""

    limit: int | None = None
    after: str | None = None
