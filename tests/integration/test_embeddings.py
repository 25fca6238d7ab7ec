"""The embeddings path end to end: real nats-server, real weights, real JAX engine.

Correctness is judged against sentence-transformers on the same weights; every error
of the contract is provoked and must be followed by a request that still succeeds.
"""

from __future__ import annotations

import asyncio

import msgspec
import numpy as np
import pytest
import pytest_asyncio

from shared import subjects
from shared.errors import HEADER_CODE, HEADER_MESSAGE
from tests.support.stack import running_stack

MODEL = "all-MiniLM-L6-v2"
LONG = " ".join(f"word{i} is followed by a comma, then more text" for i in range(20))  # 242 tokens
TOO_LONG = LONG + " and then some words past the limit" * 3


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def stack(nats_server, minilm, sentence_transformer):
    # sentence_transformer is loaded first: a slow synchronous load while the
    # in-process services run would freeze all of them at once.
    async with running_stack(nats_server.url, max_inputs=32) as st:
        await st.add_worker(minilm, "enc-1")
        yield st


async def embed(nc, payload, *, msgpack=False, timeout=30.0, raw: bytes | None = None):
    headers = {"Content-Type": "application/msgpack"} if msgpack else None
    data = raw if raw is not None else (msgspec.msgpack.encode(payload) if msgpack else msgspec.json.encode(payload))
    msg = await nc.request(subjects.EMBEDDINGS, data, timeout=timeout, headers=headers)
    code = int((msg.headers or {}).get(HEADER_CODE, 200))
    body = msgspec.msgpack.decode(msg.data) if msgpack else msgspec.json.decode(msg.data)
    return code, body, msg.headers or {}


def cosine(a, b) -> np.ndarray:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return (a * b).sum(-1) / (np.linalg.norm(a, axis=-1) * np.linalg.norm(b, axis=-1))


async def test_embeddings_match_sentence_transformers(stack, sentence_transformer):
    texts = ["hello world", "The quick brown fox jumps over the lazy dog.",
             "Ünïcödé, emoji 🚀 and 中文 text", LONG, LONG[:500]]
    lengths = [len(x) for x in sentence_transformer.tokenizer(texts)["input_ids"]]
    assert max(lengths) > 128  # beyond the shipped tokenizer.json's truncation
    code, resp, _ = await embed(stack.client, {"model": MODEL, "input": texts})
    assert code == 200
    assert resp["object"] == "list" and resp["model"] == MODEL
    got = np.array([d["embedding"] for d in sorted(resp["data"], key=lambda d: d["index"])])
    assert got.shape == (5, 384)
    np.testing.assert_allclose(np.linalg.norm(got, axis=1), 1.0, atol=1e-5)
    ref = sentence_transformer.encode(texts, normalize_embeddings=True)
    assert cosine(got, ref).min() >= 0.9999
    assert resp["usage"]["prompt_tokens"] == sum(lengths)


async def test_single_string_and_msgpack_and_base64(stack, sentence_transformer):
    ref = sentence_transformer.encode(["hello world"], normalize_embeddings=True)[0]
    code, resp, hdrs = await embed(stack.client, {"model": MODEL, "input": "hello world"}, msgpack=True)
    assert code == 200 and hdrs.get("Content-Type") == "application/msgpack"
    assert cosine(resp["data"][0]["embedding"], ref) >= 0.9999
    code, resp, _ = await embed(stack.client, {"model": MODEL, "input": "hello world",
                                               "encoding_format": "base64"})
    import base64
    vec = np.frombuffer(base64.b64decode(resp["data"][0]["embedding"]), np.float32)
    assert cosine(vec, ref) >= 0.9999


async def test_token_id_input_equals_text_input(stack, sentence_transformer):
    ids = sentence_transformer.tokenizer("hello world", add_special_tokens=False)["input_ids"]
    _, by_text, _ = await embed(stack.client, {"model": MODEL, "input": ["hello world"]})
    code, by_ids, _ = await embed(stack.client, {"model": MODEL, "input": [ids]})
    assert code == 200
    assert cosine(by_text["data"][0]["embedding"], by_ids["data"][0]["embedding"]) >= 0.99999


async def test_tei_embed_route_serves_its_body(stack, sentence_transformer):
    """TEI's /embed: `inputs` (a string or a list), no model named (the one embedding
    model served), a bare list of vectors as sentence-transformers computes them;
    `truncate` cuts an over-long input at the limit; `normalize: false` cannot be
    had from a model that normalises in its own modules."""
    import httpx

    texts = ["hello world", "The quick brown fox jumps over the lazy dog."]
    async with httpx.AsyncClient(base_url=stack.http_url, timeout=60) as http:
        many = await http.post("/embed", json={"inputs": texts})
        one = await http.post("/embed", json={"inputs": texts[0], "model": MODEL})
        cut = await http.post("/embed", json={"inputs": [TOO_LONG], "truncate": True})
        long = await http.post("/embed", json={"inputs": [TOO_LONG]})
        raw = await http.post("/embed", json={"inputs": "x", "normalize": False})
    assert many.status_code == one.status_code == cut.status_code == 200, (many.text, cut.text)
    got = np.asarray(many.json())
    assert got.shape == (2, 384)
    assert cosine(got, sentence_transformer.encode(texts)).min() >= 0.9999
    assert cosine(np.asarray(one.json()), got[:1]).min() >= 0.99999
    assert cosine(np.asarray(cut.json()), sentence_transformer.encode([TOO_LONG])).min() >= 0.9999
    assert long.status_code == 400 and "at most 256" in long.json()["error"]["message"]
    assert raw.status_code == 400 and "normalize" in raw.json()["error"]["message"]


async def test_models_lists_what_is_served_and_ready(stack):
    # The card counts the workers whose heartbeats are current: on a loaded machine
    # one may be late for a moment (worker_expiry_s) and back at the next, so the
    # listing is read until it shows the worker, within a bound.
    loop = asyncio.get_running_loop()
    until = loop.time() + 20
    while True:
        msg = await stack.client.request(subjects.MODELS, b"", timeout=5)
        cards = msgspec.json.decode(msg.data)["data"]
        card = next(c for c in cards if c["id"] == MODEL)
        if card["ready_workers"] == 1 or loop.time() > until:
            break
        await asyncio.sleep(0.05)  # polled: the condition above is what is waited on
    assert card["ready_workers"] == 1 and card["kind"] == "encoder"
    # An encoder's programs: MiniLM packs, 8 of them serve every batch and length.
    assert card["programs_compiled"] == card["programs_total"] == 8


BAD = [
    ("malformed json", dict(raw=b'{"model": "all-MiniLM-L6-v2", "input": ['), 400, "not valid JSON"),
    ("truncated msgpack", dict(raw=msgspec.msgpack.encode({"model": MODEL, "input": ["hi"]})[:-3],
                               msgpack=True), 400, "not valid msgpack"),
    ("garbage bytes", dict(raw=b"\x00\xff\xfe garbage"), 400, "not valid JSON"),
    ("empty body", dict(raw=b""), 400, "empty"),
    ("input wrong type", dict(payload={"model": MODEL, "input": 42}), 400, "input"),
    ("model wrong type", dict(payload={"model": 7, "input": ["x"]}), 400, "model"),
    ("missing model", dict(payload={"input": ["x"]}), 400, "model"),
    ("unknown field", dict(payload={"model": MODEL, "input": ["x"], "temprature": 1}), 400, "temprature"),
    ("unknown model", dict(payload={"model": "no-such-model", "input": ["x"]}), 404, "no-such-model"),
    ("empty list", dict(payload={"model": MODEL, "input": []}), 400, "empty"),
    ("empty string", dict(payload={"model": MODEL, "input": ""}), 400, "empty"),
    ("mixed input kinds", dict(payload={"model": MODEL, "input": ["x", 5]}), 400, "mixes"),
    ("too many inputs", dict(payload={"model": MODEL, "input": ["x"] * 33}), 400, "too many inputs"),
    ("over the token limit", dict(payload={"model": MODEL, "input": [TOO_LONG]}), 400, "at most 256"),
    ("token id out of vocabulary", dict(payload={"model": MODEL, "input": [[10**6]]}), 400, "vocabulary"),
    ("payload over the limit", dict(payload={"model": MODEL, "input": ["a" * 1_100_000]}), 413, "limit"),
    ("wrong dimensions", dict(payload={"model": MODEL, "input": ["x"], "dimensions": 100}), 400, "384"),
    ("NUL byte", dict(payload={"model": MODEL, "input": ["a\x00b"]}), 400, "NUL"),
]


@pytest.mark.parametrize("name,kw,status,needle", BAD, ids=[b[0] for b in BAD])
async def test_bad_request_gets_a_clear_error_and_the_next_request_succeeds(stack, name, kw, status, needle):
    code, resp, hdrs = await embed(stack.client, kw.get("payload"), raw=kw.get("raw"),
                                   msgpack=kw.get("msgpack", False))
    assert code == status, resp
    err = resp["error"]
    assert needle in err["message"] and err["type"] and err["code"]
    assert hdrs[HEADER_MESSAGE] == err["message"]
    assert "/" not in err["message"].replace("NAME@VERSION", "") and "Traceback" not in err["message"]
    code, resp, _ = await embed(stack.client, {"model": MODEL, "input": ["still fine"]})
    assert code == 200 and len(resp["data"][0]["embedding"]) == 384
