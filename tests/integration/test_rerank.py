"""Rerank and score end to end: a real nats-server, the real JAX engine on a tiny
cross-encoder (ms-marco-MiniLM's architecture, random weights) saved here by
sentence-transformers, and its `CrossEncoder.predict` on the same weights as the
reference for every score and every order.
"""

from __future__ import annotations

import asyncio
import threading
import time

import httpx
import msgspec
import numpy as np
import pytest
import pytest_asyncio
from prometheus_client.parser import text_string_to_metric_families

from shared import subjects
from shared.errors import HEADER_CODE, HEADER_MESSAGE
from shared.messages import (EmbedResult, EmbedWork, WorkError, encode, result_decoder,
                             work_decoder)
from shared.telemetry import RequestRecord, record_decoder
from bench.support import tiny_encoders
from tests.support.stack import running_stack, wait_until
from tests.support.telemetry import running_telemetry

MODEL = "tiny-reranker"
QUERY = "what powers the sun?"
DOCS = ["Nuclear fusion powers the sun, turning hydrogen into helium.", "A man is eating food.",
        "the quick brown fox jumps over the lazy dog", "hi", "dog " * 12,
        "The sun is a star at the centre of the solar system.", "Paris is the capital of France."]
TOO_LONG = "word " * 60  # past the model's 48 tokens a pair


class Gated:
    """The real engine; `gate` holds a batch on the engine thread (`entered`: one
    started), `sizes` the pairs of each batch it scored."""

    def __init__(self, inner) -> None:
        self.inner = inner
        self.gate = threading.Event()
        self.gate.set()
        self.entered = threading.Event()
        self.sizes: list[int] = []

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def score(self, inputs, types, raw=False):
        self.entered.set()
        self.gate.wait()
        self.sizes.append(len(inputs))
        return self.inner.score(inputs, types, raw=raw)


@pytest.fixture(scope="module")
def reranker(tmp_path_factory, jax_cache_dir):
    from engine.encoder import EncoderEngine

    d = tmp_path_factory.mktemp("reranker")
    ce = tiny_encoders.build_cross_encoder(d, "bert", num_labels=1)
    engine = EncoderEngine(d / "ce", name=MODEL, batch_buckets=(1, 2, 4, 8, 16),
                           seq_buckets=(16, 32), max_batch=16)
    return ce, Gated(engine), d / "ce"


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def stack(nats_server, reranker):
    _, engine, path = reranker
    async with running_stack(nats_server.url, models={MODEL: str(path)}, max_inputs=8) as st, \
            running_telemetry(nats_server.url) as tel:
        await st.add_worker(engine, "rr-1")
        st.telemetry = tel
        yield st


@pytest_asyncio.fixture
async def records(stack):
    """Every RequestRecord published from now on."""
    got: list[RequestRecord] = []

    async def on(msg):
        rec = record_decoder.decode(msg.data)
        if isinstance(rec, RequestRecord) and rec.model == MODEL:
            got.append(rec)

    sub = await stack.client.subscribe(subjects.TELEMETRY_REQUESTS, cb=on)
    yield got
    await sub.unsubscribe()


async def ask(nc, subject: str, body: dict) -> tuple[int, dict, dict]:
    msg = await nc.request(subject, msgspec.json.encode(body), timeout=60)
    hdrs = msg.headers or {}
    return int(hdrs.get(HEADER_CODE, 200)), msgspec.json.decode(msg.data), hdrs


def predict(ce, pairs) -> np.ndarray:
    return np.asarray(ce.predict(pairs), np.float64).reshape(-1)


def pair_tokens(ce, pairs) -> int:
    feats = ce.tokenizer([a for a, _ in pairs], [b for _, b in pairs])
    return sum(len(x) for x in feats["input_ids"])


async def test_rerank_orders_and_scores_as_cross_encoder(stack, reranker):
    ce = reranker[0]
    pairs = [(QUERY, d) for d in DOCS]
    ref = predict(ce, pairs)
    best = list(np.argsort(-ref, kind="stable"))
    assert np.diff(np.sort(ref)).min() > 1e-3  # a distinct order: the test can fail

    code, resp, _ = await ask(stack.client, subjects.RERANK, {
        "model": MODEL, "query": QUERY, "documents": DOCS, "top_n": 3, "return_documents": True})
    assert code == 200, resp
    assert [r["index"] for r in resp["results"]] == best[:3]
    for r in resp["results"]:
        assert r["relevance_score"] == pytest.approx(ref[r["index"]], abs=1e-4)
        assert r["document"] == {"text": DOCS[r["index"]]}
    tokens = pair_tokens(ce, pairs)
    assert resp["usage"] == {"prompt_tokens": tokens, "total_tokens": tokens}
    assert resp["model"] == MODEL and resp["id"].startswith("rerank-")

    async with httpx.AsyncClient(base_url=stack.http_url, timeout=60) as http:
        r = await http.post("/v1/rerank", json={"model": MODEL, "query": QUERY, "documents": DOCS,
                                                "top_n": 50})
    assert r.status_code == 200, r.text
    results = r.json()["results"]
    assert [x["index"] for x in results] == best  # top_n past the documents: all of them
    assert all("document" not in x for x in results)  # return_documents is off by default
    np.testing.assert_allclose([x["relevance_score"] for x in results], ref[best], atol=1e-4)


async def test_cohere_v2_and_unversioned_paths_rank_and_score_the_same(stack, reranker):
    """The Cohere v2 client posts to /v2/rerank, vLLM's users to /rerank and /score:
    the same endpoints, the cross-encoder's order and scores."""
    ce = reranker[0]
    ref = predict(ce, [(QUERY, d) for d in DOCS])
    best = list(np.argsort(-ref, kind="stable"))
    async with httpx.AsyncClient(base_url=stack.http_url, timeout=60) as http:
        for path in ("/v2/rerank", "/rerank"):
            r = await http.post(path, json={"model": MODEL, "query": QUERY, "documents": DOCS,
                                            "top_n": 2})  # fmt: skip
            assert r.status_code == 200, (path, r.text)
            assert [x["index"] for x in r.json()["results"]] == best[:2]
            np.testing.assert_allclose([x["relevance_score"] for x in r.json()["results"]],
                                       ref[best[:2]], atol=1e-4)  # fmt: skip
        r = await http.post("/score", json={"model": MODEL, "text_1": QUERY, "text_2": DOCS[:3]})
    assert r.status_code == 200, r.text
    np.testing.assert_allclose([d["score"] for d in r.json()["data"]], ref[:3], atol=1e-4)


async def test_tei_rerank_body_and_cohere_document_objects(stack, reranker):
    """TEI's /rerank body (`texts`, `return_text`, no model: the one reranker served)
    and Cohere's documents as objects: the cross-encoder's order and scores."""
    ce = reranker[0]
    ref = predict(ce, [(QUERY, d) for d in DOCS])
    best = list(np.argsort(-ref, kind="stable"))
    async with httpx.AsyncClient(base_url=stack.http_url, timeout=60) as http:
        tei = await http.post("/rerank", json={"query": QUERY, "texts": DOCS, "return_text": True})
        objects = await http.post("/v1/rerank", json={
            "model": MODEL, "query": QUERY, "documents": [{"text": d} for d in DOCS],
            "top_n": 2, "return_documents": True})
    assert tei.status_code == 200, tei.text
    ranks = tei.json()
    assert [r["index"] for r in ranks] == best and [r["text"] for r in ranks] == [DOCS[i] for i in best]
    np.testing.assert_allclose([r["score"] for r in ranks], ref[best], atol=1e-4)
    assert objects.status_code == 200, objects.text
    assert [(r["index"], r["document"]["text"]) for r in objects.json()["results"]] == \
        [(i, DOCS[i]) for i in best[:2]]


async def test_tei_raw_scores_are_the_cross_encoders_logits(stack, reranker):
    """TEI's `raw_scores`: the classifier's logits (CrossEncoder.predict with no
    activation), ranked as the activated scores rank; the activated ones unchanged."""
    import torch

    ce = reranker[0]
    pairs = [(QUERY, d) for d in DOCS]
    logits = np.asarray(ce.predict(pairs, activation_fn=torch.nn.Identity()),
                        np.float64).reshape(-1)
    ref = predict(ce, pairs)
    assert np.abs(logits - ref).min() > 1e-2  # raw and activated differ: the test can fail
    best = list(np.argsort(-logits, kind="stable"))
    async with httpx.AsyncClient(base_url=stack.http_url, timeout=60) as http:
        raw, act = await asyncio.gather(
            http.post("/rerank", json={"query": QUERY, "texts": DOCS, "raw_scores": True}),
            http.post("/rerank", json={"query": QUERY, "texts": DOCS}))
        bad = await http.post("/rerank", json={"query": QUERY, "texts": DOCS,
                                               "raw_scores": "yes"})
    assert raw.status_code == 200 and act.status_code == 200, (raw.text, act.text)
    assert [r["index"] for r in raw.json()] == best
    np.testing.assert_allclose([r["score"] for r in raw.json()], logits[best], atol=1e-4)
    np.testing.assert_allclose([r["score"] for r in act.json()], ref[best], atol=1e-4)
    assert bad.status_code == 400 and "raw_scores" in bad.json()["error"]["message"]


async def test_tei_truncate_cuts_an_over_long_pair_longest_first(stack, reranker):
    """TEI's `truncate`: a pair past the model's 48 tokens is cut to them as
    transformers' `truncation='longest_first'` cuts it, and scored as the model scores
    that cut pair; without it the pair is still a 400 naming it."""
    import torch

    ce = reranker[0]
    texts = ["fine", TOO_LONG, "word " * 20 + "end"]
    whole = ce.tokenizer([QUERY] * 3, texts)["input_ids"]
    assert [len(x) > tiny_encoders.MAX_SEQ for x in whole] == [False, True, False]
    feats = ce.tokenizer([QUERY] * 3, texts, truncation="longest_first",
                         max_length=tiny_encoders.MAX_SEQ, padding=True, return_tensors="pt")
    with torch.no_grad():
        ref = torch.sigmoid(ce.model(**feats).logits).numpy().reshape(-1).astype(np.float64)
    async with httpx.AsyncClient(base_url=stack.http_url, timeout=60) as http:
        cut = await http.post("/rerank", json={"query": QUERY, "texts": texts, "truncate": True})
        refused = await http.post("/rerank", json={"query": QUERY, "texts": texts})
        left = await http.post("/rerank", json={"query": QUERY, "texts": texts, "truncate": True,
                                                "truncation_direction": "left"})
    assert cut.status_code == 200, cut.text
    got = {r["index"]: r["score"] for r in cut.json()}
    np.testing.assert_allclose([got[i] for i in range(3)], ref, atol=1e-4)
    assert refused.status_code == 400
    assert "document 1 takes 68 tokens as a pair" in refused.json()["error"]["message"]
    assert left.status_code == 400 and "truncation_direction" in left.json()["error"]["message"]


async def test_score_pairs_as_cross_encoder(stack, reranker):
    ce = reranker[0]
    texts = DOCS[:4]
    async with httpx.AsyncClient(base_url=stack.http_url, timeout=60) as http:
        one = await http.post("/v1/score", json={"model": MODEL, "text_1": QUERY, "text_2": texts})
        each = await http.post("/v1/score", json={"model": MODEL, "text_1": texts[::-1],
                                                  "text_2": texts})
    assert one.status_code == 200 and each.status_code == 200, (one.text, each.text)
    for resp, pairs in ((one.json(), [(QUERY, t) for t in texts]),
                        (each.json(), list(zip(texts[::-1], texts)))):
        assert resp["object"] == "list" and resp["model"] == MODEL
        assert [d["index"] for d in resp["data"]] == list(range(len(texts)))  # pair order
        np.testing.assert_allclose([d["score"] for d in resp["data"]], predict(ce, pairs),
                                   atol=1e-4)
        assert resp["usage"]["prompt_tokens"] == pair_tokens(ce, pairs)


async def test_a_large_body_is_admitted_and_tokenized_off_the_loop_alike(stack, reranker):
    """A body past the gateway's inline limit is reserved with a scheduler and
    tokenized in a thread (services.gateway.embeddings.tokenized): the same scores.
    A 1,000-character word is one [UNK] token, so the pairs stay within 48 tokens."""
    from services.gateway.frontend import INLINE_TOKENIZE

    ce = reranker[0]
    docs = ["x" * 1000, "sun " + "y" * 1000, DOCS[0]]
    body = {"model": MODEL, "query": QUERY, "documents": docs}
    assert len(msgspec.json.encode(body)) > INLINE_TOKENIZE
    code, resp, _ = await ask(stack.client, subjects.RERANK, body)
    assert code == 200, resp
    ref = predict(ce, [(QUERY, d) for d in docs])
    assert [r["index"] for r in resp["results"]] == list(np.argsort(-ref, kind="stable"))
    np.testing.assert_allclose([r["relevance_score"] for r in resp["results"]],
                               np.sort(ref)[::-1], atol=1e-4)


@pytest.mark.parametrize("subject, body, says", [
    (subjects.RERANK, {"query": QUERY, "documents": []}, "'documents' is empty"),
    (subjects.RERANK, {"query": QUERY, "documents": ["a"] * 9}, "too many documents: 9; at most 8"),
    (subjects.RERANK, {"query": QUERY, "documents": ["fine", TOO_LONG]},
     "document 1 takes 68 tokens as a pair; model 'tiny-reranker' accepts at most 48"),
    (subjects.RERANK, {"query": "", "documents": ["a"]}, "'query' is an empty string"),
    (subjects.RERANK, {"query": QUERY, "documents": ["a", ""]}, "document 1 is an empty string"),
    (subjects.RERANK, {"query": QUERY, "documents": ["a"], "top_n": 0}, "top_n"),
    (subjects.RERANK, {"query": QUERY, "documents": ["a"], "truncate": True}, "truncate"),
    (subjects.SCORE, {"text_1": ["a", "b"], "text_2": ["a", "b", "c"]},
     "'text_1' has 2 texts and 'text_2' 3"),
    (subjects.SCORE, {"text_1": "a", "text_2": []}, "'text_2' is empty"),
    (subjects.EMBEDDINGS, {"input": "hello"}, "is a cross-encoder (reranker)"),
    (subjects.RERANK, {"model": "all-MiniLM-L6-v2", "query": QUERY, "documents": ["a"]},
     "is an embedding model; rerank and score need a cross-encoder"),
])  # fmt: skip
async def test_a_bad_request_is_a_400_while_its_neighbours_are_served(stack, reranker, subject,
                                                                      body, says):
    ce = reranker[0]
    good = {"model": MODEL, "query": QUERY, "documents": DOCS[:3]}
    answers = await asyncio.gather(
        ask(stack.client, subjects.RERANK, good), ask(stack.client, subject, {"model": MODEL, **body}),
        ask(stack.client, subjects.RERANK, good))
    (c1, r1, _), (code, err, hdrs), (c2, r2, _) = answers
    assert code == 400 and hdrs[HEADER_CODE] == "400"
    assert says in err["error"]["message"] and says in hdrs[HEADER_MESSAGE], err
    ref = predict(ce, [(QUERY, d) for d in DOCS[:3]])
    for c, r in ((c1, r1), (c2, r2)):
        assert c == 200
        assert [x["index"] for x in r["results"]] == list(np.argsort(-ref, kind="stable"))


async def submit_pairs(nc, tok, rid: str, docs: list[str], with_types: bool = True,
                       raw: bool = False):
    """(QUERY, doc) pairs as one EmbedWork sent to the scheduler -> its reply's subscription."""
    ids, types = tok.encode_pairs([(QUERY, d) for d in docs])
    inbox = nc.new_inbox()
    sub = await nc.subscribe(inbox)
    work = EmbedWork(rid, MODEL, "", ids, time.time() + 60, inbox,
                     types=types if with_types else [], raw=raw)
    await nc.publish(subjects.SCHED_SUBMIT, encode(work), reply=inbox)
    return sub


async def answer(sub):
    while True:  # Accepted / Held notices may come first
        res = result_decoder.decode((await sub.next_msg(timeout=60)).data)
        if isinstance(res, (EmbedResult, WorkError)):
            await sub.unsubscribe()
            return res


async def test_worker_refuses_embed_work_for_a_reranker_and_serves_its_batch_mates(stack,
                                                                                   reranker):
    """Work a gateway would never send (no token types for a cross-encoder) reaches
    the worker in one batch with good work: it alone gets a 400, the others their scores."""
    from engine.tokenizer import Tokenizer

    ce, engine, path = reranker
    tok = Tokenizer.from_dir(path)
    nc = stack.client

    def submit(rid: str, docs: list[str], with_types: bool = True):
        return submit_pairs(nc, tok, rid, docs, with_types)

    engine.gate.clear()
    engine.entered.clear()
    engine.sizes.clear()
    try:
        first = await submit("rr-first", DOCS[:2])
        await asyncio.to_thread(engine.entered.wait, 30)  # the first batch holds the engine
        subs = [await submit("rr-good-1", DOCS[2:5]), await submit("rr-bad", DOCS[:2], False),
                await submit("rr-good-2", DOCS[5:])]
        await wait_until(lambda: stack.workers["rr-1"].runner.queue_depth == 3)
    finally:
        engine.gate.set()
    results = [await answer(s) for s in (first, *subs)]
    ok1, bad, ok2 = results[1:]
    assert isinstance(bad, WorkError) and bad.status == 400 and "scores text pairs" in bad.message
    for res, docs in ((results[0], DOCS[:2]), (ok1, DOCS[2:5]), (ok2, DOCS[5:])):
        assert isinstance(res, EmbedResult) and res.dim == 1
        got = np.frombuffer(res.vectors, "<f4")
        np.testing.assert_allclose(got, predict(ce, [(QUERY, d) for d in docs]), atol=1e-4)
    assert engine.sizes == [2, 5]  # batch-mates: the refused work left the batch, not them
    assert ok1.timing.batch_size == ok2.timing.batch_size == 5


async def test_raw_and_activated_work_in_one_batch_each_get_their_own(stack, reranker):
    """One engine call scores a batch whose requests ask for logits and for activated
    scores: each gets what it asked for (the worker activates per request)."""
    import torch

    from engine.tokenizer import Tokenizer

    ce, engine, path = reranker
    tok, nc = Tokenizer.from_dir(path), stack.client
    engine.gate.clear()
    engine.entered.clear()
    engine.sizes.clear()
    try:
        first = await submit_pairs(nc, tok, "rr-hold", DOCS[:1])
        await asyncio.to_thread(engine.entered.wait, 30)  # the first batch holds the engine
        raw = await submit_pairs(nc, tok, "rr-raw", DOCS[1:4], raw=True)
        act = await submit_pairs(nc, tok, "rr-act", DOCS[4:])
        await wait_until(lambda: stack.workers["rr-1"].runner.queue_depth == 2)
    finally:
        engine.gate.set()
    results = [await answer(s) for s in (first, raw, act)]
    assert all(isinstance(r, EmbedResult) for r in results), results
    assert engine.sizes == [1, 6]  # raw and activated work in one engine call
    logits = np.asarray(ce.predict([(QUERY, d) for d in DOCS[1:4]],
                                   activation_fn=torch.nn.Identity()), np.float64).reshape(-1)
    np.testing.assert_allclose(np.frombuffer(results[1].vectors, "<f4"), logits, atol=1e-4)
    np.testing.assert_allclose(np.frombuffer(results[2].vectors, "<f4"),
                               predict(ce, [(QUERY, d) for d in DOCS[4:]]), atol=1e-4)
    np.testing.assert_allclose(np.frombuffer(results[0].vectors, "<f4"),
                               predict(ce, [(QUERY, DOCS[0])]), atol=1e-4)
    fields = msgspec.msgpack.decode(encode(EmbedWork("r", MODEL, "", [[1]], 0.0, "", raw=True)))
    assert fields[-1] is True  # the last field: a sender that predates it asks activated
    assert work_decoder.decode(msgspec.msgpack.encode(fields[:-1])).raw is False


async def test_rerank_and_score_are_counted_like_every_endpoint(stack, records):
    async with httpx.AsyncClient(base_url=stack.http_url, timeout=60) as http:
        ok = await http.post("/v1/rerank", json={"model": MODEL, "query": QUERY,
                                                 "documents": DOCS[:2]},
                             headers={"X-Request-Id": "counted-rerank"})
        bad = await http.post("/v1/score", json={"model": MODEL, "text_1": "a", "text_2": []},
                              headers={"X-Request-Id": "counted-score"})
    assert (ok.status_code, bad.status_code) == (200, 400)
    mine = lambda: [r for r in records if r.request_id.startswith("counted-")]  # noqa: E731
    await wait_until(lambda: len(mine()) == 2, timeout=10)
    by = {r.endpoint: r for r in mine()}
    assert by["rerank"].status == 200 and by["rerank"].prompt_tokens == ok.json()["usage"]["prompt_tokens"]
    assert by["rerank"].batch_size >= 2 and by["rerank"].compute_s > 0
    assert by["score"].status == 400

    def counted(samples, endpoint: str, status: str) -> float:
        return sum(v for (name, labels), v in samples.items()
                   if name == "tensorbus_requests_total" and dict(labels).get("model") == MODEL
                   and dict(labels)["endpoint"] == endpoint and dict(labels)["status"] == status)

    port = stack.telemetry.metrics_port
    end = time.monotonic() + 10
    while True:  # poll /metrics until the records have been applied
        async with httpx.AsyncClient() as http:
            text = (await http.get(f"http://127.0.0.1:{port}/metrics")).text
        samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
                   for fam in text_string_to_metric_families(text) for s in fam.samples}
        if counted(samples, "score", "400") >= 1:
            break
        assert time.monotonic() < end, "the records never reached /metrics"
        await asyncio.sleep(0.05)
    assert counted(samples, "rerank", "200") >= 1
    # an encoder's answer: prompt tokens, and no generated-token observations
    assert samples[("tensorbus_request_generation_tokens_count", (("model", MODEL),))] == 0
    async with httpx.AsyncClient(base_url=stack.http_url) as http:
        gw = (await http.get("/metrics")).text
    assert 'tensorbus_gateway_http_requests_total{route="rerank",status="200"}' in gw
