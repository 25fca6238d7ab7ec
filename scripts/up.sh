#!/usr/bin/env bash
# Install what is needed, then run the whole stack: nats-server (JetStream under
# $TENSORBUS_DATA_DIR), gateway, scheduler, worker(s), telemetry. Extra arguments go
# to honcho, e.g. `scripts/up.sh -c worker=2`.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/bootstrap.sh
exec .venv/bin/honcho start "$@"
