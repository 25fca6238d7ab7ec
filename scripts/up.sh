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
fleet=",${TENSORBUS_FLEET:-}"
case "${fleet// /}" in
  *,tensorbus-demo-lm=*) ;;
  *) export TENSORBUS_FLEET="${TENSORBUS_FLEET:+$TENSORBUS_FLEET,}tensorbus-demo-lm=0:1" ;;
esac
exec .venv/bin/honcho start "$@"
