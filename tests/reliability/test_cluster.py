"""A three-server NATS cluster: what tensorbus creates is replicated three times, a
server lost (SIGKILL) leaves the registry readable and writable after the election,
an R1 deployment is raised in place, and `tensorbus nats --cluster 3` starts one."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import time

import pytest

from services.registry.store import Registry
from services.supervisor import REPO
from services.telemetry.stream import ensure_stream, stream_config
from shared.bus import close, open_client
from shared.jetstream import STREAMS, cluster_size, replicas
from shared.natsd import ROUTE_PORT_OFFSET, NatsCluster, free_port, wait_listening
from tests.support.cluster import js_ready, until

KV_STREAM = STREAMS[0]


def tiny_model(root):
    d = root / "tiny"
    d.mkdir(exist_ok=True)
    (d / "config.json").write_text(json.dumps({"model_type": "gpt2", "n_positions": 64}))
    (d / "model.safetensors").write_bytes(bytes(range(256)) * 700)  # > one 128 KiB chunk
    return d


async def test_assets_get_three_replicas_and_survive_losing_a_server(tmp_path, monkeypatch):
    monkeypatch.delenv("TENSORBUS_JS_REPLICAS", raising=False)
    with NatsCluster(tmp_path / "nats", 3).start(die_with_parent=True) as cluster:
        nc = await js_ready(cluster.url)
        try:
            assert replicas(nc) == 3
            js = nc.jetstream()
            # JetStream places three replicas once every member is current in its meta
            # group, a moment after the routes are up (docs/operations.md).
            reg = await until(lambda: Registry.open(nc, actor="ci@test"))
            await until(lambda: ensure_stream(js, stream_config(), replicas(nc)))
            for name in STREAMS:
                info = await js.stream_info(name)
                assert info.config.num_replicas == 3, name
                assert len(info.cluster.replicas or []) == 2, name  # two followers

            src = tiny_model(tmp_path)
            v1 = await reg.push(src, "tiny", progress=False)
            await reg.promote("tiny", v1.version)

            # SIGKILL the server leading the registry's metadata stream.
            leader = (await js.stream_info(KV_STREAM)).cluster.leader
            victim = cluster.servers[int(leader.rsplit("-", 1)[1])]
            killed_at = time.monotonic()
            victim.proc.send_signal(signal.SIGKILL)
            victim.proc.wait()

            # Readable, then writable once a new leader is elected: a push and a promote.
            assert [v.version for v in await until(lambda: reg.versions("tiny"))] == [v1.version]

            async def elected():  # every stream led by a live server
                for name in STREAMS:
                    info = await js.stream_info(name)
                    assert info.cluster.leader and info.cluster.leader != leader, name
            await until(elected)
            v2 = await reg.push(src, "tiny", progress=False)
            await reg.promote("tiny", v2.version)
            assert (await reg.aliases("tiny")).prod == v2.version
            # Right after the election a fetch's consumer may still be placed on the lost
            # peer: tried again until it is not.
            fetched = await until(lambda: reg.fetch("tiny", v2.version, tmp_path / "fetched"))
            assert (fetched / "model.safetensors").read_bytes() == \
                (src / "model.safetensors").read_bytes()
            assert time.monotonic() - killed_at < 30
        finally:
            await close(nc)


async def test_an_r1_deployment_is_raised_in_place(tmp_path, monkeypatch):
    with NatsCluster(tmp_path / "nats", 3).start(die_with_parent=True) as cluster:
        nc = await js_ready(cluster.url)
        try:
            monkeypatch.setenv("TENSORBUS_JS_REPLICAS", "1")  # as a one-server deployment made it
            reg = await Registry.open(nc, actor="ci@test")
            await reg.push(tiny_model(tmp_path), "tiny", progress=False)
            await ensure_stream(nc.jetstream(), stream_config(), replicas(nc))
            js = nc.jetstream()
            assert [(await js.stream_info(s)).config.num_replicas for s in STREAMS] == [1, 1, 1]

            env = dict(os.environ, TENSORBUS_NATS_URL=cluster.url)
            env.pop("TENSORBUS_JS_REPLICAS")
            res = await asyncio.to_thread(
                subprocess.run, [sys.executable, "-m", "services.cli", "replicas"], cwd=REPO,
                env=env, capture_output=True, text=True, timeout=60)
            assert res.returncode == 0, res.stdout + res.stderr
            assert all(f"{s}" in res.stdout for s in STREAMS) and res.stdout.count("R1 -> R3") == 3
            for name in STREAMS:
                assert (await js.stream_info(name)).config.num_replicas == 3, name
            assert [v.version for v in await reg.versions("tiny")] == ["1"]
        finally:
            await close(nc)


def _free_block(n: int) -> int:
    """A client port whose next n - 1 ports and the n route ports above them are free
    too: the cluster command takes them in a row, and on a busy machine one of a
    random port's neighbours is often some connection's local port."""
    for _ in range(100):
        base = free_port()
        wanted = [base + i for i in range(n)] + [base + ROUTE_PORT_OFFSET + i for i in range(n)]
        try:
            for port in wanted:
                with socket.socket() as s:
                    s.bind(("127.0.0.1", port))
        except OSError:
            continue
        return base
    raise RuntimeError(f"no {n} free ports in a row")


async def test_tensorbus_nats_cluster_runs_three_routed_servers(tmp_path):
    base = _free_block(3)
    ports = [base, base + 1, base + 2]
    env = dict(os.environ, TENSORBUS_NATS_PORT=str(base), TENSORBUS_DATA_DIR=str(tmp_path),
               TENSORBUS_NATS_STOP_GRACE_S="0.5")
    proc = subprocess.Popen([sys.executable, "-m", "services.cli", "nats", "--cluster", "3"],
                            cwd=REPO, env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    try:
        for port in ports:
            await asyncio.to_thread(wait_listening, port, "127.0.0.1", 30)  # a bound: Python starts it
        nc = await js_ready(",".join(f"nats://127.0.0.1:{p}" for p in ports))
        try:
            await until(lambda: nc.jetstream().create_key_value(bucket="probe",
                                                                 replicas=replicas(nc, 0)))
            info = await nc.jetstream().stream_info("KV_probe")
            assert info.config.num_replicas == 3
        finally:
            await close(nc)
        for i in range(3):
            assert (tmp_path / "jetstream" / f"n{i}").is_dir()
    finally:
        proc.send_signal(signal.SIGTERM)
        assert await asyncio.to_thread(proc.wait, 20) == 0
    for port in ports + [p + ROUTE_PORT_OFFSET for p in ports]:
        with pytest.raises(OSError):
            socket.create_connection(("127.0.0.1", port), timeout=0.5).close()


async def test_a_member_that_joins_later_is_counted(tmp_path):
    """A cluster still forming: the size follows the server's later announcements,
    not only the handshake's."""
    cluster = NatsCluster(tmp_path / "nats", 3)
    try:
        for server in cluster.servers[:2]:
            server.start(die_with_parent=True)
        nc = await open_client(cluster.servers[0].url, allow_reconnect=False)
        try:
            end = time.monotonic() + 10
            while cluster_size(nc) < 2:  # the second member's route
                assert time.monotonic() < end
                await asyncio.sleep(0.05)
            assert replicas(nc, 0) == 1  # two servers: no quorum of three to spread over
            cluster.servers[2].start(die_with_parent=True)
            while cluster_size(nc) < 3:
                assert time.monotonic() < end, "the third member was never announced"
                await asyncio.sleep(0.05)
            assert replicas(nc, 0) == 3 and replicas(nc, 2) == 2
        finally:
            await close(nc)
    finally:
        cluster.stop()
