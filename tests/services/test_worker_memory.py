"""Memory in worker heartbeats: device memory where the backend reports it, else the
process's resident memory against the cgroup or host limit.

The limits are read from fake /proc and /sys/fs/cgroup trees (v2, v1, none); a real
worker's heartbeat is checked against this process's own /proc/self/status."""

from __future__ import annotations

import os
import sys
import types
from pathlib import Path

from services.worker.memory import MemoryProbe, cgroup_limit, device_memory
from shared import subjects
from shared.telemetry import Heartbeat, record_decoder
from bench.support.mock_encoder import MockEncoder
from tests.support.stack import running_stack, wait_until

GIB = 1 << 30


def fake_host(root: Path, cgroup: str, files: dict[str, str], mem_total: int = 8 * GIB):
    """(proc dir, cgroup root) with /proc/self/cgroup = `cgroup` and `files` under the root."""
    proc, cg = root / "proc", root / "cgroup"
    (proc / "self").mkdir(parents=True)
    (proc / "self" / "cgroup").write_text(cgroup)
    (proc / "self" / "statm").write_text("1000 250 10 1 0 100 0\n")
    (proc / "meminfo").write_text(f"MemTotal:       {mem_total // 1024} kB\nMemFree: 1 kB\n")
    for rel, text in files.items():
        (cg / rel).parent.mkdir(parents=True, exist_ok=True)
        (cg / rel).write_text(text)
    return proc, cg


def test_cgroup_v2_takes_the_tightest_limit_on_the_path(tmp_path):
    proc, cg = fake_host(tmp_path, "0::/pod/app\n", {
        "memory.max": "max\n", "pod/memory.max": f"{2 * GIB}\n", "pod/app/memory.max": "max\n"})
    assert cgroup_limit(proc, cg) == 2 * GIB
    probe = MemoryProbe(proc, cg)
    used, limit, source = probe.read("cpu")
    assert (limit, source) == (2 * GIB, "host")
    assert used == 250 * os.sysconf("SC_PAGE_SIZE")  # statm's resident pages


def test_cgroup_v1_ignores_its_unlimited_value(tmp_path):
    proc, cg = fake_host(tmp_path, "5:cpu:/\n4:memory:/job/x\n0::/\n", {
        "memory/memory.limit_in_bytes": "9223372036854771712\n",
        "memory/job/memory.limit_in_bytes": f"{3 * GIB}\n",
        "memory/job/x/memory.limit_in_bytes": "9223372036854771712\n"})
    assert cgroup_limit(proc, cg) == 3 * GIB
    assert MemoryProbe(proc, cg).host_limit == 3 * GIB


def test_no_cgroup_limit_means_the_host_memory(tmp_path):
    proc, cg = fake_host(tmp_path, "0::/\n", {"memory.max": "max\n"}, mem_total=6 * GIB)
    assert cgroup_limit(proc, cg) == 0
    assert MemoryProbe(proc, cg).read("cpu")[1:] == (6 * GIB, "host")
    # A cgroup limit above the machine's memory binds nothing: MemTotal is the limit.
    proc, cg = fake_host(tmp_path / "big", "0::/\n", {"memory.max": f"{64 * GIB}\n"},
                         mem_total=6 * GIB)
    assert MemoryProbe(proc, cg).host_limit == 6 * GIB


def test_device_memory_comes_from_the_loaded_backend(tmp_path, monkeypatch):
    class Gpu:
        platform, id = "gpu", 0

        def memory_stats(self):
            return {"bytes_in_use": 5 * GIB, "bytes_limit": 80 * GIB, "peak_bytes_in_use": 6 * GIB}

    fake_jax = types.SimpleNamespace(local_devices=lambda: [Gpu()])
    monkeypatch.setitem(sys.modules, "jax", fake_jax)
    monkeypatch.delitem(sys.modules, "torch", raising=False)
    assert device_memory("cuda:0") == (5 * GIB, 80 * GIB)
    assert device_memory("cpu") is None and device_memory("cuda:1") is None
    proc, cg = fake_host(tmp_path, "0::/\n", {})
    assert MemoryProbe(proc, cg).read("cuda:0") == (5 * GIB, 80 * GIB, "device")
    assert MemoryProbe(proc, cg).read("cpu")[2] == "host"


def proc_status_kib(field: str, path: str = "/proc/self/status") -> int:
    for line in Path(path).read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise KeyError(field)


async def test_a_running_workers_heartbeat_carries_its_memory(nats_server):
    beats: list[Heartbeat] = []

    async def on_beat(msg) -> None:
        rec = record_decoder.decode(msg.data)
        if isinstance(rec, Heartbeat) and rec.worker_id == "mem-w1" and rec.state == "ready":
            beats.append(rec)

    async with running_stack(nats_server.url) as st:
        sub = await st.client.subscribe(subjects.TELEMETRY_WORKERS, cb=on_beat)
        await st.add_worker(MockEncoder(), "mem-w1")
        await wait_until(lambda: beats, timeout=10)
        await sub.unsubscribe()
        rss = proc_status_kib("VmRSS")  # the worker runs in this process
        total = proc_status_kib("MemTotal", "/proc/meminfo")
    hb = beats[0]
    assert hb.mem_source == "host"  # the mock engine runs on no device
    assert abs(hb.mem_used_bytes - rss) <= max(64 << 20, rss // 10), (hb.mem_used_bytes, rss)
    assert hb.mem_used_bytes < hb.mem_limit_bytes <= total


async def test_a_heartbeat_names_the_devices_its_engine_spans(nats_server, minilm):
    beats: list[Heartbeat] = []

    async def on_beat(msg) -> None:
        rec = record_decoder.decode(msg.data)
        if isinstance(rec, Heartbeat) and rec.worker_id == "dev-w1" and rec.state == "ready":
            beats.append(rec)

    async with running_stack(nats_server.url) as st:
        sub = await st.client.subscribe(subjects.TELEMETRY_WORKERS, cb=on_beat)
        await st.add_worker(minilm, "dev-w1")
        await wait_until(lambda: beats, timeout=10)
        await sub.unsubscribe()
    import jax

    assert beats[0].devices == [f"{d.platform}:{d.id}" for d in jax.devices()[:1]]
