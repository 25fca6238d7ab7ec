"""JAX runtime setup: the persistent compilation cache really fills on disk."""

from __future__ import annotations

import subprocess
import sys

import pytest

from engine import jaxrt

_SCRIPT = """
import sys
from engine import jaxrt
print(jaxrt.setup(sys.argv[1]))
import jax, jax.numpy as jnp
print(float(jax.jit(lambda x: jnp.sin(x) * 2)(jnp.ones(3)).sum()))
"""


def test_setup_writes_compiled_executables_to_the_cache(tmp_path):
    cache = tmp_path / "jax-cache"
    out = subprocess.run([sys.executable, "-c", _SCRIPT, str(cache)],
                         capture_output=True, text=True, check=True)  # fmt: skip
    described, value = out.stdout.strip().splitlines()
    assert described.startswith("cpu") and abs(float(value) - 5.0488) < 1e-3
    assert any(cache.iterdir()), "nothing was cached"


def test_dtype_names_and_device():
    import jax.numpy as jnp

    assert jaxrt.parse_dtype("bf16") is jnp.bfloat16
    assert jaxrt.parse_dtype("float32") is jnp.float32
    assert jaxrt.dtype_name("half") == "float16"
    with pytest.raises(ValueError, match="unknown dtype"):
        jaxrt.parse_dtype("int8")
    assert jaxrt.device_name() == "cpu" and jaxrt.memory_bytes() >= 0


def test_compile_falls_back_when_jaxlib_lacks_an_option(monkeypatch):
    import jax
    import jax.numpy as jnp

    lowered = jax.jit(lambda x: x * 3).lower(jnp.ones(4))
    monkeypatch.setattr(jaxrt, "CPU_COMPILER_OPTIONS", {"xla_cpu_no_such_option": ""})
    assert float(jaxrt.compile_lowered(lowered)(jnp.ones(4)).sum()) == 12.0
    monkeypatch.undo()
    assert jaxrt.compiler_options() == jaxrt.CPU_COMPILER_OPTIONS
    assert float(jaxrt.compile_lowered(lowered)(jnp.ones(4)).sum()) == 12.0
