"""Where the test suite (and the benchmarks that borrow its programs) keep compiled
programs: `TENSORBUS_TEST_CACHE`, else a folder in the user's cache directory, so
that a second run, from this clone or a fresh one, loads what the first compiled
instead of compiling it again (docs/decisions/0085-test-cache-outlives-the-clone.md).

JAX keys each program by its whole computation, its compile options and the
jax/jaxlib version, so an entry only ever serves the program it was made from; a
changed engine compiles anew beside the old entries; `prune` drops the least
recently used once the root passes MAX_BYTES (at the start of a test session, not
on every read: JAX's own bound takes a file lock around each one).
"""

from __future__ import annotations

import os
from pathlib import Path

from shared.logging import get_logger

log = get_logger("testcache")

MAX_BYTES = 3 * 1024**3  # about fifteen whole-suite runs of programs that differ


def cache_root() -> Path:
    """The folder of every machine's test caches (not created here)."""
    if os.environ.get("TENSORBUS_TEST_CACHE"):
        return Path(os.environ["TENSORBUS_TEST_CACHE"]).resolve()
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "tensorbus" / "test-jax-cache"


def default_cache() -> Path:
    """This process's test compilation cache (not created here): a folder of the root
    per `engine.jaxrt.fingerprint`, since XLA compiles a CPU program for the host's
    instruction set and a VM may move to another CPU between two runs."""
    from engine import jaxrt

    return cache_root() / jaxrt.fingerprint_id()


def prune(folder: Path, max_bytes: int = MAX_BYTES) -> int:
    """Delete the least recently used files under `folder` until it holds at most
    `max_bytes`; returns how many went. A file another run reads meanwhile is then
    a cache miss there (JAX compiles it again), never a wrong program."""
    files = []
    for p in folder.rglob("*"):
        try:
            st = p.stat()
        except OSError:
            continue
        if p.is_file():
            files.append((max(st.st_atime, st.st_mtime), st.st_size, p))
    total = sum(size for _, size, _ in files)
    gone = 0
    for _, size, p in sorted(files, key=lambda f: f[0]):
        if total <= max_bytes:
            break
        try:
            p.unlink()
        except OSError:
            continue
        total -= size
        gone += 1
    if gone:
        log.info("test_cache_pruned", files=gone, left_bytes=total)
    return gone
