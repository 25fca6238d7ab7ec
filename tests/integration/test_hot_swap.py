"""Versions from the registry: hot swap under load, canary split, rollback, refusals, pins.

A real nats-server and the real registry throughout. Most tests serve tiny pushed
model directories with a mock engine whose vectors carry the version that computed
them (last component), so a reply's claimed version (the `Tensorbus-Model-Version`
header) is checked against the engine that actually ran. The last tests load the real
bundled encoder and a tiny real decoder from the registry.
"""

from __future__ import annotations

import asyncio
import json
import math
import random
import shutil
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import msgspec
import numpy as np
from safetensors.numpy import save_file

from services.gateway.service import VERSION_HEADER
from services.registry.store import alias_key
from services.scheduler.aliases import seed_registry
from shared import catalog, subjects
from shared.errors import HEADER_CODE
from shared.natsd import NatsServer
from shared.registry import Aliases
from shared.telemetry import RequestRecord, record_decoder
from tests.support.mock_engine import MockEncoder
from tests.support.stack import running_stack, wait_until

# The bundled encoder's tokenizer and config, with tiny fake weights: what the gateway
# needs to tokenize, and a directory the registry accepts as an encoder.
ENCODER_FILES = ["config.json", "vocab.txt", "tokenizer.json", "tokenizer_config.json",
                 "special_tokens_map.json", "sentence_bert_config.json", "modules.json",
                 "1_Pooling/config.json"]


def model_name() -> str:
    return f"swap-{uuid.uuid4().hex[:8]}"


def encoder_dir(root: Path, seed: int) -> Path:
    src = catalog.bundled_dir(catalog.ENCODER)
    for rel in ENCODER_FILES:
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(src / rel, root / rel)
    w = np.random.default_rng(seed).standard_normal((16, 16)).astype(np.float32)
    save_file({"w": w}, str(root / "model.safetensors"))
    return root


def decoder_dir(root: Path) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    cfg = {"architectures": ["LlamaForCausalLM"], "model_type": "llama",
           "max_position_embeddings": 128}
    (root / "config.json").write_text(json.dumps(cfg))
    save_file({"w": np.ones((4, 4), np.float32)}, str(root / "model.safetensors"))
    return root


class TaggedEncoder(MockEncoder):
    """The mock encoder with its version in the last component of every vector."""

    def __init__(self, name: str, version: str) -> None:
        super().__init__(name=name, dim=8)
        self.version = version
        self.warmed = 0
        self.warming = threading.Event()  # set when its warm-up starts
        self.warm_gate = threading.Event()  # cleared: warm-up waits for the test
        self.warm_gate.set()

    def warmup(self, progress: bool = True) -> int:
        self.warming.set()
        self.warm_gate.wait()
        self.warmed += 1
        return 0

    def embed(self, inputs):
        out = super().embed(inputs)  # [N, 8]
        out[:, -1] = float(self.version)
        return out


@dataclass
class Built:
    """What the engine factory made, in order: a test can reach into any version."""

    engines: dict[str, TaggedEncoder] = field(default_factory=dict)
    hold_warmup: set[str] = field(default_factory=set)  # these wait on their warm_gate

    def __call__(self, info: catalog.ModelInfo, version: str) -> TaggedEncoder:
        engine = TaggedEncoder(info.name, version)
        if version in self.hold_warmup:
            engine.warm_gate.clear()
        self.engines[version] = engine
        return engine


async def push_versions(reg, tmp_path: Path, name: str, n: int) -> None:
    for i in range(1, n + 1):
        await reg.push(encoder_dir(tmp_path / f"v{i}", seed=i), name, version=str(i),
                       progress=False)


@dataclass
class Reply:
    client: int
    sent: float  # monotonic, when the request went out
    got: float  # monotonic, when its reply came back
    code: int
    version: str  # what the reply says (header)
    computed: str  # what the vector says (the engine that ran)


async def embed(nc, model: str, text: str = "hello world", client: int = 0,
                timeout: float = 10.0) -> Reply:
    sent = time.monotonic()
    msg = await nc.request(subjects.EMBEDDINGS, msgspec.json.encode(
        {"model": model, "input": [text]}), timeout=timeout)
    headers = msg.headers or {}
    code = int(headers.get(HEADER_CODE, 200))
    computed = ""
    if code == 200:
        vec = msgspec.json.decode(msg.data)["data"][0]["embedding"]
        computed = str(int(vec[-1]))
    return Reply(client, sent, time.monotonic(), code, headers.get(VERSION_HEADER, ""), computed)


class Load:
    """`clients` closed loops sending requests until stopped; every outcome is kept."""

    def __init__(self, nc, model: str, clients: int = 8) -> None:
        self.nc, self.model, self.clients = nc, model, clients
        self.replies: list[Reply] = []
        self.dropped: list[BaseException] = []  # timeouts and transport errors
        self._stop = asyncio.Event()
        self._tasks: list[asyncio.Task] = []
        self._tick = asyncio.Condition()

    async def __aenter__(self) -> "Load":
        self._tasks = [asyncio.create_task(self._loop(i)) for i in range(self.clients)]
        return self

    async def __aexit__(self, *exc) -> None:
        self._stop.set()
        await asyncio.gather(*self._tasks)

    async def _loop(self, client: int) -> None:
        i = 0
        while not self._stop.is_set():
            try:
                reply = await embed(self.nc, self.model, f"client {client} request {i}", client)
                self.replies.append(reply)
            except Exception as exc:  # noqa: BLE001 - counted, asserted on
                self.dropped.append(exc)
            i += 1
            async with self._tick:
                self._tick.notify_all()

    async def until(self, cond, timeout: float = 30.0) -> None:
        async with self._tick:
            await asyncio.wait_for(self._tick.wait_for(lambda: cond(self.replies)), timeout)

    def count(self, version: str) -> int:
        return sum(r.version == version for r in self.replies)


def assert_all_served(load: Load) -> None:
    assert load.dropped == []
    assert [r for r in load.replies if r.code != 200] == []
    assert all(r.version == r.computed for r in load.replies)


async def collect_records(nc) -> tuple[list[RequestRecord], object]:
    """Every telemetry request record from now on (and the subscription, to end it)."""
    records: list[RequestRecord] = []

    async def on_record(msg) -> None:
        rec = record_decoder.decode(msg.data)
        if isinstance(rec, RequestRecord):
            records.append(rec)

    sub = await nc.subscribe(subjects.TELEMETRY_REQUESTS, cb=on_record)
    await nc.flush()
    return records, sub


def hb(st, worker_id: str):
    return st.scheduler.fleet.workers[worker_id].hb


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
    from engine import jaxrt
    from engine.encoder import JaxEncoder
    from tests.conftest import TEST_BATCH_BUCKETS, TEST_SEQ_BUCKETS

    jaxrt.setup(jax_cache_dir)

    def factory(info: catalog.ModelInfo, version: str) -> JaxEncoder:
        return JaxEncoder(info.path, name=info.name, batch_buckets=TEST_BATCH_BUCKETS,
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
