#!/usr/bin/env bash
# Set up protolearn in ./.venv and install it in editable mode, with its test tools.
#
# torch: a torch that the chosen Python already has (for example a CUDA build on a GPU machine) is
# kept, by giving the venv access to the system site-packages. Otherwise the CPU build
# torch==2.13.0 is installed; a plain `pip install torch` would pull a multi-GB CUDA build.
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3}"

if ! "$PY" -c 'import sys; sys.exit(sys.version_info < (3, 11))' 2>/dev/null; then
    echo "protolearn needs Python >= 3.11; '$PY' is $("$PY" --version 2>&1). Set PYTHON=/path/to/python3.11." >&2
    exit 1
fi

if [ ! -x .venv/bin/python ]; then
    if "$PY" -c 'import torch' 2>/dev/null; then
        echo "setup: keeping the installed torch $("$PY" -c 'import torch; print(torch.__version__)')"
        "$PY" -m venv --system-site-packages .venv
    else
        "$PY" -m venv .venv
    fi
fi

export PIP_DISABLE_PIP_VERSION_CHECK=1
if ! .venv/bin/python -c 'import torch' 2>/dev/null; then
    echo "setup: installing the CPU build of torch (torch==2.13.0)"
    .venv/bin/python -m pip install -q "torch==2.13.0"
fi
.venv/bin/python -m pip install -q -e ".[test]"
.venv/bin/python -c 'import protolearn.cli.main' || { echo "setup: protolearn failed to import" >&2; exit 1; }
echo "setup: ready. Run .venv/bin/protolearn --help"
