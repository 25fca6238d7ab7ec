#!/usr/bin/env bash
# Install what is needed (with the test extras), then run the test suite.
# Extra arguments go to pytest, e.g. `scripts/test.sh tests/engine -x`.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/bootstrap.sh dev
# The metrics tests run a real Prometheus (tests/support/prometheus.py): Debian's.
if [ ! -x /usr/bin/prometheus ] && ! command -v prometheus >/dev/null; then
    if [ "$(id -u)" -eq 0 ] && command -v apt-get >/dev/null; then
        echo "installing prometheus (Debian package) for the metrics tests ..." >&2
        export DEBIAN_FRONTEND=noninteractive DEBCONF_NOWARNINGS=yes
        apt-get update -qq >/dev/null
        apt-get install -y -qq --no-install-recommends prometheus >/dev/null
    else
        echo "the metrics tests need Prometheus: sudo apt-get install prometheus" >&2
    fi
fi
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
exec .venv/bin/python -m pytest -q -p no:cacheprovider "$@"
