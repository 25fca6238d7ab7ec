"""Tensor parallelism: the layout helpers here, the engines on forced CPU devices in a
child pytest process (tests/engine/multidevice_cases.py), and the start-up errors."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from engine import sharding
from engine.decoder import DecoderEngine
from tests.support.tiny_models import build

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.timeout(800)  # a whole child suite: minutes on a shared 2-core machine
def test_engines_on_three_forced_cpu_devices_equal_one_device():
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=3")
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
         "tests/engine/multidevice_cases.py"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=800,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-6000:] + done.stderr[-2000:]
    assert " passed" in done.stdout and "skipped" not in done.stdout


def test_shard_major_puts_each_devices_columns_together():
    q, k, v = np.arange(6), 10 + np.arange(4), 20 + np.arange(4)  # parts 6, 4, 4
    fused = np.concatenate([q, k, v])[None, :]  # [1, 14]
    major = sharding.shard_major(fused, (6, 4, 4), 2)
    assert major.tolist() == [[0, 1, 2, 10, 11, 20, 21, 3, 4, 5, 12, 13, 22, 23]]
    got = sharding.split_fused(major, (6, 4, 4), 2)
    assert [g.tolist() for g in got] == [[q.tolist()], [k.tolist()], [v.tolist()]]
    assert sharding.shard_major(fused, (6, 4, 4), 1) is fused


def test_heads_that_do_not_divide_are_refused_with_the_sizes(tmp_path):
    build("llama", tmp_path, positions=32, heads=9, kv_heads=3, head_dim=8, intermediate=96)
    with pytest.raises(sharding.ShardingError) as info:
        DecoderEngine(tmp_path, "nine", slots=1, max_context=32, tensor_parallel=2)
    assert "9 query heads, 3 kv heads into 2 equal parts" in str(info.value)
    with pytest.raises(sharding.ShardingError, match="at least 1"):
        sharding.parse("0")


def test_one_device_reports_its_name():
    assert sharding.engine_devices(None) == ["cpu:0"]
