"""Decode attention over the paged KV cache: each row reads its own blocks.

The pool of one layer is [KV, NUM_BLOCKS, BLOCK, D] (KV heads first: the layout a
paged-attention kernel reads, one head's pages contiguous). A decode step's rows
each name their blocks in a table [B, NW]; NW (static) is the step's window, the
smallest compiled one that holds the longest live row (engine/decoder/engine.py),
so a step costs its batch bucket x its window, never the slot count x the context.

Three implementations of the same function:
- "xla": the row's blocks gathered into one [B, KV, NW * BLOCK, D] window, then
  masked attention (`layers.cached_attention`). Portable, and the reference.
- "cpu": a C++ kernel through the XLA FFI (engine/kernels/paged_attention.cc) that
  reads each row's blocks in place up to the row's own position, prefill chunks
  too (`chunk_attention`). Its cost follows what the rows hold, not the table's
  width, so a decoder using it compiles one decode program per batch bucket and one
  prefill program per length bucket: its tables are always a full context wide
  (engine/decoder/engine.py; docs/decisions/0072).
- "pallas": JAX's Pallas paged-attention kernel for GPUs
  (`jax.experimental.pallas.ops.gpu.paged_attention`): it reads each row's pages in
  place, up to that row's own length, split across the window for parallelism (a
  flash-decoding reduction), with no gathered copy. `interpret=True` runs the same
  kernel on the CPU, which is how the tests hold it equal to "xla".

`pick("auto", platform)` is "pallas" on a GPU, "cpu" on a CPU where the kernel
builds (g++), and "xla" elsewhere.
"""

from __future__ import annotations

import jax.numpy as jnp

from engine.decoder.config import DecoderConfig
from engine.decoder.layers import cached_attention

KERNELS = ("auto", "xla", "pallas", "cpu")
IN_PLACE = ("cpu",)  # kernels whose cost does not grow with the table's width


def pick(setting: str, platform: str, devices: int = 1) -> str:
    """The kernel a setting names on `platform` ("cpu" named where it cannot be
    built: ValueError). Over several devices (tensor parallelism) auto is "xla":
    the kernels have no rule for a pool split by KV head, and XLA would gather the
    whole pool onto each device around them."""
    if setting not in KERNELS:
        raise ValueError(f"attention kernel {setting!r}: use one of {', '.join(KERNELS)}")
    if setting == "auto":
        if devices > 1:
            return "xla"
        if platform in ("gpu", "cuda", "rocm"):
            return "pallas"
        return "cpu" if _cpu_kernel(platform) else "xla"
    if setting == "cpu" and devices > 1:
        raise ValueError("attention kernel 'cpu' runs on one device: use xla with tensor "
                         "parallelism")
    if setting == "cpu" and not _cpu_kernel(platform):
        from engine import kernels

        raise ValueError(f"attention kernel 'cpu' is not available here: "
                         f"{kernels.unavailable_reason() or 'not a CPU backend'}")  # fmt: skip
    return setting


def _cpu_kernel(platform: str) -> bool:
    """Whether the CPU kernel runs here: built on first use (a g++ run, cached)."""
    from engine import kernels

    return platform == "cpu" and kernels.load() is not None


def write(cache, blocks, offsets, new):
    """cache: [KV, NB, BLOCK, D]; blocks, offsets: [N]; new: [N, KV, D] -> cache with
    each new row at (block, offset). Donated buffers: XLA scatters in place."""
    return cache.at[:, blocks, offsets].set(new.swapaxes(0, 1))


def gather(cache, table):
    """cache: [KV, NB, BLOCK, D], table: [..., NW] -> [..., KV, NW * BLOCK, D]: the
    blocks a table names, laid end to end as one contiguous sequence."""
    g = jnp.moveaxis(cache[:, table], 0, -4)  # [..., KV, NW, BLOCK, D]
    return g.reshape(*g.shape[:-3], g.shape[-3] * g.shape[-2], g.shape[-1])


def _largest_divisor(n: int, most: int) -> int:
    return max(d for d in range(1, min(n, most) + 1) if n % d == 0)


def paged_decode(q, k_cache, v_cache, tables, positions, cfg: DecoderConfig,
                 kernel: str = "xla", interpret: bool = False, window: int | None = None):
    """One query per row against that row's blocks.

    q: [B, H, D]; k_cache, v_cache: [KV, NB, BLOCK, D]; tables: [B, NW] int32;
    positions: [B] int32 (the row's newest position, its K/V already written)
    -> [B, H * D]. Cache entries past a row's position, or before its sliding
    `window`, are never attended to. The Pallas kernel knows neither windows nor
    soft-capping: a layer with either takes the XLA path.
    """
    if kernel == "cpu":
        b = q.shape[0]
        rows = jnp.arange(b, dtype=jnp.int32)
        return _in_place(q, k_cache, v_cache, tables, rows, positions, cfg, window)
    if kernel == "xla" or window is not None or cfg.attn_softcap:
        return cached_attention(q, gather(k_cache, tables), gather(v_cache, tables),
                                positions, cfg, window)  # fmt: skip
    from jax.experimental.pallas.ops.gpu.paged_attention import paged_attention

    b, nw = tables.shape
    splits = _largest_divisor(nw, 16)  # partitions of the window, reduced at the end
    per_block = _largest_divisor(nw // splits, 8)
    scaled = (q.astype(jnp.float32) * cfg.scale).astype(q.dtype)
    out = paged_attention(
        scaled, k_cache, v_cache, tables, (positions + 1).astype(jnp.int32),
        k_splits=splits, pages_per_compute_block=per_block, interpret=interpret,
    )  # fmt: skip  # out: [B, H, D]
    return out.astype(q.dtype).reshape(b, cfg.heads * cfg.head_dim)


def chunk_attention(q, k_cache, v_cache, table, positions, cfg: DecoderConfig,
                    window: int | None = None):
    """A prefill chunk of one sequence against its blocks, read in place ("cpu").

    q: [T, H, D]; table: [NC] int32; positions: [T] int32 (each query's own; the
    chunk's K/V already written) -> [T, H * D]"""
    rows = jnp.zeros(q.shape[0], jnp.int32)
    return _in_place(q, k_cache, v_cache, table[None], rows, positions, cfg, window)


def packed_attention(q, k_cache, v_cache, tables, rows, positions, cfg: DecoderConfig,
                     window: int | None = None):
    """Queries of several sequences in one call ("cpu"): a mixed step's decode rows
    and prompt chunks (engine/decoder/steps.py `mixed`).

    q: [T, H, D]; tables: [R, NW] int32; rows: [T] int32 (each query's table row);
    positions: [T] int32 (each query's own; -1: padding, reads nothing) -> [T, H * D]"""
    return _in_place(q, k_cache, v_cache, tables, rows, positions, cfg, window)


def _in_place(q, k_cache, v_cache, tables, rows, positions, cfg: DecoderConfig, window):
    from engine import kernels

    out = kernels.paged_attention(q, k_cache, v_cache, tables, rows, positions, cfg.scale,
                                  cfg.attn_softcap or 0.0, window)  # fmt: skip
    return out.astype(q.dtype).reshape(q.shape[0], cfg.heads * cfg.head_dim)
