"""Versions from the registry: hot swap under load, canary split, rollback, refusals, pins.

A real nats-server and the real registry throughout. Encoder tests serve tiny pushed
model directories with a mock engine whose vectors carry the version that computed
them, so a reply's claimed version (the `Tensorbus-Model-Version` header) is checked
against the engine that actually ran (tests/support/swap.py). Decoder tests serve
tiny real GPT-2 versions with different weights: a stream's text must be exactly
what the version its headers name produces greedily. The last encoder test loads
the real bundled encoder.
"""

from __future__ import annotations

import asyncio
import math
import random
import time

import httpx
import msgspec
import numpy as np
import pytest

from services.gateway.codec import VERSION_HEADER
from services.registry.keys import alias_key
from services.registry.seed import seed_registry
from shared import catalog, subjects
from shared.errors import HEADER_CODE
from shared.natsd import NatsServer
from shared.registry import Aliases
from tests.support.stack import running_stack, wait_until
from tests.support.swap import (
    DEC_CONTEXT,
    DEC_NEW,
    DEC_PROMPTS,
    Built,
    Decoders,
    Load,
    Reply,
    assert_all_served,
    assert_streams_whole,
    collect_records,
    decoder_dir,
    decoder_versions,
    embed,
    hb,
    model_name,
    push_versions,
    stream_completion,
    stream_request,
)


async def test_promote_under_load_moves_to_the_new_version_and_never_back(nats_server, tmp_path):
    name = model_name()
    async with running_stack(nats_server.url, registry=True) as st:
        await push_versions(st.registry, tmp_path, name, 2)
        await st.registry.promote(name, "1")
        built = Built()
        w = await st.add_registry_worker(name, built, "swap-w1")
        assert w.versions == ["1"]
        async with Load(st.client, name, clients=8) as load:
            await load.until(lambda rs: len(rs) >= 50)
            await st.registry.promote(name, "2")
            await load.until(lambda rs: sum(r.version == "2" for r in rs) >= 100)
        assert_all_served(load)
        assert load.count("1") >= 50
        # Per client the versions go 1...1 2...2; and once any client saw a reply from
        # version 2, every request sent later was answered by version 2.
        for c in range(8):
            seq = [r.version for r in sorted(load.replies, key=lambda r: r.sent) if r.client == c]
            assert seq == sorted(seq), f"client {c} went back to the old version"
        first_new = min(r.got for r in load.replies if r.version == "2")
        assert {r.version for r in load.replies if r.sent > first_new} == {"2"}
        # The new version was warmed before it took traffic; the old one is freed.
        assert built.engines["2"].warmed == 1
        await wait_until(lambda: set(w.models.engines) == {"2"}, timeout=5)
        assert hb(st, "swap-w1").versions == ["2"] and hb(st, "swap-w1").last_error == ""


async def test_old_version_serves_while_the_new_one_warms(nats_server, tmp_path):
    name = model_name()
    async with running_stack(nats_server.url, registry=True) as st:
        await push_versions(st.registry, tmp_path, name, 2)
        await st.registry.promote(name, "1")
        built = Built(hold_warmup={"2"})
        w = await st.add_registry_worker(name, built, "warm-w1")
        await st.registry.promote(name, "2")
        await wait_until(lambda: "2" in built.engines, timeout=10)
        await asyncio.to_thread(built.engines["2"].warming.wait, 10)
        # Version 2 is compiling on the loader thread; the engine thread serves 1.
        during = await asyncio.gather(*(embed(st.client, name, f"t {i}") for i in range(20)))
        assert {(r.code, r.version, r.computed) for r in during} == {(200, "1", "1")}
        assert w.versions == ["1"]
        built.engines["2"].warm_gate.set()
        await wait_until(lambda: w.versions == ["2"], timeout=10)
        r = await embed(st.client, name)
        assert (r.code, r.version, r.computed) == (200, "2", "2")


async def test_work_in_flight_on_the_old_version_finishes_there(nats_server, tmp_path):
    name = model_name()
    async with running_stack(nats_server.url, registry=True) as st:
        await push_versions(st.registry, tmp_path, name, 2)
        await st.registry.promote(name, "1")
        built = Built()
        w = await st.add_registry_worker(name, built, "flight-w1")
        w.swap.grace_s = 0.0  # retire as soon as nothing uses the old version
        old = built.engines["1"]
        old.gate.clear()  # its next batch stays on the engine thread
        held = asyncio.create_task(embed(st.client, name, "held"))
        await asyncio.to_thread(old.entered.wait, 5)
        await st.registry.promote(name, "2")
        await wait_until(lambda: w.models.prod == "2", timeout=10)
        queued = asyncio.create_task(embed(st.client, name, "queued"))
        await wait_until(lambda: w.runner.queue_depth == 1, timeout=5)
        # Heartbeats go on while the batch is held; the old engine stays loaded.
        seen = hb(st, "flight-w1").sent_at
        await wait_until(lambda: hb(st, "flight-w1").sent_at > seen + 0.2, timeout=5)
        assert set(w.models.engines) == {"1", "2"} and w.runner.computing == "1"
        old.gate.set()
        h, q = await held, await queued
        assert (h.code, h.version, h.computed) == (200, "1", "1")
        assert (q.code, q.version, q.computed) == (200, "2", "2")
        await wait_until(lambda: set(w.models.engines) == {"2"}, timeout=5)


async def test_canary_share_is_binomial(nats_server, tmp_path):
    name = model_name()
    async with running_stack(nats_server.url, registry=True) as st:
        await push_versions(st.registry, tmp_path, name, 2)
        await st.registry.promote(name, "1")
        await st.registry.canary(name, "2", 0.1)
        w = await st.add_registry_worker(name, Built(), "canary-w1")
        await wait_until(lambda: hb(st, "canary-w1").versions == ["1", "2"], timeout=10)
        assert w.versions == ["1", "2"]
        await st.scheduler.aliases.wait_for(name, lambda a: a.canary == "2")
        st.scheduler.aliases.rng = random.Random(20240601)  # a reproducible split
        n, p = 1000, 0.1
        replies: list[Reply] = []
        for start in range(0, n, 50):
            replies += await asyncio.gather(*(embed(st.client, name, f"text {i}")
                                              for i in range(start, start + 50)))
        assert all(r.code == 200 and r.version == r.computed for r in replies)
        hits = sum(r.version == "2" for r in replies)
        assert abs(hits - n * p) <= 4 * math.sqrt(n * p * (1 - p)), hits
        assert {r.version for r in replies} == {"1", "2"}


async def test_rollback_under_load_fails_nothing_and_frees_what_it_left(nats_server, tmp_path):
    name = model_name()
    async with running_stack(nats_server.url, registry=True) as st:
        await push_versions(st.registry, tmp_path, name, 3)
        await st.registry.promote(name, "1")
        await st.registry.promote(name, "2")
        await st.registry.canary(name, "3", 0.5)
        workers = [await st.add_registry_worker(name, Built(), f"rb-w{i}") for i in (1, 2)]
        for w in workers:
            await wait_until(lambda w=w: w.versions == ["2", "3"], timeout=10)
        await st.scheduler.aliases.wait_for(name, lambda a: a.canary == "3")
        async with Load(st.client, name, clients=8) as load:
            await load.until(lambda rs: {"2", "3"} <= {r.version for r in rs} and len(rs) >= 60)
            await st.registry.rollback(name)  # prod back to 1, canary cleared
            await load.until(lambda rs: sum(r.version == "1" for r in rs) >= 100)
        assert_all_served(load)
        for w in workers:
            await wait_until(lambda w=w: set(w.models.engines) == {"1"}, timeout=5)
            assert hb(st, w.id).state == "ready" and hb(st, w.id).versions == ["1"]


async def test_corrupted_object_is_refused_and_the_old_version_keeps_serving(nats_server, tmp_path):
    name = model_name()
    async with running_stack(nats_server.url, registry=True) as st:
        await push_versions(st.registry, tmp_path, name, 2)
        await st.registry.promote(name, "1")
        built = Built()
        w = await st.add_registry_worker(name, built, "bad-w1")
        obs = await st.client.jetstream().object_store(subjects.REGISTRY_OBJECTS)
        await obs.put(f"{name}/2/vocab.txt", b"[PAD]\n[UNK]\n")  # not what was pushed
        await st.registry.promote(name, "2")
        await wait_until(lambda: "ChecksumError" in hb(st, "bad-w1").last_error, timeout=10)
        assert "vocab.txt" in hb(st, "bad-w1").last_error and "@2" in hb(st, "bad-w1").last_error
        assert hb(st, "bad-w1").state == "ready" and w.health.ready
        assert hb(st, "bad-w1").versions == ["1"] and "2" not in built.engines
        r = await embed(st.client, name)
        assert (r.code, r.version, r.computed) == (200, "1", "1")


async def test_alias_to_a_missing_or_incompatible_version_is_refused(nats_server, tmp_path):
    name = model_name()
    async with running_stack(nats_server.url, registry=True) as st:
        await push_versions(st.registry, tmp_path, name, 2)
        await st.registry.push(decoder_dir(tmp_path / "dec"), name, version="3", progress=False)
        await st.registry.promote(name, "1")
        w = await st.add_registry_worker(name, Built(), "bad-w2")
        # The CLI refuses both, so write the aliases key the way a stray tool would.
        kv = await st.client.jetstream().key_value(subjects.REGISTRY_META)
        for version, why in (("9", "VersionNotFound"), ("3", "IncompatibleVersion")):
            await kv.put(alias_key(name), msgspec.json.encode(Aliases(prod=version)))
            await wait_until(lambda: why in hb(st, "bad-w2").last_error, timeout=10)
            assert f"@{version}" in hb(st, "bad-w2").last_error
            assert hb(st, "bad-w2").state == "ready" and w.health.ready
            assert hb(st, "bad-w2").versions == ["1"]
            r = await embed(st.client, name)
            assert (r.code, r.version, r.computed) == (200, "1", "1")
        # Aliases that name what is served clear the error; a good promotion swaps.
        await kv.put(alias_key(name), msgspec.json.encode(Aliases(prod="1")))
        await wait_until(lambda: hb(st, "bad-w2").last_error == "", timeout=10)
        await st.registry.promote(name, "2")
        await wait_until(lambda: hb(st, "bad-w2").versions == ["2"], timeout=10)
        assert hb(st, "bad-w2").last_error == ""


async def test_pinned_version_is_served_by_that_version(nats_server, tmp_path):
    name = model_name()
    async with running_stack(nats_server.url, registry=True) as st:
        await push_versions(st.registry, tmp_path, name, 2)
        await st.registry.promote(name, "1")
        await st.registry.canary(name, "2", 0.0)  # loaded, but no unpinned traffic
        await st.add_registry_worker(name, Built(), "pin-w1")
        await wait_until(lambda: hb(st, "pin-w1").versions == ["1", "2"], timeout=10)
        records, sub = await collect_records(st.client)
        pinned = await asyncio.gather(*(embed(st.client, f"{name}@{v}", f"x {i}")
                                        for i in range(20) for v in ("1", "2")))
        assert all(r.code == 200 and r.version == r.computed for r in pinned)
        assert [r.version for r in pinned] == ["1", "2"] * 20
        plain = await asyncio.gather(*(embed(st.client, name, f"y {i}") for i in range(20)))
        assert {r.version for r in plain} == {"1"}
        missing = await embed(st.client, f"{name}@7")
        assert missing.code == 503
        await wait_until(lambda: len(records) >= 61, timeout=5)
        await sub.unsubscribe()
        served = [rec.version for rec in records if rec.status == 200]
        assert sorted(served) == sorted([r.version for r in pinned + plain])


async def test_first_start_seeds_the_registry_and_serves_the_real_encoder(
        tmp_path, jax_cache_dir, sentence_transformer):
    """An empty JetStream: the scheduler's seeding pushes the bundled encoder, a worker
    loads version 1 from the registry (verified), then a re-push is hot-swapped in."""
    from engine.encoder import EncoderEngine
    from tests.conftest import TEST_BATCH_BUCKETS, TEST_SEQ_BUCKETS

    def factory(info: catalog.ModelInfo, version: str) -> EncoderEngine:
        return EncoderEngine(info.path, name=info.name, batch_buckets=TEST_BATCH_BUCKETS,
                             seq_buckets=TEST_SEQ_BUCKETS, max_batch=16)

    name = catalog.ENCODER
    info = catalog.resolve(name)
    texts = ["hello world", "The quick brown fox jumps over the lazy dog."]
    ref = sentence_transformer.encode(texts, normalize_embeddings=True)
    with NatsServer(tmp_path / "js") as server:
        async with running_stack(server.url, registry=True) as st:
            assert await seed_registry(st.registry, [info]) == [name]
            assert await seed_registry(st.registry, [info]) == []  # second start: nothing
            w = await st.add_registry_worker(name, factory, "real-w1")
            assert w.versions == ["1"]
            assert (w.swap.source.cache_dir / name / "1" / "model.safetensors").is_file()

            async def ask() -> tuple[str, np.ndarray]:
                msg = await st.client.request(subjects.EMBEDDINGS, msgspec.json.encode(
                    {"model": name, "input": texts}), timeout=30)
                data = msgspec.json.decode(msg.data)["data"]
                return msg.headers[VERSION_HEADER], np.array([d["embedding"] for d in data])

            version, got = await ask()
            assert version == "1"
            assert (got * ref).sum(-1).min() >= 0.9999  # unit vectors: cosine
            await st.registry.push(info.path, name, version="2", progress=False)
            await st.registry.promote(name, "2")
            versions = []
            while not versions or versions[-1] != "2":  # served throughout the swap
                version, got = await asyncio.wait_for(ask(), 60)
                assert (got * ref).sum(-1).min() >= 0.9999
                versions.append(version)
            assert versions == sorted(versions)
            await wait_until(lambda: set(w.models.engines) == {"2"}, timeout=10)


# ------------------------------------------------------------------ decoders
@pytest.fixture(scope="module")
def tiny_versions(tmp_path_factory, jax_cache_dir):
    """Three versions of a tiny GPT-2 and each one's greedy texts (before any service)."""
    return decoder_versions(tmp_path_factory.mktemp("decoder-versions"), 3)


async def push_decoders(st, name: str, versions) -> None:
    for v, path in versions.dirs.items():
        await st.registry.push(path, name, version=v, progress=False)


def moved_once(streams, old: str, new: str) -> None:
    """Per client old...old new...new; once a stream from `new` ended, every stream
    sent later came from `new`."""
    for c in {s.client for s in streams}:
        seq = [s.version for s in sorted(streams, key=lambda s: s.sent) if s.client == c]
        assert seq == [old] * seq.count(old) + [new] * seq.count(new), (c, seq)
    first_new = min(s.got for s in streams if s.version == new)
    assert {s.version for s in streams if s.sent > first_new} == {new}


async def test_decoder_promote_canary_and_rollback_under_eight_streams(nats_server, tiny_versions):
    vs, name = tiny_versions, model_name()
    async with running_stack(nats_server.url, registry=True, max_context=DEC_CONTEXT,
                             decode_slots=4) as st:
        await push_decoders(st, name, vs)
        await st.registry.promote(name, "1")
        built = Decoders()
        w = await st.add_registry_worker(name, built, "dec-swap")
        assert (w.kind, w.versions) == ("decoder", ["1"])
        switched: list[tuple[float, str]] = []  # (when, prod) at each change the worker saw
        w.models.on_change(lambda: switched.append((time.monotonic(), w.models.prod)))
        st.scheduler.aliases.rng = random.Random(20261203)  # a reproducible canary draw
        async with Load(st.client, name, clients=8, ask=stream_request) as load:
            await load.until(lambda rs: len(rs) >= 16)
            t_promote = time.monotonic()
            await st.registry.promote(name, "2")
            await load.until(lambda rs: sum(s.version == "2" and s.sent > t_promote
                                            for s in rs) >= 24)
            await wait_until(lambda: set(w.models.engines) == {"2"}, timeout=10)
            assert built.alive("1") == 0  # nothing kept the old engine
            t_canary_set = time.monotonic()
            await st.registry.canary(name, "3", 0.3)
            await wait_until(lambda: hb(st, w.id).versions == ["2", "3"], timeout=30)
            await st.scheduler.aliases.wait_for(name, lambda a: a.canary == "3")
            t_canary = time.monotonic()
            await load.until(lambda rs: sum(s.sent > t_canary for s in rs) >= 60)
            t_rollback = time.monotonic()
            await st.registry.rollback(name)  # prod back to 1 (rebuilt), canary cleared
            await load.until(lambda rs: sum(s.version == "1" and s.sent > t_rollback
                                            for s in rs) >= 24)
        streams = load.replies
        assert_streams_whole(load, vs)  # zero failed, zero mixed, text = its version's
        # Promote: streams running at the switch finished on 1; new ones went to 2.
        t_switch = next(t for t, prod in switched if prod == "2")
        assert any(s.version == "1" and s.sent < t_switch < s.got for s in streams)
        moved_once([s for s in streams if s.sent < t_canary_set], "1", "2")
        # Canary: about 0.3 of the streams sent while it ran, the rest on prod.
        during = [s for s in streams if t_canary < s.sent < t_rollback]
        hits = sum(s.version == "3" for s in during)
        assert {s.version for s in during} == {"2", "3"}
        n = len(during)
        assert abs(hits - 0.3 * n) <= 4 * math.sqrt(n * 0.3 * 0.7), (hits, n)
        # Rollback: back to 1, never to 2 or 3 again; both are freed.
        after = [s for s in streams if s.sent > t_rollback]
        first_1 = min(s.got for s in after if s.version == "1")
        assert {s.version for s in after if s.sent > first_1} == {"1"}
        await wait_until(lambda: set(w.models.engines) == {"1"}, timeout=10)
        assert built.alive("2") == built.alive("3") == 0
        assert hb(st, w.id).versions == ["1"] and hb(st, w.id).last_error == ""
        assert hb(st, w.id).state == "ready"


async def test_every_decoder_reply_names_the_version_that_answered(nats_server, tiny_versions):
    vs, name = tiny_versions, model_name()
    async with running_stack(nats_server.url, registry=True, max_context=DEC_CONTEXT,
                             decode_slots=4) as st:
        await push_decoders(st, name, vs)
        await st.registry.promote(name, "1")
        await st.registry.canary(name, "2", 0.0)  # loaded, reachable only when pinned
        await st.add_registry_worker(name, Decoders(), "dec-versions")
        await wait_until(lambda: hb(st, "dec-versions").versions == ["1", "2"], timeout=30)
        prompt = {"prompt": DEC_PROMPTS[0], "max_tokens": DEC_NEW, "temperature": 0}
        chat = {"messages": [{"role": "user", "content": "the quick brown fox"}],
                "max_tokens": 4, "temperature": 0}
        async with httpx.AsyncClient(base_url=st.http_url, timeout=30) as http:
            for v in ("1", "2"):
                model = f"{name}@{v}"
                # NATS, streamed: every chunk and [DONE] name the version.
                s = await stream_completion(st.client, model, 0)
                assert s.error == "" and set(s.headers) == {v} and s.done_header == v
                assert s.text == vs.texts[v][0]
                # NATS, whole: completions and chat.
                for subject, body in ((subjects.COMPLETIONS, prompt),
                                      (subjects.CHAT_COMPLETIONS, chat)):
                    msg = await st.client.request(subject, msgspec.json.encode(
                        {"model": model, **body}), timeout=30)
                    assert HEADER_CODE not in (msg.headers or {})
                    assert msg.headers[VERSION_HEADER] == v
                    if subject == subjects.COMPLETIONS:
                        assert msgspec.json.decode(msg.data)["choices"][0]["text"] == vs.texts[v][0]
                # HTTP, whole and streamed (SSE): the header is there when the body starts.
                for path, body in (("/v1/completions", prompt), ("/v1/chat/completions", chat)):
                    r = await http.post(path, json={"model": model, **body})
                    assert r.status_code == 200 and r.headers[VERSION_HEADER] == v
                    async with http.stream("POST", path, json={"model": model, **body,
                                                               "stream": True}) as r:
                        assert r.status_code == 200 and r.headers[VERSION_HEADER] == v
                        lines = [ln async for ln in r.aiter_lines() if ln]
                    assert lines[-1] == "data: [DONE]"
                    if path == "/v1/completions":
                        text = "".join(msgspec.json.decode(ln[6:])["choices"][0]["text"]
                                       for ln in lines[:-1])
                        assert text == vs.texts[v][0]
            # Plain requests go to prod; a version nobody holds is a real HTTP 503,
            # not an SSE error under 200, since the response waits for the first chunk.
            r = await http.post("/v1/completions", json={"model": name, **prompt})
            assert r.headers[VERSION_HEADER] == "1"
            async with http.stream("POST", "/v1/completions", json={
                    "model": f"{name}@7", **prompt, "stream": True}) as r:
                assert r.status_code == 503 and VERSION_HEADER not in r.headers
