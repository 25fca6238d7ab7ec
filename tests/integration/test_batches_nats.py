"""The Files and Batch API over NATS (`inference.v1.files.*`, `inference.v1.batches.*`)
through the stack of test_batches.py (a real nats-server, gateway, scheduler, a
SmolLM2-135M-Instruct decoder and a MiniLM encoder, the batch runner as its own
process):

- A file put and a batch created over the bus run to completion; the file's
  record, the batch's and the output file's bytes read over NATS are the HTTP
  routes' answers; each output line's text is the interactive request's (greedy).
- Lists and deletes answer as `GET /v1/files` and `DELETE /v1/files/{id}` do.
- A bad body, an unknown field, a missing purpose, an unknown id or a batch that
  cannot be cancelled is a reply in the error contract (Nats-Service-Error-Code,
  Nats-Service-Error, the error body), never a dropped request.
"""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import msgspec
import pytest

from shared import subjects
from shared.api_batches import FILENAME_HEADER, PURPOSE_HEADER
from shared.errors import HEADER_CODE, HEADER_MESSAGE
from tests.integration.test_batches import (  # noqa: F401 (fixtures)
    MODEL,
    chat_line,
    engine,
    jsonl,
    runner,
    stack,
)

QUESTIONS = ["What is the capital of France?", "Name a planet."]
BATCH = {"endpoint": "/v1/chat/completions", "completion_window": "24h"}


async def ask(nc, subject: str, body: bytes | dict = b"", headers=None):
    """(status, reply bytes, headers) of one request."""
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    msg = await nc.request(subject, data, timeout=30, headers=headers)
    hdrs = msg.headers or {}
    return int(hdrs.get(HEADER_CODE, 200)), msg.data, hdrs


async def ok(nc, subject: str, body: bytes | dict = b"", headers=None) -> dict:
    code, data, _ = await ask(nc, subject, body, headers)
    assert code == 200, data
    return json.loads(data)


async def put(nc, data: bytes) -> dict:
    return await ok(nc, subjects.files("put"), data,
                    {PURPOSE_HEADER: "batch", FILENAME_HEADER: "input.jsonl"})


async def until_final(nc, batch_id: str, timeout: float = 60.0) -> dict:
    """The batch once it is final (polled over NATS; a deadline, not a sleep)."""
    end = time.monotonic() + timeout
    while True:
        b = await ok(nc, subjects.batches("get"), {"batch_id": batch_id})
        if b["status"] in ("completed", "failed", "cancelled", "expired"):
            return b
        assert time.monotonic() < end, f"batch stuck: {b['status']} {b['request_counts']}"
        await asyncio.sleep(0.05)


async def test_a_batch_over_nats_answers_as_over_http(stack, runner):
    nc = stack.client
    lines = [chat_line(f"q{i}", q) for i, q in enumerate(QUESTIONS)]
    f = await put(nc, jsonl(lines))
    assert f["object"] == "file" and f["purpose"] == "batch" and f["bytes"] == len(jsonl(lines))
    assert f["filename"] == "input.jsonl"
    created = await ok(nc, subjects.batches("create"),
                       {**BATCH, "input_file_id": f["id"], "metadata": {"via": "nats"}})
    assert created["status"] == "validating" and created["metadata"] == {"via": "nats"}
    done = await until_final(nc, created["id"])
    assert done["status"] == "completed", done
    assert done["request_counts"] == {"total": 2, "completed": 2, "failed": 0}
    out = (await ask(nc, subjects.files("content"), {"file_id": done["output_file_id"]}))[1]
    async with httpx.AsyncClient(base_url=stack.http_url, timeout=30) as http:
        assert out == (await http.get(f"/v1/files/{done['output_file_id']}/content")).content
        assert await ok(nc, subjects.files("get"), {"file_id": f["id"]}) == \
            (await http.get(f"/v1/files/{f['id']}")).json()
        assert await ok(nc, subjects.batches("get"), {"batch_id": done["id"]}) == \
            (await http.get(f"/v1/batches/{done['id']}")).json()
    assert (await ask(nc, subjects.files("content"), {"file_id": f["id"]}))[1] == jsonl(lines)
    # Each line is what the same request gets interactively (greedy, over the bus).
    answers = {x["custom_id"]: x for x in map(json.loads, out.splitlines())}
    assert sorted(answers) == ["q0", "q1"]
    for line in lines:
        alone = await ok(nc, subjects.CHAT_COMPLETIONS, line["body"])
        got = answers[line["custom_id"]]["response"]
        assert got["status_code"] == 200
        assert got["body"]["choices"][0]["message"]["content"] == \
            alone["choices"][0]["message"]["content"]
    # Lists, newest first, in pages; a finished batch cannot be cancelled.
    files = await ok(nc, subjects.files("list"), {"purpose": "batch", "limit": 100})
    assert f["id"] in [x["id"] for x in files["data"]]
    batches = await ok(nc, subjects.batches("list"))  # an empty body: the defaults
    assert batches["data"][0]["id"] == done["id"] and batches["object"] == "list"
    one = await ok(nc, subjects.batches("list"), {"limit": 1})
    assert len(one["data"]) == 1
    code, body, hdrs = await ask(nc, subjects.batches("cancel"), {"batch_id": done["id"]})
    assert code == 400 and "completed" in hdrs[HEADER_MESSAGE]
    assert json.loads(body)["error"]["type"] == "invalid_request_error"


async def test_delete_then_not_found(stack):
    nc = stack.client
    f = await put(nc, b'{"custom_id": "x"}\n')
    assert await ok(nc, subjects.files("delete"), {"file_id": f["id"]}) == \
        {"id": f["id"], "object": "file", "deleted": True}
    for op in ("get", "content", "delete"):
        code, body, hdrs = await ask(nc, subjects.files(op), {"file_id": f["id"]})
        assert code == 404, op
        assert json.loads(body)["error"]["code"] == "file_not_found"
        assert f["id"] in hdrs[HEADER_MESSAGE]


MSGPACK = {"Content-Type": "application/msgpack"}


@pytest.mark.parametrize("subject,body,headers,status,needle", [
    (subjects.files("get"), b"{not json", None, 400, "not valid JSON"),
    (subjects.files("get"), b"", None, 400, "body is empty"),
    (subjects.files("get"), {"file_id": "f", "extra": 1}, None, 400, "extra"),
    (subjects.files("get"), {"id": "f"}, None, 400, "`id`"),
    (subjects.files("delete"), {}, None, 400, "`file_id`"),
    (subjects.files("get"), b"\xc1", MSGPACK, 400, "not valid msgpack"),
    (subjects.files("list"), {"limit": "ten"}, None, 400, "limit"),
    (subjects.files("put"), b"{}\n", None, 400, PURPOSE_HEADER),
    (subjects.files("put"), b"{}\n", {PURPOSE_HEADER: "fine-tune"}, 400, "purpose"),
    (subjects.batches("get"), {"batch_id": "batch_nope"}, None, 404, "batch_nope"),
    (subjects.batches("cancel"), {"batch_id": "batch_nope"}, None, 404, "batch_nope"),
    (subjects.batches("create"), b"[]", None, 400, "invalid batch request"),
    (subjects.batches("create"), {**BATCH, "input_file_id": "file_nope"}, None, 400,
     "file_nope"),
    (subjects.batches("create"), {**BATCH, "endpoint": "/v1/rerank", "input_file_id": "f"},
     None, 400, "endpoint"),
    (subjects.batches("create"), msgspec.msgpack.encode({"endpoint": 1}), MSGPACK, 400,
     "invalid request"),
])
async def test_a_bad_request_is_an_error_in_the_contract(stack, subject, body, headers,
                                                         status, needle):
    code, data, hdrs = await ask(stack.client, subject, body, headers)
    assert code == status, data
    assert needle in hdrs[HEADER_MESSAGE]
    decode = msgspec.msgpack.decode if headers == MSGPACK else json.loads
    err = decode(data)["error"]
    assert err["message"] == hdrs[HEADER_MESSAGE] and err["type"]


async def test_content_larger_than_a_bus_message_is_a_413_naming_the_limit(stack):
    """One reply carries a file's bytes: more than the server's max_payload is a 413
    that says so (HTTP serves it)."""
    nc = stack.client
    big = b"x" * (nc.max_payload + 1)
    async with httpx.AsyncClient(base_url=stack.http_url, timeout=60) as http:
        r = await http.post("/v1/files", data={"purpose": "batch"},
                            files={"file": ("big.jsonl", big)})
        assert r.status_code == 200, r.text
        fid = r.json()["id"]
        code, data, hdrs = await ask(nc, subjects.files("content"), {"file_id": fid})
        assert code == 413 and "max_payload" in hdrs[HEADER_MESSAGE]
        assert json.loads(data)["error"]["type"] == "payload_too_large"
        assert (await ok(nc, subjects.files("get"), {"file_id": fid}))["bytes"] == len(big)
        assert (await http.delete(f"/v1/files/{fid}")).status_code == 200
