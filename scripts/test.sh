#!/usr/bin/env bash
# Install what is needed (with the test extras), then run the test suite.
# Extra arguments go to pytest, e.g. `scripts/test.sh tests/engine -x`.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/bootstrap.sh dev
# Debian packages some tests run: a real Prometheus for the metrics tests
# (tests/support/prometheus.py), buildah and debootstrap to build and run the image
# (tests/deploy/test_image.py), g++ for the CPU kernel over GGUF blocks
# (engine/kernels, tests/engine/test_gguf_kernel.py).
need=()
[ -x /usr/bin/prometheus ] || command -v prometheus >/dev/null || need+=(prometheus)
command -v buildah >/dev/null || need+=(buildah)
command -v debootstrap >/dev/null || need+=(debootstrap)
command -v "${CXX:-g++}" >/dev/null || need+=(g++)
if [ ${#need[@]} -gt 0 ]; then
    if [ "$(id -u)" -eq 0 ] && command -v apt-get >/dev/null; then
        echo "installing ${need[*]} (Debian packages) for the tests ..." >&2
        export DEBIAN_FRONTEND=noninteractive DEBCONF_NOWARNINGS=yes
        apt-get update -qq >/dev/null
        apt-get install -y -qq --no-install-recommends "${need[@]}" >/dev/null
    else
        echo "some tests need ${need[*]}: sudo apt-get install ${need[*]}" >&2
    fi
fi
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
# The CPU kernels' library, built into .venv as scripts/up.sh builds it.
.venv/bin/python -m engine.kernels
# The import contracts first (pyproject.toml, [tool.importlinter]): the layers
# shared <- engine <- services <- bench, no service importing another, no cycles.
.venv/bin/lint-imports --no-cache
# The type checker over shared/, engine/ and services/ ([tool.mypy] in pyproject.toml).
.venv/bin/mypy
# Two test processes (pytest-xdist), each taking a whole file at a time so that a
# file's module fixtures are built once: much of a test's time is waiting on a stack
# it started or on one thread of a compile, and two of them fill the two cores this
# suite is sized for (docs/benchmarks.md, "The slowest tests"). TENSORBUS_TEST_WORKERS=0
# runs everything in this one process.
exec .venv/bin/python -m pytest -q -p no:cacheprovider -n "${TENSORBUS_TEST_WORKERS:-2}" \
    --dist loadfile "$@"
