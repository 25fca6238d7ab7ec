"""bench/gpu_check.sh in its CPU dry mode: the script the lent GPU machine runs keeps
working (its test selection still collects, the benchmark path runs every weight form
through the real loaders, and one JSON file comes out)."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_dry_mode_writes_one_json_file_with_every_form(tmp_path):
    out = tmp_path / "check.json"
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    done = subprocess.run(["bash", "bench/gpu_check.sh", "--dry", "--out", str(out)], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=300)  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    doc = json.loads(out.read_text())
    assert doc["dry"] and doc["tests"]["rc"] == 0 and "collected" in doc["tests"]["summary"]
    bench = doc["bench"]
    assert bench["platform"] == "cpu"
    for part in ("encoder", "decoder"):
        rows = {r["quant"]: r for r in bench[part]}
        assert list(rows) == ["none", "int8", "int4"]
        assert rows["int8"]["weight_bytes"] < rows["none"]["weight_bytes"] / 2
        assert rows["int4"]["weight_bytes"] < rows["int8"]["weight_bytes"]
        assert all(r.get("sentences_per_s", r.get("tokens_per_s", 0)) > 0 for r in rows.values())
