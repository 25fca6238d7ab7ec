"""JAX runtime setup, once per process before the first compile.

`setup()` turns on the persistent compilation cache so that a restarted worker loads
its warm-up executables from disk instead of compiling them again, and returns a short
description of the device it will run on.
"""

from __future__ import annotations

import os
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
    return describe()


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
    (the option names are XLA's and may change between releases)."""
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
