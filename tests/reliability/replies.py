"""Asking the gateway over NATS and judging its answers against the error contract."""

from __future__ import annotations

import re
from dataclasses import dataclass, field

import msgspec

from shared import subjects
from shared.errors import HEADER_CODE, HEADER_MESSAGE, HEADER_RETRY_AFTER

MSGPACK = {"Content-Type": "application/msgpack"}
ERROR_TYPES = {400: "invalid_request_error", 404: "not_found_error", 413: "payload_too_large",
               429: "rate_limit_exceeded", 500: "internal_error", 503: "service_unavailable",
               504: "deadline_exceeded"}

# What must never reach a caller: stack traces, file paths, Python reprs and internals.
LEAK = re.compile(
    r"Traceback|File \"|\.py\b|site-packages|/work/|/tmp/|/home/|/usr/|/root|"
    r"object at 0x|<class |<function |<module |\w+Error\(|\w+Exception\(|"
    r"\bb'|\bb\"|\\x[0-9a-f]{2}|\\u[0-9a-f]{4}|\bline \d+|\bself\b|__\w+__|msgspec|nats\.")


@dataclass
class Reply:
    code: int
    body: dict | list | None
    headers: dict[str, str] = field(default_factory=dict)
    raw: bytes = b""

    @property
    def message(self) -> str:
        return self.body["error"]["message"] if isinstance(self.body, dict) else ""


async def ask(nc, subject: str, data: bytes, *, headers: dict | None = None,
              msgpack: bool = False, timeout: float = 20.0) -> Reply:
    if msgpack:
        headers = {**(headers or {}), **MSGPACK}
    msg = await nc.request(subject, data, timeout=timeout, headers=headers)
    hdrs = dict(msg.headers or {})
    code = int(hdrs.get(HEADER_CODE, 200))
    try:
        body = (msgspec.msgpack.decode if msgpack else msgspec.json.decode)(msg.data)
    except msgspec.DecodeError:
        body = None
    return Reply(code, body, hdrs, msg.data)


def assert_refused(reply: Reply, status: int, needle: str = "", code: str | None = None) -> None:
    """A refusal per docs/protocol.md: status header, typed body, clean message."""
    assert reply.code == status, (reply.code, reply.raw[:300])
    assert isinstance(reply.body, dict) and set(reply.body) == {"error"}, reply.raw[:300]
    err = reply.body["error"]
    assert set(err) == {"message", "type", "code"}
    assert err["type"] == ERROR_TYPES[status]
    assert isinstance(err["code"], str) and err["code"]
    if code is not None:
        assert err["code"] == code, err
    assert_clean(err["message"])
    # The header carries the same message (control characters flattened to spaces).
    assert " ".join(reply.headers[HEADER_MESSAGE].split()) == " ".join(err["message"].split())
    if needle:
        assert needle.lower() in err["message"].lower(), err["message"]
    if status in (429, 503):
        assert float(reply.headers[HEADER_RETRY_AFTER]) > 0


def assert_clean(message: str) -> None:
    assert message and len(message) <= 600, message
    assert not LEAK.search(message), f"internals leak into the message: {message!r}"


async def embedding_works(nc, model: str) -> None:
    r = await ask(nc, subjects.EMBEDDINGS, msgspec.json.encode({"model": model, "input": ["still fine"]}))
    assert r.code == 200, r.raw[:300]
    assert len(r.body["data"]) == 1 and len(r.body["data"][0]["embedding"]) == 384


async def completion_works(nc, model: str) -> None:
    r = await ask(nc, subjects.COMPLETIONS, msgspec.json.encode(
        {"model": model, "prompt": "the quick brown", "max_tokens": 2, "temperature": 0}))
    assert r.code == 200, r.raw[:300]
    assert r.body["usage"]["completion_tokens"] >= 1
    assert r.body["choices"][0]["finish_reason"] in ("stop", "length")
