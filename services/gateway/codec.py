"""Bytes at the edge: JSON or msgpack in, the same out, errors per the contract."""

from __future__ import annotations

import re
from typing import Any

import msgspec

from shared.errors import ServiceError, bad_request

MSGPACK = "application/msgpack"
JSON = "application/json"
VERSION_HEADER = "Tensorbus-Model-Version"  # which version of the model answered
IGNORED_HEADER = "Tensorbus-Ignored-Fields"  # documented request fields not acted on

_json_enc = msgspec.json.Encoder()
_mp_enc = msgspec.msgpack.Encoder()
_BYTE_ESCAPE = re.compile(r"'\\x([0-9a-f]{2})'")
_decoders: dict[tuple[type, bool],
                msgspec.json.Decoder[Any] | msgspec.msgpack.Decoder[Any]] = {}


def is_msgpack(headers: dict[str, str] | None) -> bool:
    if not headers:
        return False
    ct = headers.get("Content-Type") or headers.get("content-type") or ""
    return ct.split(";")[0].strip().lower() in (MSGPACK, "application/x-msgpack")


def decode(body: bytes, typ: type, msgpack: bool = False):
    """Decode a request body into `typ`, or raise a 400 that says what is wrong."""
    key = (typ, msgpack)
    dec = _decoders.get(key)
    if dec is None:
        dec = (msgspec.msgpack.Decoder if msgpack else msgspec.json.Decoder)(typ)
        _decoders[key] = dec
    if not body:
        raise bad_request("the request body is empty; send a JSON object")
    try:
        return dec.decode(body)
    except msgspec.ValidationError as exc:
        raise bad_request(f"invalid request: {exc}") from None
    except msgspec.DecodeError as exc:
        kind = "msgpack" if msgpack else "JSON"
        raise bad_request(f"the body is not valid {kind}: {_short(exc)}") from None
    except RecursionError:  # the decoder's own bound on nesting, not a failure of ours
        raise bad_request("the body nests objects and lists deeper than this server reads",
                          code="nesting_too_deep") from None


def _short(exc: Exception) -> str:
    # msgspec names a bad msgpack opcode as a Python bytes escape ('\xc1'): say 0xc1.
    return _BYTE_ESCAPE.sub(r"0x\1", str(exc).split("\n")[0][:200])


def encode(obj, msgpack: bool = False) -> bytes:
    return _mp_enc.encode(obj) if msgpack else _json_enc.encode(obj)


def reply_headers(msgpack: bool, version: str = "",
                  ignored: list[str] | None = None) -> dict[str, str] | None:
    """Headers of a successful reply: its encoding, the version that answered, and
    the request's fields that nothing acted on."""
    headers = {"Content-Type": MSGPACK} if msgpack else {}
    if version:
        headers[VERSION_HEADER] = version
    if ignored:
        headers[IGNORED_HEADER] = ", ".join(ignored)
    return headers or None


def error_reply(err: ServiceError, msgpack: bool = False,
                version: str = "") -> tuple[bytes, dict[str, str]]:
    """An error's body and headers; `version` names the version that failed it, when
    the request reached one (as over HTTP)."""
    headers = err.headers()
    if version:
        headers[VERSION_HEADER] = version
    if msgpack:
        headers["Content-Type"] = MSGPACK
    return encode(err.to_body(), msgpack), headers
