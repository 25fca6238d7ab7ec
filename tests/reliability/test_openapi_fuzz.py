"""The HTTP API fuzzed with schemathesis from the gateway's own `/openapi.json`.

Every operation gets schema-shaped bodies (half of them naming a model that is really
served, so the model path runs too) and bodies that break the schema. No answer is a
5xx, every refusal carries the error body, and the gateway still serves afterwards.
Bounded: a fixed seed and a few dozen examples per operation. schemathesis calls with
a synchronous HTTP client, so it runs on a thread while the stack runs on the loop.
"""

from __future__ import annotations

import asyncio

import httpx
# Imported here, on the main thread: imported first inside fuzz_operations' thread,
# while the stack's threads compiled too, CPython 3.11 failed to compile one of its
# modules ("AST constructor recursion depth mismatch", a race in the compiler).
import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from schemathesis import GenerationMode

from tests.reliability.conftest import DECODER, ENCODER
from tests.reliability.replies import assert_clean

EXAMPLES = 40
FUZZ = settings(max_examples=EXAMPLES, deadline=None, derandomize=True, database=None,
                suppress_health_check=list(HealthCheck))
REAL_MODEL = {"/v1/embeddings": ENCODER, "/v1/completions": DECODER,
              "/v1/chat/completions": DECODER}


def check(response) -> None:
    assert response.status_code < 500, (
        response.status_code, response.text[:300])
    if response.status_code >= 400 and response.request.url.endswith(tuple(REAL_MODEL)):
        err = response.json()["error"]
        assert set(err) == {"message", "type", "code"}
        assert_clean(err["message"])


def fuzz_operations(base_url: str) -> tuple[list[str], list[int]]:
    schema = schemathesis.openapi.from_url(f"{base_url}/openapi.json")
    schema.config.generation.update(modes=[GenerationMode.POSITIVE, GenerationMode.NEGATIVE])
    done, statuses = [], []
    for result in schema.get_all_operations():
        op = result.ok()
        model = REAL_MODEL.get(op.path)

        def served_model(case, model=model):
            # Half of the valid-looking bodies name a served model, so the model runs.
            if model and isinstance(case.body, dict) and "model" in case.body:
                case.body["model"] = model
            return case

        strategy = op.as_strategy()
        if model:
            strategy = st.one_of(strategy, strategy.map(served_model))

        @FUZZ
        @given(case=strategy)
        def run(case):
            response = case.call(base_url=base_url, timeout=30)
            statuses.append(response.status_code)
            check(response)

        run()
        done.append(op.label)
    return done, statuses


async def test_http_api_fuzzed_from_its_openapi_document(served):
    base = served.http_url
    ops, statuses = await asyncio.to_thread(fuzz_operations, base)
    assert 200 in statuses and 400 in statuses  # both the served and the refused paths ran
    assert {"POST /v1/embeddings", "POST /v1/completions", "POST /v1/chat/completions",
            "GET /v1/models"} <= set(ops)
    async with httpx.AsyncClient(base_url=base, timeout=30) as http:
        r = await http.post("/v1/embeddings", json={"model": ENCODER, "input": "still fine"})
        assert r.status_code == 200 and len(r.json()["data"][0]["embedding"]) == 384


async def test_http_headers_over_the_limit_are_refused_not_crashed(served):
    """Thousands of headers over HTTP are refused with a 431 (not read into a model)."""
    headers = {f"x-junk-{i}": "v" * 16 for i in range(3000)}
    async with httpx.AsyncClient(base_url=served.http_url, timeout=30) as http:
        try:
            r = await http.post("/v1/embeddings", json={"model": ENCODER, "input": "x"},
                                headers=headers)
            assert r.status_code == 431, r.status_code
            assert_clean(r.json()["error"]["message"])
        except httpx.RemoteProtocolError:
            pass  # h11 may close the connection on an oversized header block
        r = await http.post("/v1/embeddings", json={"model": ENCODER, "input": "still fine"})
        assert r.status_code == 200
