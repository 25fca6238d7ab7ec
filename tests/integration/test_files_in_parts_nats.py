"""Files larger than one bus message over NATS (shared/api_uploads.py): a multipart
upload on `inference.v1.files.put`, ranged reads on `inference.v1.files.content`,
through a real nats-server of its own with a small `max_payload` (256 KiB), a
gateway and scheduler (no model), and the batch runner as its own process.

- A file about 3x max_payload goes up in parts (each reply the Upload, `received`
  growing, the last the file object) and reads back byte-identical in ranges over
  NATS and whole over HTTP, sha256 as declared; a batch made from it runs (each line
  names a model that does not exist, so each lands in the error file).
- Read without a range, that file is a 413 that says how to read it in ranges; a
  range past the end, or larger than a message, is a clear 400 or 413.
- Bad parts (out of order, a duplicate, an unknown upload id, bytes past the declared
  size, another sha256, a part after completion, missing or malformed headers) are
  each an error in the contract, and leave no file and no stored bytes behind; an
  upload out of order or duplicated goes on from the part the error names.
- An abandoned upload is dropped, bytes and record, by the gateway's sweep.
"""

from __future__ import annotations

import hashlib
import json

import httpx
import pytest
import pytest_asyncio

from services.batchstore import now
from services.gateway.batch_ops import BatchOps
from services.gateway.uploads import Uploads
from shared import files_client, subjects
from shared.api_batches import FILENAME_HEADER, PURPOSE_HEADER
from shared.api_uploads import (
    FILE_BYTES_HEADER,
    FILE_OFFSET_HEADER,
    UPLOAD_BYTES_HEADER,
    UPLOAD_ID_HEADER,
    UPLOAD_PART_HEADER,
    UPLOAD_SHA256_HEADER,
    UPLOAD_TTL_S,
    max_chunk,
)
from shared.errors import HEADER_MESSAGE
from shared.natsd import NatsServer
from tests.integration.test_batches import Runner, jsonl
from tests.integration.test_batches_nats import ask, ok, until_final
from tests.support.stack import running_stack

MAX_PAYLOAD = 256 * 1024
CHUNKS = "OBJ_tensorbus_files"


@pytest.fixture(scope="module")
def small_bus(tmp_path_factory):
    d = tmp_path_factory.mktemp("nats-small")
    conf = d / "nats-server.conf"
    conf.write_text(f"max_payload: {MAX_PAYLOAD}\n")
    with NatsServer(d, config=str(conf)) as server:
        yield server


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def stack(small_bus):
    async with running_stack(small_bus.url) as st:
        assert st.client.max_payload == MAX_PAYLOAD
        yield st


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def runner(stack, small_bus):
    r = Runner(small_bus.url)
    await r.start(stack.client)
    yield r
    await r.stop()


def big_input() -> bytes:
    """A batch input file of about 3x MAX_PAYLOAD: lines for a model that is not served."""
    lines = [{"custom_id": f"line-{i}", "method": "POST", "url": "/v1/chat/completions",
              "body": {"model": "no-such-model", "max_tokens": 1,
                       "messages": [{"role": "user", "content": f"{i} " + "x" * 6000}]}}
             for i in range(128)]
    return jsonl(lines)


def first(data: bytes, size: int | None = None, sha: str | None = None, **extra) -> dict:
    """Headers of part 1 of `data` (its declared size and sha256 unless given)."""
    return {PURPOSE_HEADER: "batch", FILENAME_HEADER: "big.jsonl", UPLOAD_PART_HEADER: "1",
            UPLOAD_BYTES_HEADER: str(len(data) if size is None else size),
            UPLOAD_SHA256_HEADER: sha or hashlib.sha256(data).hexdigest(), **extra}


def part(n: int, upload_id: str) -> dict:
    return {UPLOAD_PART_HEADER: str(n), UPLOAD_ID_HEADER: upload_id}


async def file_ids(nc) -> set[str]:
    return {f["id"] for f in (await ok(nc, subjects.files("list"), {"limit": 10000}))["data"]}


async def stored_chunks(nc, upload_id: str) -> int:
    subject = f"$O.tensorbus_files.C.{upload_id}"
    info = await nc.jetstream().stream_info(CHUNKS, subjects_filter=subject)
    return (info.state.subjects or {}).get(subject, 0)


async def refused(nc, body: bytes, headers: dict, status: int, code: str, needle: str) -> str:
    got, data, hdrs = await ask(nc, subjects.files("put"), body, headers)
    assert got == status, data
    err = json.loads(data)["error"]
    assert err["code"] == code and needle in hdrs[HEADER_MESSAGE], hdrs[HEADER_MESSAGE]
    assert err["message"] == hdrs[HEADER_MESSAGE]
    return hdrs[HEADER_MESSAGE]


async def test_a_file_three_messages_large_goes_up_in_parts_and_back_in_ranges(stack, runner):
    nc = stack.client
    data = big_input()
    step = max_chunk(nc.max_payload)
    assert 3 * MAX_PAYLOAD <= len(data) < 4 * step  # four parts
    reply = await ok(nc, subjects.files("put"), data[:step], first(data))
    assert reply["object"] == "upload" and reply["status"] == "pending", reply
    assert (reply["received"], reply["parts"], reply["bytes"]) == (step, 1, len(data))
    uid, n = reply["id"], 1
    while reply["object"] == "upload":
        assert reply["id"] == uid and reply["received"] == n * step
        n += 1
        reply = await ok(nc, subjects.files("put"), data[(n - 1) * step:n * step], part(n, uid))
    assert n == 4
    f = reply
    assert f["object"] == "file" and f["bytes"] == len(data) and f["purpose"] == "batch"
    assert f["filename"] == "big.jsonl"
    assert await ok(nc, subjects.files("get"), {"file_id": f["id"]}) == f

    # Back over NATS, in ranges under max_payload; over HTTP, whole.
    back = await files_client.download(nc, f["id"])
    assert back == data and hashlib.sha256(back).hexdigest() == hashlib.sha256(data).hexdigest()
    async with httpx.AsyncClient(base_url=stack.http_url, timeout=60) as http:
        assert (await http.get(f"/v1/files/{f['id']}/content")).content == data
    for offset, length, want in ((1000, 5000, data[1000:6000]), (len(data) - 10, 100, data[-10:]),
                                 (len(data), 5, b""), (step - 3, 7, data[step - 3:step + 4])):
        got, body, hdrs = await ask(nc, subjects.files("content"),
                                    {"file_id": f["id"], "offset": offset, "length": length})
        assert got == 200 and body == want, (offset, length)
        assert hdrs[FILE_BYTES_HEADER] == str(len(data)) and hdrs[FILE_OFFSET_HEADER] == str(offset)

    # Whole, or a range larger than a message: a 413 that says how to read it.
    code, body, hdrs = await ask(nc, subjects.files("content"), {"file_id": f["id"]})
    assert code == 413 and json.loads(body)["error"]["type"] == "payload_too_large"
    assert "in ranges" in hdrs[HEADER_MESSAGE] and f"at most {step}" in hdrs[HEADER_MESSAGE]
    code, _, hdrs = await ask(nc, subjects.files("content"),
                              {"file_id": f["id"], "offset": 0, "length": step + 1})
    assert code == 413 and f"at most {step}" in hdrs[HEADER_MESSAGE]
    for bad, needle in (({"offset": len(data) + 1}, "past the end"), ({"offset": -1}, "offset"),
                        ({"length": 0}, "length")):
        code, _, hdrs = await ask(nc, subjects.files("content"), {"file_id": f["id"], **bad})
        assert code == 400 and needle in hdrs[HEADER_MESSAGE], hdrs

    # The file is batch input like any other: the runner reads, checks and runs it.
    batch = await ok(nc, subjects.batches("create"), {
        "input_file_id": f["id"], "endpoint": "/v1/chat/completions",
        "completion_window": "24h"})
    done = await until_final(nc, batch["id"], timeout=120)
    assert done["status"] == "completed", done
    assert done["request_counts"] == {"total": 128, "completed": 0, "failed": 128}
    errors = await files_client.download(nc, done["error_file_id"])
    assert len(errors.splitlines()) == 128
    assert json.loads(errors.splitlines()[0])["response"]["status_code"] == 404


async def test_the_client_helper_round_trips_any_size(stack):
    nc = stack.client
    for data in (b"", b'{"custom_id": "a"}\n', big_input()[:MAX_PAYLOAD * 2 + 17]):
        f = await files_client.upload(nc, data, "x.jsonl")
        assert f["object"] == "file" and f["bytes"] == len(data)
        assert await files_client.download(nc, f["id"]) == data
        assert await files_client.download(nc, f["id"], part_bytes=50_000) == data


async def test_parts_out_of_order_or_twice_are_refused_and_the_upload_goes_on(stack):
    nc = stack.client
    data = b"0123456789" * 10
    up = await ok(nc, subjects.files("put"), data[:40], first(data))
    uid = up["id"]
    msg = await refused(nc, data[40:80], part(3, uid), 400, "upload_part_out_of_order",
                        "out of order")
    assert "send part 2" in msg
    assert (await ok(nc, subjects.files("put"), data[40:80], part(2, uid)))["received"] == 80
    msg = await refused(nc, data[40:80], part(2, uid), 400, "upload_part_out_of_order",
                        "duplicate")
    assert "send part 3" in msg
    await refused(nc, data[80:], part(3, "upload_nope"), 404, "upload_not_found", "upload_nope")
    f = await ok(nc, subjects.files("put"), data[80:], part(3, uid))
    assert f["object"] == "file" and await files_client.download(nc, f["id"]) == data
    # A part after the last: its file is named, nothing changes.
    before = await file_ids(nc)
    msg = await refused(nc, b"more", part(4, uid), 400, "upload_completed", "complete")
    assert f["id"] in msg
    assert await file_ids(nc) == before
    assert await files_client.download(nc, f["id"]) == data


@pytest.mark.parametrize("case", ["past_the_size", "another_sha256", "whole_with_another_sha"])
async def test_a_bad_upload_is_cancelled_and_leaves_nothing(stack, case):
    nc = stack.client
    data = b"abcdefghij" * 10
    before = await file_ids(nc)
    if case == "whole_with_another_sha":
        await refused(nc, data, first(data, sha="0" * 64), 400, "upload_digest_mismatch",
                      "0" * 64)
        assert await file_ids(nc) == before
        return
    size, sha = (60, None) if case == "past_the_size" else (None, hashlib.sha256(b"x").hexdigest())
    uid = (await ok(nc, subjects.files("put"), data[:50], first(data, size=size, sha=sha)))["id"]
    assert await stored_chunks(nc, uid) == 1
    if case == "past_the_size":
        await refused(nc, data[50:], part(2, uid), 400, "upload_size_mismatch", "past the 60")
    else:
        msg = await refused(nc, data[50:], part(2, uid), 400, "upload_digest_mismatch", sha)
        assert hashlib.sha256(data).hexdigest() in msg
    assert await stored_chunks(nc, uid) == 0 and await file_ids(nc) == before
    await refused(nc, data[50:], part(3, uid), 400, "upload_cancelled", "start again")
    assert await stored_chunks(nc, uid) == 0 and await file_ids(nc) == before


@pytest.mark.parametrize("body,headers,status,needle", [
    (b"x", {UPLOAD_PART_HEADER: "1"}, 400, PURPOSE_HEADER),
    (b"x", first(b"xy", sha="nothex"), 400, UPLOAD_SHA256_HEADER),
    (b"x", first(b"xy", size=-2), 400, UPLOAD_BYTES_HEADER),
    (b"xyz", first(b"xy"), 400, "more than the 2 declared"),
    (b"", first(b"xy"), 400, "at least one byte"),
    (b"x", first(b"xy", **{UPLOAD_ID_HEADER: "upload_abc"}), 400, "part 1 starts an upload"),
    (b"x", first(b"xy", **{PURPOSE_HEADER: "fine-tune"}), 400, "purpose"),
    (b"x", first(b"xy", size=1 << 40), 413, "TENSORBUS_MAX_FILE_BYTES"),
    (b"x", {UPLOAD_PART_HEADER: "2"}, 400, UPLOAD_ID_HEADER),
    (b"x", {UPLOAD_PART_HEADER: "two", UPLOAD_ID_HEADER: "upload_abc"}, 400, "'two'"),
    (b"x", {UPLOAD_PART_HEADER: "0"}, 400, "at least 1"),
])
async def test_a_malformed_part_is_a_400(stack, body, headers, status, needle):
    before = await file_ids(stack.client)
    got, data, hdrs = await ask(stack.client, subjects.files("put"), body, headers)
    assert got == status and needle in hdrs[HEADER_MESSAGE], (data, hdrs)
    assert json.loads(data)["error"]["message"] == hdrs[HEADER_MESSAGE]
    assert await file_ids(stack.client) == before


async def test_an_abandoned_upload_is_swept(stack):
    nc = stack.client
    data = b"z" * 100
    uid = (await ok(nc, subjects.files("put"), data[:10], first(data)))["id"]
    uploads = Uploads(BatchOps(nc, stack.config))
    assert await uploads.sweep(at=now()) == 0  # not yet expired: kept
    assert await stored_chunks(nc, uid) == 1
    assert await uploads.sweep(at=now() + UPLOAD_TTL_S + 1) >= 1
    assert await stored_chunks(nc, uid) == 0
    await refused(nc, data[10:], part(2, uid), 404, "upload_not_found", uid)
