"""bench/gpu_check.sh in its CPU dry mode: the script the lent GPU machine runs keeps
working (its test selection still collects, the benchmark path runs every weight form
through the real loaders, the serving path answers over a real bus in front of the
stand-in model, and one JSON file comes out)."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


# About 100 CPU-seconds: two to three minutes on a quiet machine, five at load 12 on
# two cores (its engine benchmarks alone passed 200 s). The bound is there to catch a
# hang, not to time it: a dry run gives each step 400 s.
@pytest.mark.timeout(1300)
def test_dry_mode_writes_one_json_file_with_every_form(tmp_path, jax_cache_dir):
    out = tmp_path / "check.json"
    # The suite's compilation cache: a second run loads the benchmarks' programs.
    env = {**{k: v for k, v in os.environ.items() if k != "XLA_FLAGS"},
           "JAX_CACHE_DIR": jax_cache_dir}
    done = subprocess.run(["bash", "bench/gpu_check.sh", "--dry", "--out", str(out)], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=1250)  # fmt: skip
    doc = json.loads(out.read_text()) if out.exists() else {}
    rcs = {k: v for k, v in doc.items() if k.endswith(("_rc", "_seconds"))}  # 124: a step's limit
    assert done.returncode == 0, (rcs, done.stdout[-3000:] + done.stderr[-3000:])
    assert doc["dry"] and doc["tests"]["rc"] == 0 and "collected" in doc["tests"]["summary"]
    bench = doc["bench"]
    assert bench["platform"] == "cpu"
    for part in ("encoder", "decoder"):
        rows = {(r["quant"], r.get("form", "auto")): r for r in bench[part]}
        assert [q for q, f in rows if f == "auto"] == ["none", "int8", "int4", "fp8"]
        int8_form = "dequant" if part == "decoder" else "auto"  # auto may hold two forms
        none, int8, int4 = (rows[q, f]["weight_bytes"] for q, f in
                            (("none", "auto"), ("int8", int8_form), ("int4", "auto")))
        assert int8 < none / 2 and int4 < int8
        assert rows["int8", "auto"]["weight_bytes"] <= none  # the default weight budget
        assert all(r.get("sentences_per_s", r.get("tokens_per_s", 0)) > 0 for r in rows.values())
    decoder = {(r["quant"], r["form"]): r for r in bench["decoder"]}
    assert set(decoder) >= {("int8", "dequant"), ("int8", "w8a8")}
    auto = decoder["int8", "auto"]  # the choice per bucket, with what each form measured
    assert set(auto["chosen"]) == set(auto["form_ms"]) and auto["chosen"]
    for bucket, form in auto["chosen"].items():
        assert form == min(auto["form_ms"][bucket], key=auto["form_ms"][bucket].get)
    serving = doc["serving"]  # the stack in front of the engine: every request answered
    assert doc["serving_rc"] == 0 and serving["engine"]["batch64_sps"] > 0
    rows = serving["stack"]["gateways_1"]
    assert [r["concurrency"] for r in rows] == [1, 16]
    assert all(r["answered"] > 0 and r["errors"] == 0 for r in rows)
