"""How much memory a worker uses, and against what limit, for its heartbeat.

Where the engine runs on an accelerator whose backend reports memory (JAX's
`Device.memory_stats()` on GPUs; torch's `cuda.mem_get_info()`), the heartbeat
carries device bytes in use and the device's limit (`mem_source` "device"). Otherwise
it carries the process's resident memory against the host limit: the tightest
cgroup memory limit on the process's cgroup path (v2 `memory.max`, v1
`memory.limit_in_bytes`), or the machine's `MemTotal` when no cgroup sets one
(`mem_source` "host"). KV-cache use stays in the heartbeat's `kv_blocks_used` /
`kv_blocks_total`.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

UNLIMITED = 1 << 60  # cgroup v1 writes "no limit" as a huge page-rounded number


def rss_bytes(proc: str | Path = "/proc") -> int:
    """Resident memory of this process."""
    try:
        resident = int((Path(proc) / "self" / "statm").read_text().split()[1])
    except (OSError, IndexError, ValueError):
        return 0
    return resident * os.sysconf("SC_PAGE_SIZE")


def mem_total(proc: str | Path = "/proc") -> int:
    try:
        for line in (Path(proc) / "meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) * 1024
    except (OSError, IndexError, ValueError):
        pass
    return 0


def cgroup_limit(proc: str | Path = "/proc", root: str | Path = "/sys/fs/cgroup") -> int:
    """The tightest memory limit on this process's cgroup path; 0 when none is set."""
    try:
        lines = (Path(proc) / "self" / "cgroup").read_text().splitlines()
    except OSError:
        return 0
    root = Path(root)
    found: list[int] = []
    for line in lines:
        _, controllers, path = (line.split(":", 2) + ["", ""])[:3]
        if controllers == "" and (root / "memory.max").exists():  # v2, unified
            found += _limits(root, path, "memory.max")
        elif "memory" in controllers.split(","):  # v1 memory controller
            found += _limits(root / "memory", path, "memory.limit_in_bytes")
    return min(found, default=0)


def _limits(base: Path, path: str, name: str) -> list[int]:
    """Limits set on `path` and each of its ancestors (a parent's limit binds too)."""
    out = []
    parts = [p for p in path.strip().split("/") if p]
    for depth in range(len(parts), -1, -1):
        try:
            raw = (base.joinpath(*parts[:depth]) / name).read_text().strip()
        except OSError:
            continue
        if raw.isdigit() and 0 < int(raw) < UNLIMITED:
            out.append(int(raw))
    return out


def device_memory(device: str) -> tuple[int, int] | None:
    """(bytes in use, limit) of the accelerator `device` ("cuda:0"), where the loaded
    backend reports them; None on CPU or when it does not."""
    if not device or ":" not in device:
        return None
    try:
        index = int(device.rsplit(":", 1)[1])
    except ValueError:
        return None
    jax = sys.modules.get("jax")  # only a backend the engine already loaded
    if jax is not None:
        try:
            dev = next((d for d in jax.local_devices() if d.platform != "cpu" and d.id == index),
                       None)
            stats = dev.memory_stats() if dev is not None else None
        except (RuntimeError, NotImplementedError, AttributeError):
            stats = None
        if stats and stats.get("bytes_limit"):
            return int(stats.get("bytes_in_use", 0)), int(stats["bytes_limit"])
    torch = sys.modules.get("torch")
    if torch is not None and device.startswith("cuda"):
        try:
            if torch.cuda.is_initialized():
                free, total = torch.cuda.mem_get_info(index)
                return int(total - free), int(total)
        except (RuntimeError, AssertionError):
            pass
    return None


class MemoryProbe:
    """Reads a worker's memory for each heartbeat; the host limit is read once."""

    def __init__(self, proc: str | Path = "/proc", cgroup_root: str | Path = "/sys/fs/cgroup") -> None:
        self.proc = proc
        total = mem_total(proc)
        limit = cgroup_limit(proc, cgroup_root)
        self.host_limit = min(limit, total) if limit and total else (limit or total)

    def read(self, device: str = "") -> tuple[int, int, str]:
        """(used bytes, limit bytes, "device" | "host") for an engine on `device`."""
        dev = device_memory(device)
        if dev is not None:
            return dev[0], dev[1], "device"
        return rss_bytes(self.proc), self.host_limit, "host"
