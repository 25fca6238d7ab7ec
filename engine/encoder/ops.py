"""The small operations both encoder families build layers from (BERT's in
model.py, ModernBERT's in modernbert.py)."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from engine.quant import QWeight
from engine.quant import matmul as qmatmul


def layer_norm(x, g, b, eps: float):
    """x: [..., D] any float dtype -> same dtype; statistics in float32."""
    x32 = x.astype(jnp.float32)
    mean = jnp.mean(x32, axis=-1, keepdims=True)
    var = jnp.mean(jnp.square(x32 - mean), axis=-1, keepdims=True)
    y = (x32 - mean) * jax.lax.rsqrt(var + eps) * g + b
    return y.astype(x.dtype)



def gelu(x, act: str):
    if act in ("gelu_new", "gelu_pytorch_tanh", "gelu_fast"):
        return jax.nn.gelu(x, approximate=True)
    if act == "relu":
        return jax.nn.relu(x)
    return jax.nn.gelu(x, approximate=False)  # HF "gelu" is the exact erf form



def mm(x, w):
    """x: [..., IN] @ w: [IN, OUT] (float, or a QWeight) -> [..., OUT]"""
    if isinstance(w, QWeight):
        return qmatmul(x.reshape(-1, x.shape[-1]), w).reshape(x.shape[:-1] + (-1,))
    return x @ w
