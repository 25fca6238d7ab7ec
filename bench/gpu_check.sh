#!/usr/bin/env bash
# The engine on a lent GPU machine: engine tests on the GPU, then the engine
# benchmarks in bfloat16 (MiniLM-shaped encoder at batch 256, SmolLM2-shaped decode
# at 64 streams; float weights, int8, int4, fp8, and for the decoder int8 with each
# compute form: int8 x int8, dequantized, and the one chosen per bucket by measurement,
# docs/decisions/0013), all in one JSON file, within 7 minutes.
#
# That machine has no network and its own Python 3.12 with JAX (CUDA), torch,
# transformers and tokenizers; it lacks msgspec and structlog, which the engine
# imports. Fetch their wheels here once (into .whl/, ignored by git) and carry them:
#
#   bash bench/gpu_check.sh --fetch-wheels                       # here, once
#   run(command='bash bench/gpu_check.sh --out $OUT/gpu_check.json', carry=['.whl'])
#   bash bench/gpu_check.sh --dry --out /tmp/gpu_check_dry.json  # here, CPU, < 60 s
#
# Model files cannot travel (64 MiB per call; MiniLM's wheel is 88 MB), so the
# benchmarks write random weights in the real shapes (bench/engine_check.py), and the
# tests that need the MiniLM wheel are left out. Nothing here changes the GPU's
# settings; JAX's memory goes back when each process exits.
set -uo pipefail
cd "$(dirname "$0")/.."

DRY=0
OUT=gpu_check.json
while [ $# -gt 0 ]; do
  case "$1" in
    --dry) DRY=1 ;;
    --out) OUT="$2"; shift ;;
    --fetch-wheels)
      python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 \
        --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
        --platform manylinux2014_x86_64 -d .whl msgspec structlog
      grep -qx '/.whl/' .git/info/exclude 2>/dev/null || echo '/.whl/' >> "$(git rev-parse --git-path info/exclude)"
      exit $? ;;
    *) echo "unknown argument $1" >&2; exit 2 ;;
  esac
  shift
done

if [ "$DRY" = 1 ]; then
  PY=${PYTHON:-$( [ -x .venv/bin/python ] && echo .venv/bin/python || echo python3 )}
  export JAX_PLATFORMS=cpu
  BENCH_ARGS=(--dry --dtype float32)
else
  PY=${PYTHON:-python3}
  export JAX_PLATFORMS=cuda  # fail rather than measure the CPU by mistake
  BENCH_ARGS=(--dtype bfloat16 --batch 256 --seq 128 --streams 64 --steps 32)
  if ls .whl/*.whl >/dev/null 2>&1; then
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
      --target /tmp/site .whl/*.whl || exit 3
    export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
  fi
fi
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 PYTHONUNBUFFERED=1
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT

missing=$("$PY" -c "
import importlib.util as u
print(' '.join(m for m in ('jax', 'msgspec', 'structlog', 'tokenizers', 'jinja2', 'numpy', 'safetensors') if u.find_spec(m) is None))")
if [ -n "$missing" ]; then
  echo "missing Python packages: $missing (bash bench/gpu_check.sh --fetch-wheels here, carry .whl)" >&2
  exit 3
fi

# 1. Engine tests on the device (the tests that read the MiniLM or SmolLM2 files are
#    excluded: no model files there).
TESTS=(tests/engine/test_decoder.py tests/engine/test_quant.py tests/engine/test_buckets.py
       tests/engine/test_detok.py)
SELECT=(-k "not minilm and not smollm2")
t0=$(date +%s)
if [ "$DRY" = 1 ]; then
  # Only check that the selection still names tests; running them is the CPU suite's job.
  timeout 60 "$PY" -m pytest -q -p no:cacheprovider --noconftest --collect-only "${SELECT[@]}" \
    "${TESTS[@]}" > "$WORK/tests.log" 2>&1
else
  timeout 210 "$PY" -m pytest -q -p no:cacheprovider --noconftest "${SELECT[@]}" \
    "${TESTS[@]}" > "$WORK/tests.log" 2>&1
fi
tests_rc=$?
tests_s=$(( $(date +%s) - t0 ))
tail -5 "$WORK/tests.log"

# 2. Benchmarks (random weights, real shapes).
t0=$(date +%s)
timeout 200 "$PY" -m bench.engine_check "${BENCH_ARGS[@]}" --out "$WORK/bench.json" \
  > "$WORK/bench.log" 2>&1
bench_rc=$?
bench_s=$(( $(date +%s) - t0 ))
tail -8 "$WORK/bench.log"

# 3. One JSON file.
"$PY" - "$OUT" "$WORK" "$tests_rc" "$tests_s" "$bench_rc" "$bench_s" "$DRY" <<'EOF'
import json, pathlib, subprocess, sys
out, work, tests_rc, tests_s, bench_rc, bench_s, dry = sys.argv[1:]
work = pathlib.Path(work)
log = (work / "tests.log").read_text(errors="replace").strip().splitlines()
bench = work / "bench.json"
try:
    gpu = subprocess.run(["nvidia-smi", "--query-gpu=name,memory.total,driver_version",
                          "--format=csv,noheader"], capture_output=True, text=True).stdout.strip()
except OSError:
    gpu = ""
doc = {
    "dry": dry == "1", "gpu": gpu,
    "tests": {"rc": int(tests_rc), "seconds": int(tests_s), "summary": log[-1] if log else ""},
    "bench": json.loads(bench.read_text()) if bench.exists() else None,
    "bench_rc": int(bench_rc), "bench_seconds": int(bench_s),
    "bench_log_tail": (work / "bench.log").read_text(errors="replace")[-3000:],
}
pathlib.Path(out).parent.mkdir(parents=True, exist_ok=True)
pathlib.Path(out).write_text(json.dumps(doc, indent=2))
print("wrote", out)
EOF
[ "$tests_rc" = 0 ] && [ "$bench_rc" = 0 ]
