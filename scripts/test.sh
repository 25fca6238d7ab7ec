#!/usr/bin/env bash
# Install what is needed (with the test extras), then run the test suite.
# Extra arguments go to pytest, e.g. `scripts/test.sh tests/engine -x`.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/bootstrap.sh dev
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
exec .venv/bin/python -m pytest -q -p no:cacheprovider "$@"
