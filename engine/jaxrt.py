"""JAX runtime setup, once per process before the first compile.

`setup()` turns on the persistent compilation cache so that a restarted worker loads
its warm-up executables from disk instead of compiling them again, and returns a short
description of the device it will run on. `fingerprint()` says which executables this
process may load (another jax, backend, device or CPU: none), and `compile_counts()`
how many programs it compiled and how many it loaded from the cache.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import threading
from pathlib import Path

import jax
import jax.numpy as jnp

from engine.dtypes import canonical_dtype

_DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}


def parse_dtype(name: str):
    """'bfloat16' / 'bf16' -> jnp.bfloat16 (float32, bfloat16 and float16 only)."""
    return _DTYPES[canonical_dtype(name)]


def dtype_name(name: str) -> str:
    """Canonical spelling: 'bf16' -> 'bfloat16'."""
    return canonical_dtype(name)


def setup(cache_dir: str | os.PathLike | None = None) -> str:
    """Enable the on-disk compilation cache (when `cache_dir` is given); return
    a device description such as "cpu (2 cores)" or "cuda:0 (NVIDIA H100)".

    Every compiled executable is cached, however quick it was to compile: a worker's
    warm-up compiles dozens of small buckets and each one saved counts at restart."""
    if cache_dir is not None:
        path = Path(cache_dir)
        path.mkdir(parents=True, exist_ok=True)
        jax.config.update("jax_compilation_cache_dir", str(path))
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
        # -1, not 0: 0 lets JAX substitute a filesystem-dependent minimum size.
        jax.config.update("jax_persistent_cache_min_entry_size_bytes", -1)
        # JAX's default also turns on XLA's GPU autotune cache in a folder under this
        # one, and that folder's path enters every program's cache key: two workers
        # with different data dirs could never load each other's programs (the fleet's
        # shelf, services/registry/programs.py). Autotuning is stored in the executable.
        jax.config.update("jax_persistent_cache_enable_xla_caches", "none")
    _count_compiles()
    return describe()


# ------------------------------------------------------- what a cached program needs

def fingerprint() -> dict[str, str]:
    """What an executable compiled here needs of the process that loads it: the same
    jax and jaxlib, backend and platform version, device kind and count, and (on a
    CPU, where XLA compiles for the host's instruction set) the same CPU features and
    compile options. Two processes with equal fingerprints can load each other's
    cached programs; `fingerprint_id` is its short hash."""
    import jaxlib

    dev = _device()
    client = getattr(dev, "client", None)
    fp = {
        "jax": jax.__version__,
        "jaxlib": jaxlib.__version__,
        "platform": dev.platform,
        "platform_version": str(getattr(client, "platform_version", "")),
        "device_kind": str(dev.device_kind),
        "devices": str(len(jax.devices())),
        "machine": platform.machine(),
        "options": json.dumps(compiler_options(), sort_keys=True),
    }
    if dev.platform == "cpu":
        fp["cpu_features"] = hashlib.sha256(" ".join(_cpu_flags()).encode()).hexdigest()[:16]
    return fp


def fingerprint_id(fp: dict[str, str] | None = None) -> str:
    """16 hex digits naming `fingerprint()` (a registry key token)."""
    text = json.dumps(fp if fp is not None else fingerprint(), sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def _cpu_flags() -> list[str]:
    """The host CPU's feature flags (Linux), sorted; [] where they cannot be read."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return []
    for line in text.splitlines():
        if line.startswith(("flags", "Features")):
            return sorted(set(line.split(":", 1)[1].split()))
    return []


def cache_dir() -> Path | None:
    """The persistent compilation cache's folder, or None when it is off."""
    path = jax.config.jax_compilation_cache_dir  # type: ignore[attr-defined]  # unstubbed flag
    return Path(path) if path else None


_counts = {"compiled": 0, "loaded": 0}
_counting = threading.Lock()
_listening = False


def _count_compiles() -> None:
    """Count the persistent cache's misses (a program compiled, then written) and
    hits (read instead of compiled) from JAX's monitoring events, once."""
    global _listening
    with _counting:
        if _listening:
            return
        _listening = True

    def heard(event: str, **_: object) -> None:
        if event == "/jax/compilation_cache/cache_misses":
            _counts["compiled"] += 1
        elif event == "/jax/compilation_cache/cache_hits":
            _counts["loaded"] += 1

    jax.monitoring.register_event_listener(heard)


def compile_counts() -> dict[str, int]:
    """{"compiled": programs this process compiled, "loaded": read from the cache},
    since `setup` turned the cache on."""
    return dict(_counts)


# ------------------------------------------------------------- memory maps

MAP_RESERVE = 8000
"""Memory maps one more compile may take, with writing it to the cache: XLA's CPU
JIT maps every kernel's code, constants and data apart, about 450 maps for one of
SmolLM2's step programs, and LLVM aborts the process (or it segfaults) when an
mmap fails at the kernel's `vm.max_map_count` (65,530 by default on Linux)."""

MAP_LIMIT_ADVICE = "sysctl -w vm.max_map_count=262144"


class MapLimit(RuntimeError):
    """Compiling one more program could run this process out of memory maps."""


def map_count() -> tuple[int, int]:
    """(memory maps this process holds, the kernel's limit); (0, 0) where unknown."""
    try:
        with open("/proc/self/maps", "rb") as f:
            held = f.read().count(b"\n")
        with open("/proc/sys/vm/max_map_count") as f:
            return held, int(f.read())
    except (OSError, ValueError):
        return 0, 0


def check_map_room() -> None:
    """Raise MapLimit when fewer than MAP_RESERVE maps are left to this process."""
    held, limit = map_count()
    if limit and limit - held < MAP_RESERVE:
        raise MapLimit(f"this process holds {held} of its {limit} memory maps, too near "
                       f"the limit to compile another program; raise it: {MAP_LIMIT_ADVICE}")


# XLA CPU options for the encoder and decoder executables (compile-time, per
# executable; never process-wide XLA_FLAGS). YNNPACK fusions are switched off: XLA
# then runs the dots on its own GEMM kernels and fuses the element-wise work into
# loops; on the 2-core AVX2 EPYC this cut a batch-1 16-token MiniLM forward from
# ~18 to ~11 CPU-ms and left batch-64 throughput unchanged or slightly better
# (docs/decisions/0001-encoder-engine.md).
CPU_COMPILER_OPTIONS = {"xla_cpu_experimental_ynn_fusion_type": ""}


def compiler_options() -> dict[str, str]:
    """Options for `jit(...).lower(...).compile(compiler_options=...)` on this
    backend; see `compile_lowered` for the fallback when jaxlib lacks one."""
    return dict(CPU_COMPILER_OPTIONS) if _device().platform == "cpu" else {}


def compile_lowered(lowered):
    """Compile with `compiler_options()`, or with none if this jaxlib rejects them
    (the option names are XLA's and may change between releases); MapLimit instead
    of a compile that could take the process down (`check_map_room`)."""
    check_map_room()
    options = compiler_options()
    if options:
        try:
            return lowered.compile(compiler_options=options)
        except jax.errors.JaxRuntimeError as exc:
            if "compile option" not in str(exc):
                raise
    return lowered.compile()


def _device():
    return jax.devices()[0]


def device_name() -> str:
    """'cpu', or 'cuda:0' style for accelerators (the Encoder.device field)."""
    dev = _device()
    if dev.platform == "cpu":
        return "cpu"
    platform = "cuda" if dev.platform == "gpu" else dev.platform
    return f"{platform}:{dev.id}"


def describe() -> str:
    dev = _device()
    if dev.platform == "cpu":
        return f"cpu ({os.cpu_count()} cores)"
    return f"{device_name()} ({dev.device_kind})"


def memory_bytes() -> int:
    """Device memory in use, where the backend reports it (GPUs); 0 on CPU."""
    try:
        stats = _device().memory_stats()
    except (RuntimeError, NotImplementedError, AttributeError):
        return 0
    if not stats:
        return 0
    return int(stats.get("bytes_in_use", 0))


def release_freed_memory() -> int:
    """Hand the C heap's freed pages back to the system (glibc's `malloc_trim`; a
    no-op elsewhere) -> 1 when some were. Building an engine's weights leaves most of
    its intermediate arrays freed but still resident: a 1.0 GB Q4_K_M file's worker
    held 5.2 GB after its build and 1.7 GB after this (docs/decisions/0090)."""
    import ctypes
    import ctypes.util

    name = ctypes.util.find_library("c")
    try:
        trim = ctypes.CDLL(name).malloc_trim if name else None
    except (OSError, AttributeError):  # not glibc (musl, macOS): nothing to call
        return 0
    return int(trim(0)) if trim is not None else 0
