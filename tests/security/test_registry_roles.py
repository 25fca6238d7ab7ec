"""The real registry code under the secured config: deploy publishes and promotes,
a worker fetches (sha256-verified) and follows the aliases, and cannot move them."""

from __future__ import annotations

import asyncio
import contextlib
import json

import pytest

from services.registry.keys import alias_key
from services.registry.store import Registry
from shared import subjects


def tiny_model(root):
    # The registry moves bytes and checks digests; it never parses the weights.
    d = root / "tiny"
    d.mkdir()
    (d / "config.json").write_text(json.dumps({"model_type": "gpt2", "n_positions": 64}))
    (d / "model.safetensors").write_bytes(bytes(range(256)) * 700)  # > one 128 KiB chunk
    return d


async def test_deploy_publishes_and_a_worker_fetches_and_follows(bus, tmp_path):
    deploy = await bus.connect("deploy")
    worker = await bus.connect("worker")
    src = tiny_model(tmp_path)

    admin = await Registry.open(deploy.nc, actor="ci@test")
    v1 = await admin.push(src, "tiny", progress=False)
    await admin.promote("tiny", v1.version)

    reader = await Registry.open(worker.nc)  # binds the buckets, creates nothing
    dest = await reader.fetch("tiny", v1.version, tmp_path / "fetched")
    assert (dest / "model.safetensors").read_bytes() == (src / "model.safetensors").read_bytes()

    async with reader.watch_aliases("tiny") as watch:
        assert (await anext(watch)).prod == v1.version
        v2 = await admin.push(src, "tiny", progress=False)
        await admin.promote("tiny", v2.version)
        assert (await anext(watch)).prod == v2.version
    await worker.assert_clean()
    await deploy.assert_clean()


@pytest.mark.parametrize("role", ["worker", "scheduler", "gateway"])
async def test_a_reader_role_cannot_promote(bus, tmp_path, role):
    deploy = await bus.connect("deploy")
    admin = await Registry.open(deploy.nc, actor="ci@test")
    if not await admin.versions("tiny"):
        await admin.push(tiny_model(tmp_path), "tiny", progress=False)
    before = await admin.aliases("tiny")

    r = await bus.connect(role)
    reader = await Registry.open(r.nc)
    version = (await reader.versions("tiny"))[0].version
    attempt = asyncio.create_task(reader.promote("tiny", version))
    await r.violations.wait("Publish", f"$KV.{subjects.REGISTRY_META}.{alias_key('tiny')}")
    attempt.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await attempt
    assert await admin.aliases("tiny") == before
