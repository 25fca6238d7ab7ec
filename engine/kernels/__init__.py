"""CPU kernels reached from JAX through the XLA FFI: a matrix-vector product over
integer weight groups (gguf_matvec.cc; docs/decisions/0062) and paged attention that
reads each sequence's K/V blocks in place (paged_attention.cc; docs/decisions/0072).

The sources are compiled with the system's g++ for this machine's CPU (-O3
-march=native), each on its own core, into one library named by a hash of the
sources, the compiler ($CXX, else g++), the CPU's flags and jax's version; it is
loaded with ctypes and registered as an FFI target. The install builds it
(`python -m engine.kernels`, run by scripts/bootstrap.sh) into the environment's
`share/tensorbus/kernels`, so a worker on an empty data directory finds it there;
failing that, the first `load` builds it into the cache folder beside the JAX
compilation cache (8 s on two cores, at every cold start before).
Where that cannot be done (not on CPU, no compiler, a failed build) `load` returns
None, says why once in the log, and the engine keeps its XLA path. Importing this
module compiles nothing.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
import sys
import threading
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from shared.logging import get_logger

log = get_logger(__name__)

SOURCES = tuple(Path(__file__).with_name(n) for n in ("gguf_matvec.cc", "paged_attention.cc"))
HEADERS = (Path(__file__).with_name("pool.h"),)  # part of the build's key too
TARGET = "tensorbus_gguf_matvec"
ATTENTION = "tensorbus_paged_attention"
COMPILER = "g++"  # the CXX environment variable overrides, as in make
FLAGS = ("-O3", "-march=native", "-std=c++17", "-fPIC")

_lock = threading.Lock()
_state: dict[str, object] = {}  # "lib" once loaded, "why" once refused
_registered: list = []  # the library whose FFI target this process registered (one only)


def compiler() -> str | None:
    """The C++ compiler's path: $CXX (a name or a path), else g++ on PATH; None: none."""
    return shutil.which(os.environ.get("CXX") or COMPILER)


def cache_dir() -> Path:
    """Beside the JAX compilation cache when one is set, else ~/.cache/tensorbus."""
    base = jax.config.jax_compilation_cache_dir  # type: ignore[attr-defined]  # unstubbed flag
    root = Path(base) if base else Path.home() / ".cache" / "tensorbus"
    return root / "kernels"


def installed_dir() -> Path:
    """Where the install puts the library it builds: inside the environment."""
    return Path(sys.prefix) / "share" / "tensorbus" / "kernels"


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return line
    except OSError:
        pass
    return ""


def _name(cxx: str) -> str:
    """The library's file name: a hash of everything that makes it valid here."""
    version = subprocess.run([cxx, "--version"], capture_output=True, text=True, check=True,
                             timeout=30).stdout  # fmt: skip
    texts = [s.read_text() for s in SOURCES + HEADERS]
    key = hashlib.sha256("\n".join([*texts, cxx, version, " ".join(FLAGS), _cpu_flags(),
                                    jax.__version__]).encode()).hexdigest()[:20]
    return f"tensorbus-kernels-{key}.so"


def _build(cxx: str, into: Path | None = None) -> Path:
    """The shared library for these sources, compiler and CPU: the install's or the
    cache's if either holds it, else built into `into` (default: the cache)."""
    name = _name(cxx)
    for d in (cache_dir(), installed_dir()):
        if (d / name).exists():
            return d / name
    out = (into or cache_dir()) / name
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.{os.getpid()}")
    log.info("kernel_compiling", kernels=[s.name for s in SOURCES], compiler=cxx, into=str(out))
    objs = [tmp.with_name(f"{tmp.name}.{s.stem}.o") for s in SOURCES]
    try:  # each source on its own core, then one link
        procs = [subprocess.Popen([cxx, *FLAGS, f"-I{jax.ffi.include_dir()}", "-c", str(s),
                                   "-o", str(o)], stderr=subprocess.PIPE, text=True)
                 for s, o in zip(SOURCES, objs)]  # fmt: skip
        errors = [p.communicate(timeout=300)[1] for p in procs]
        for p, err in zip(procs, errors):
            if p.returncode:
                raise RuntimeError(f"{cxx} failed: {err.strip()[-2000:]}")
        done = subprocess.run([cxx, "-shared", *map(str, objs), "-o", str(tmp)],
                              capture_output=True, text=True, timeout=300)  # fmt: skip
        if done.returncode:
            raise RuntimeError(f"{cxx} failed to link: {done.stderr.strip()[-2000:]}")
    finally:
        for o in objs:
            o.unlink(missing_ok=True)
    os.replace(tmp, out)  # atomically: another worker may be building the same
    return out


def build_installed() -> Path:
    """Build the library into the environment (the install's step); raises with the
    reason where it cannot be built."""
    cxx = compiler()
    if cxx is None:
        raise RuntimeError(f"no C++ compiler ({os.environ.get('CXX') or COMPILER})")
    return _build(cxx, into=installed_dir())


def load():
    """The loaded kernel library (its FFI target registered), or None with the
    reason logged once: not on CPU, no compiler, or the build failed."""
    with _lock:
        if "lib" in _state or "why" in _state:
            return _state.get("lib")
        try:
            if jax.default_backend() != "cpu":
                raise RuntimeError(f"the backend is {jax.default_backend()}, not cpu")
            cxx = compiler()
            if cxx is None:
                raise RuntimeError(f"no C++ compiler ({os.environ.get('CXX') or COMPILER})")
            path = _build(cxx)
            if not _registered:  # a target name is registered once per process
                lib = ctypes.cdll.LoadLibrary(str(path))
                jax.ffi.register_ffi_target(TARGET, jax.ffi.pycapsule(lib.TensorbusGgufMatvec),
                                            platform="cpu")  # fmt: skip
                jax.ffi.register_ffi_target(ATTENTION,
                                            jax.ffi.pycapsule(lib.TensorbusPagedAttention),
                                            platform="cpu")  # fmt: skip
                _registered.append(lib)
            lib = _state["lib"] = _registered[0]
            log.info("kernel_loaded", kernel=TARGET, avx2=bool(lib.tensorbus_kernel_has_avx2()),
                     vnni=bool(lib.tensorbus_kernel_has_vnni()))  # fmt: skip
        except (OSError, RuntimeError, subprocess.SubprocessError, AttributeError) as e:
            _state["why"] = str(e)
            log.warning("kernel_unavailable", kernel=TARGET, reason=str(e),
                        fallback="the XLA matmul")  # fmt: skip
        return _state.get("lib")


def unavailable_reason() -> str | None:
    return _state.get("why")  # type: ignore[return-value]


def reset() -> None:
    """Forget the last outcome (tests): the next `load` tries again (a target
    already registered stays so)."""
    with _lock:
        _state.clear()


def matvec(x, q, scale, offset, axis: int, bits: int, group: int, n: int = 0,
           act8: bool = False):
    """x: [B, K] float32 -> [B, N] float32 = x @ w, w the weight `q`, `scale`,
    `offset` (None: symmetric) hold (engine/quant.py's layout for the kernel,
    contracted over `axis`: 0 for [K, N] packed in tiles of 16 columns, N = `n`;
    1 for [N, K]). act8: x rounded to int8 per group and integer dot products, for
    4-bit dense weights (ignored for others; gguf_matvec.cc). Needs `load()` to
    have succeeded."""
    n = n if axis == 0 else q.shape[0]
    call = jax.ffi.ffi_call(TARGET, jax.ShapeDtypeStruct((x.shape[0], n), jnp.float32),
                            vmap_method="broadcast_all")  # fmt: skip
    off = scale if offset is None else offset
    return call(x.astype(jnp.float32), q, scale, off, bits=np.int64(bits),
                group=np.int64(group), axis=np.int64(axis), has_offset=offset is not None,
                act8=bool(act8))


def paged_attention(q, k_cache, v_cache, tables, rows, positions, scale: float,
                    softcap: float = 0.0, window: int | None = None):
    """q: [N, H, D]; k_cache, v_cache: [KV, NB, BLOCK, D] (float32, bfloat16 or
    float16); tables: [R, NW] int32; rows: [N] int32 (the table row of each query);
    positions: [N] int32 -> [N, H, D] float32: each query against the keys of its
    row's blocks at positions <= its own (and within `window` when given), read in
    place (paged_attention.cc). Needs `load()` to have succeeded."""
    call = jax.ffi.ffi_call(ATTENTION, jax.ShapeDtypeStruct(q.shape, jnp.float32),
                            vmap_method="sequential")  # fmt: skip
    return call(q.astype(jnp.float32), k_cache, v_cache, tables.astype(jnp.int32),
                rows.astype(jnp.int32), positions.astype(jnp.int32), scale=np.float32(scale),
                softcap=np.float32(softcap or 0.0), window=np.int64(window or 0))
