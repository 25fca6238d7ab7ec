"""Tensor parallelism: one engine over N devices through `jax.sharding`.

Megatron's split of a transformer block, written as shardings and left to XLA's
SPMD partitioner:
  1. in-projections are column-parallel: Q/K/V (and MLP up, gate) are split by
     output column, so device i holds heads [i*H/N, (i+1)*H/N) and their K/V heads;
  2. attention runs per head, on the device that holds the head; the KV cache is
     split by KV head the same way (the paged pool [KV, NUM_BLOCKS, BLOCK, D] sharded on KV);
  3. out-projections (attention output, MLP down) are row-parallel: each device
     multiplies its own slice of the inputs, and the partial sums meet in one
     all-reduce per projection, inserted by XLA;
  4. norms, embeddings, the lm head and the sampling state are replicated.

Fused matrices ([q | k | v], [gate | up]) are stored shard-major when N > 1
(`shard_major`): device i's contiguous block of columns is [q_i | k_i | v_i], so the
split after the matmul is local. With N = 1 nothing here is used: no mesh, no
reordering, the single-device programs are unchanged.
"""

from __future__ import annotations

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from engine.quant import QWeight

AXIS = "tp"
# Parameter names by role, for both encoder and decoder trees.
COLUMN = frozenset({"qkv_w", "qkv_b", "gate_up_w", "up_w", "up_b", "i_w", "i_b"})
ROW = frozenset({"o_w", "down_w", "f_w"})


class ShardingError(ValueError):
    """The model cannot be split over the requested devices (a configuration error)."""


def parse(value: str | int) -> int:
    try:
        n = int(value)
    except (TypeError, ValueError):
        raise ShardingError(f"tensor parallel degree {value!r} is not a whole number") from None
    if n < 1:
        raise ShardingError(f"tensor parallel degree must be at least 1, not {n}")
    return n


def check_divisible(model: str, n: int, **sizes: int) -> None:
    """ShardingError naming every size that does not split into n equal parts."""
    bad = [f"{size} {what.replace('_', ' ')}" for what, size in sizes.items() if size % n]
    if bad:
        raise ShardingError(
            f"{model}: TENSORBUS_TENSOR_PARALLEL={n} cannot split {', '.join(bad)} "
            f"into {n} equal parts; use a degree that divides them"
        )


def make_mesh(n: int) -> Mesh | None:
    """A one-axis mesh over the first n devices; None for n = 1 (single device)."""
    if n == 1:
        return None
    devices = jax.devices()
    if len(devices) < n:
        raise ShardingError(
            f"TENSORBUS_TENSOR_PARALLEL={n} needs {n} devices; {len(devices)} visible "
            f"({', '.join(device_names(devices))})"
        )
    return Mesh(np.array(devices[:n]), (AXIS,))


def device_names(devices) -> list[str]:
    """['cpu:0', 'cpu:1'] or ['cuda:0', ...]: what a heartbeat reports."""
    out = []
    for d in devices:
        platform = "cuda" if d.platform == "gpu" else d.platform
        out.append(f"{platform}:{d.id}")
    return out


def engine_devices(mesh: Mesh | None) -> list[str]:
    return device_names(mesh.devices.flat if mesh is not None else jax.devices()[:1])


def shard_major(w: np.ndarray, parts: tuple[int, ...], n: int, axis: int = -1) -> np.ndarray:
    """Reorder fused columns [a | b | c] (sizes `parts` along `axis`) into n blocks
    [a_0 | b_0 | c_0 | a_1 | b_1 | c_1 | ...], each part split evenly."""
    if n == 1:
        return w
    pieces = np.split(w, np.cumsum(parts)[:-1], axis=axis)
    split = [np.split(p, n, axis=axis) for p in pieces]
    return np.concatenate([s[i] for i in range(n) for s in split], axis=axis)


def split_fused(y, parts: tuple[int, ...], n: int) -> list:
    """y: [..., sum(parts)] in shard-major order -> one [..., part] array per part, in
    natural order. n = 1 is plain slicing."""
    lead = y.shape[:-1]
    out, offset = [], 0
    if n == 1:
        for p in parts:
            out.append(y[..., offset : offset + p])
            offset += p
        return out
    blocks = y.reshape(lead + (n, sum(parts) // n))  # [..., N, C/N]
    for p in parts:
        out.append(blocks[..., offset : offset + p // n].reshape(lead + (p,)))
        offset += p // n
    return out


def _spec(role: str | None, a, n: int) -> P:
    if role == "col":
        return P(*([None] * (a.ndim - 1) + [AXIS]))
    if role == "row" and a.ndim >= 1 and a.shape[0] > 1 and a.shape[0] % n == 0:
        return P(AXIS, *([None] * (a.ndim - 1)))
    return P()


def place(tree, mesh: Mesh):
    """Put a parameter tree on the mesh: column/row roles by leaf name, the rest
    replicated (a QWeight's parts follow their weight's role)."""
    n = mesh.devices.size

    def put(a, role):
        return jax.device_put(a, NamedSharding(mesh, _spec(role, a, n)))

    def walk(node, role=None):
        if isinstance(node, dict):
            return {k: walk(v, "col" if k in COLUMN else "row" if k in ROW else None)
                    for k, v in node.items()}  # fmt: skip
        if isinstance(node, list):
            return [walk(v, role) for v in node]
        if isinstance(node, QWeight):
            return jax.tree.map(lambda a: put(a, role), node)  # q, scale, offset
        return put(node, role)

    return walk(tree)


def replicated(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, P())


def kv_sharding(mesh: Mesh) -> NamedSharding:
    """Paged KV pool [KV, NUM_BLOCKS, BLOCK, D] (one per layer) split by KV head."""
    return NamedSharding(mesh, P(AXIS, None, None, None))


def state_sharding(state, mesh: Mesh):
    """A decoder's state (engine.decoder.kvcache.DecodeState): each layer's KV pool
    split by KV head, everything else (cursors, sampling, counts) replicated."""
    kv, rep = kv_sharding(mesh), replicated(mesh)
    return type(state)(*(rep for _ in state))._replace(
        k=tuple(kv for _ in state.k), v=tuple(kv for _ in state.v))
