"""Compiled once for the fleet: `tensorbus registry warm` compiles a version's programs
and publishes them; a worker started afterwards on an empty disk reads them from the
registry and compiles nothing; entries it must not load are refused.

Real processes (the `tensorbus` command, a worker) on a real nats-server, a tiny
decoder built locally, and the JAX engine.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
from datetime import UTC, datetime
from pathlib import Path

import msgspec
import pytest

from engine import jaxrt
from services.registry.keys import program_key, program_object_name
from services.registry.store import Registry
from shared.registry import CompiledProgram
from tests.support import tiny_models

REPO = Path(__file__).resolve().parents[2]
MODEL = "tiny-fleet"
# Few shapes: a handful of programs compile in seconds.
SETTINGS = {"TENSORBUS_DECODE_SLOTS": "2", "TENSORBUS_MAX_CONTEXT": "64",
            "TENSORBUS_KV_BLOCKS": "16", "TENSORBUS_PREFILL_CHUNK": "32",
            "TENSORBUS_QUANT": "none"}


def env(nats_url: str, data_dir: Path, **extra: str) -> dict[str, str]:
    out = {k: v for k, v in os.environ.items() if not k.startswith("TENSORBUS_")}
    out.update(SETTINGS, TENSORBUS_NATS_URL=nats_url, TENSORBUS_DATA_DIR=str(data_dir),
               TENSORBUS_LOG_FORMAT="json", HF_HUB_OFFLINE="1", JAX_PLATFORMS="cpu", **extra)
    return out


@pytest.fixture
async def pushed(nc, tmp_path):
    tiny_models.build("llama", tmp_path / "src")
    reg = await Registry.open(nc)
    name = f"{MODEL}-{os.urandom(3).hex()}"  # its own programs, whatever ran before
    await reg.push(tmp_path / "src", name, "1", progress=False)
    await reg.promote(name, "1")
    return reg, name


async def warm(nats_url: str, data_dir: Path, name: str) -> dict:
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "services.cli", "registry", "warm", name, "--json", cwd=REPO,
        env=env(nats_url, data_dir), stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE)
    out, err = await proc.communicate()
    assert proc.returncode == 0, err.decode()[-3000:]
    return json.loads(out.decode().strip().splitlines()[-1])


async def worker_ready_line(nats_url: str, data_dir: Path, name: str) -> dict:
    """Start a worker for `name`, read its log up to the `ready` line, stop it."""
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "services.worker", cwd=REPO,
        env=env(nats_url, data_dir, TENSORBUS_MODEL=name), stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT, limit=1 << 22)  # progress bars: long lines
    seen = []
    try:
        async with asyncio.timeout(240):
            while line := await proc.stdout.readline():
                seen.append(line.decode(errors="replace"))
                try:
                    event = json.loads(line)
                except ValueError:
                    continue
                if event.get("event") == "ready":
                    return event
        raise AssertionError("the worker exited before ready:\n" + "".join(seen[-40:]))
    finally:
        if proc.returncode is None:
            proc.terminate()  # it drains and stops
        try:
            async with asyncio.timeout(120):
                await proc.communicate()
        except TimeoutError:
            proc.kill()
            await proc.communicate()
            raise AssertionError("the worker did not stop on SIGTERM") from None


async def test_a_worker_on_an_empty_disk_compiles_nothing_the_fleet_compiled(
        nats_server, pushed, tmp_path):
    reg, name = pushed
    first = await warm(nats_server.url, tmp_path / "a", name)
    assert first["version"] == "1"
    assert first["compiled"] > 0 and first["published"] >= first["compiled"]
    fp = jaxrt.fingerprint()
    shelf = await reg.programs.list(name, "1", jaxrt.fingerprint_id(fp))
    assert len(shelf) == first["published"]

    # Another machine's disk: empty. Everything it needs comes from the registry.
    ready = await worker_ready_line(nats_server.url, tmp_path / "b", name)
    assert ready["versions"] == ["1"]
    assert ready["fetched"] == first["published"]
    assert ready["compiled"] == 0, ready
    assert ready["loaded"] > 0
    assert ready["refused"] == 0


async def test_entries_of_another_process_or_corrupted_are_refused(nats_server, pushed,
                                                                   tmp_path):
    reg, name = pushed
    fp = jaxrt.fingerprint()
    fp_id = jaxrt.fingerprint_id(fp)
    objects = reg.programs._obj
    kv = reg.programs._kv

    async def put(entry: str, data: bytes, fingerprint: dict, fp_key: str = fp_id,
                  sha: str | None = None) -> None:
        import hashlib

        rec = CompiledProgram(name=name, version="1", entry=entry, fingerprint=fingerprint,
                              size=len(data), sha256=sha or hashlib.sha256(data).hexdigest(),
                              created_at=datetime.now(UTC))
        await objects.put(program_object_name(name, "1", fp_key, entry), data)
        await kv.put(program_key(name, "1", fp_key, entry), msgspec.json.encode(rec))

    # Filed under this fingerprint, but compiled for another CPU.
    await put("jit_step-aaaa-cache", b"x" * 100, {**fp, "cpu_features": "0000"})
    # Bytes that do not match their record.
    await put("jit_step-bbbb-cache", b"y" * 100, fp, sha="0" * 64)
    # Another machine's entry, under its own fingerprint: not even listed here.
    await put("jit_step-cccc-cache", b"z" * 100, {**fp, "jax": "0.0.1"}, fp_key="f" * 16)

    dest = tmp_path / "cache"
    fetched, refused = await reg.programs.pull(name, "1", fp, fp_id, dest)
    assert (fetched, refused) == (0, 2)
    assert not [p for p in dest.iterdir() if not p.name.startswith(".")]
