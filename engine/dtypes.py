"""The float dtypes an engine computes in, by the names people write them. Pure
Python: the worker's checks and the torch engines read it without jax."""

from __future__ import annotations

DTYPE_ALIASES = {
    "float32": "float32", "fp32": "float32", "f32": "float32", "float": "float32",
    "bfloat16": "bfloat16", "bf16": "bfloat16",
    "float16": "float16", "fp16": "float16", "f16": "float16", "half": "float16",
}  # fmt: skip


def canonical_dtype(name: str) -> str:
    """'bf16' -> 'bfloat16'; anything but float32/bfloat16/float16 is refused."""
    key = str(name).strip().lower().removeprefix("jnp.").removeprefix("torch.")
    if key not in DTYPE_ALIASES:
        raise ValueError(f"unknown dtype {name!r}; use float32, bfloat16 or float16")
    return DTYPE_ALIASES[key]
