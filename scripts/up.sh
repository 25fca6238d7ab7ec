#!/usr/bin/env bash
# Install what is needed, then run the whole stack with honcho: nats-server (JetStream
# under $TENSORBUS_DATA_DIR), gateway, scheduler, the local orchestrator (which runs
# the workers) and telemetry. Extra arguments go to honcho.
#
# Every bundled model is served with TENSORBUS_MIN_WORKERS workers (default 1) except
# the demo LM, which starts on its first request (tensorbus-demo-lm=0:1) unless
# TENSORBUS_FLEET names it. Size the fleet with TENSORBUS_FLEET, for example
#   TENSORBUS_FLEET=all-MiniLM-L6-v2=2:4 scripts/up.sh      # two encoder workers, up to four
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/bootstrap.sh
# The CPU kernels (paged attention, GGUF blocks: engine/kernels) are built with g++ here,
# once per install, not at a worker's start; without g++ a decoder runs the slower XLA
# path, with more programs.
if ! command -v "${CXX:-g++}" >/dev/null; then
    if [ "$(id -u)" -eq 0 ] && command -v apt-get >/dev/null; then
        echo "installing g++ (Debian package) for the CPU kernels ..." >&2
        DEBIAN_FRONTEND=noninteractive apt-get update -qq >/dev/null
        DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends g++ >/dev/null
    else
        echo "no g++: decoders run without the CPU kernels (sudo apt-get install g++)" >&2
    fi
fi
.venv/bin/python -m engine.kernels
# A JAX worker maps every compiled kernel apart (tens of thousands of maps with the
# compute forms' programs); Linux's default limit is 65,530 (docs/operations.md, "Memory maps").
maps=$(cat /proc/sys/vm/max_map_count 2>/dev/null || echo 262144)
if [ "$maps" -lt 262144 ]; then
    if [ "$(id -u)" -eq 0 ]; then
        echo "raising vm.max_map_count from $maps to 262144 for the JAX workers" >&2
        sysctl -q -w vm.max_map_count=262144 || true
    else
        echo "vm.max_map_count is $maps; a worker stops compiling near it: sudo sysctl -w vm.max_map_count=262144" >&2
    fi
fi
fleet=",${TENSORBUS_FLEET:-}"
case "${fleet// /}" in
  *,tensorbus-demo-lm=*) ;;
  *) export TENSORBUS_FLEET="${TENSORBUS_FLEET:+$TENSORBUS_FLEET,}tensorbus-demo-lm=0:1" ;;
esac
exec .venv/bin/honcho start "$@"
