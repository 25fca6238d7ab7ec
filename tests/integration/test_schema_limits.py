"""Limits on structured-output schemas and grammars (services/gateway/structured_limits.py),
over a real nats-server with the mock decoder: a schema, regex, grammar or tool's
parameters over TENSORBUS_MAX_SCHEMA_BYTES or nested past TENSORBUS_MAX_SCHEMA_DEPTH
is a 400 naming the field and the limit, on HTTP and on NATS, before any work is
admitted (the worker generates nothing for it); a pathologically deep one is the same
400, never a 500; a normal schema is still served; and grammars that take longer than
TENSORBUS_MAX_SCHEMA_COMPILE_S to compile are a 400 naming that limit, refused at once
when sent again, while the gateway goes on serving."""

from __future__ import annotations

import time

import httpx
import msgspec
import pytest

from shared import subjects
from shared.errors import HEADER_CODE
from tests.support.mock_engine import MockDecoder
from tests.support.stack import running_stack

MODEL = "tensorbus-demo-lm"
MAX_BYTES, MAX_DEPTH = 4096, 8
CHAT = [{"role": "user", "content": "hi"}]
NORMAL = {"type": "object", "properties": {"a": {"type": "string"}}}


def nested(depth: int) -> dict:
    """A schema whose objects nest `depth` levels (each level: an object, its
    `properties` map)."""
    schema: dict = {"type": "string"}
    for _ in range(depth // 2):
        schema = {"type": "object", "properties": {"a": schema}}
    return schema


def deep_text(depth: int) -> msgspec.Raw:
    """`nested(depth)` as JSON text: too deep for the test's own encoder."""
    n = depth // 2
    return msgspec.Raw(('{"type":"object","properties":{"a":' * n + '{"type":"string"}'
                        + "}}" * n).encode())


def wide(n: int) -> dict:
    return {"type": "object", "properties": {
        f"p{i}": {"type": "string", "pattern": f"^[a-z]{{{i % 7 + 1},{i % 5 + 9}}}x{i}$"}
        for i in range(n)}}


def response_format(schema: dict) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "s", "schema": schema}}


def tool(parameters: dict) -> list:
    return [{"type": "function", "function": {"name": "f", "parameters": parameters}}]


CASES = [  # (body fields, the field named, the limit named)
    ({"response_format": response_format(wide(200))},
     "response_format.json_schema.schema", "TENSORBUS_MAX_SCHEMA_BYTES"),
    ({"response_format": response_format(nested(20))},
     "response_format.json_schema.schema", "TENSORBUS_MAX_SCHEMA_DEPTH"),
    ({"guided_json": nested(20)}, "guided_json", "TENSORBUS_MAX_SCHEMA_DEPTH"),
    ({"guided_regex": "a" * 5000}, "guided_regex", "TENSORBUS_MAX_SCHEMA_BYTES"),
    ({"guided_grammar": "start: " + " ".join(['"x"'] * 1500)}, "guided_grammar",
     "TENSORBUS_MAX_SCHEMA_BYTES"),
    ({"structured_outputs": {"choice": ["x" * 100] * 50}}, "structured_outputs.choice",
     "TENSORBUS_MAX_SCHEMA_BYTES"),
    ({"tools": tool(nested(20)), "tool_choice": "required"}, "tools[0].function.parameters",
     "TENSORBUS_MAX_SCHEMA_DEPTH"),
    ({"tools": tool(wide(200))}, "tools[0].function.parameters", "TENSORBUS_MAX_SCHEMA_BYTES"),
    # pathological: far deeper than the limit, or than the body's decoder reads
    ({"guided_json": deep_text(600)}, "guided_json", "TENSORBUS_MAX_SCHEMA_DEPTH"),
    ({"guided_json": deep_text(10_000)}, "", "deeper than this server reads"),
]


def chat(**fields) -> dict:
    return {"model": MODEL, "messages": CHAT, "max_tokens": 2, **fields}


@pytest.mark.parametrize("fields,field,limit", CASES)
async def test_each_schema_limit_is_a_400_naming_it_on_both_transports(nats_server, fields,
                                                                       field, limit):
    async with running_stack(nats_server.url, max_schema_bytes=MAX_BYTES,
                             max_schema_depth=MAX_DEPTH) as st:
        worker = await st.add_worker(MockDecoder(name=MODEL), "w-schema", kind="decoder")
        body = msgspec.json.encode(chat(**fields))
        async with httpx.AsyncClient(base_url=st.http_url, timeout=30) as http:
            r = await http.post("/v1/chat/completions", content=body)
            assert r.status_code == 400, r.text
            _names(r.json()["error"]["message"], field, limit)

            msg = await st.client.request(subjects.CHAT_COMPLETIONS, body, timeout=30)
            assert msg.headers[HEADER_CODE] == "400"
            _names(msgspec.json.decode(msg.data)["error"]["message"], field, limit)
            assert worker.runner.generated == 0  # refused before any work was admitted

            r = await http.post("/v1/chat/completions",
                                json=chat(response_format=response_format(NORMAL)))
            assert r.status_code == 200, r.text
            assert worker.runner.generated == 2


def _names(message: str, field: str, limit: str) -> None:
    assert (not field or f"'{field}'" in message) and limit in message, message


async def test_a_grammar_slow_to_compile_is_a_400_and_refused_at_once_again(nats_server):
    """A compile limit no grammar can meet (5 ms: llguidance takes tens of ms for
    this schema): a 400 naming it, on both transports; the same structure is then
    refused without compiling; requests without a structure are served meanwhile."""
    async with running_stack(nats_server.url, max_schema_compile_s=0.005) as st:
        await st.add_worker(MockDecoder(name=MODEL), "w-compile", kind="decoder")
        body = msgspec.json.encode(chat(response_format=response_format(wide(300))))
        async with httpx.AsyncClient(base_url=st.http_url, timeout=30) as http:
            r = await http.post("/v1/chat/completions", content=body)
            assert r.status_code == 400, r.text
            err = r.json()["error"]
            assert err["code"] == "schema_too_complex"
            _names(err["message"], "response_format.json_schema.schema",
                   "TENSORBUS_MAX_SCHEMA_COMPILE_S")

            t0 = time.monotonic()
            msg = await st.client.request(subjects.CHAT_COMPLETIONS, body, timeout=30)
            assert msg.headers[HEADER_CODE] == "400"
            assert "TENSORBUS_MAX_SCHEMA_COMPILE_S" in msg.headers["Nats-Service-Error"]
            assert time.monotonic() - t0 < 1

            r = await http.post("/v1/chat/completions", json=chat())
            assert r.status_code == 200, r.text
