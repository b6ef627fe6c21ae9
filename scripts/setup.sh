#!/usr/bin/env bash
# Set up protolearn in ./.venv and install it in editable mode, with its test tools.
#
# torch: a torch that the chosen Python already has (for example a CUDA build on a GPU machine) is
# kept, by giving the venv access to the system site-packages. Otherwise torch==2.13.0 is installed
# from pip's configured index. On Linux x86_64 the default index (PyPI) serves the CUDA build of that
# pin, which pulls several GB of nvidia-* libraries: right for a GPU volunteer, wasted on a CPU-only
# box. PROTOLEARN_TORCH=cpu installs the CPU build from PyTorch's CPU index instead
# (https://download.pytorch.org/whl/cpu). Unset, nothing changes (CI relies on the plain pin).
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3}"
TORCH_PIN="torch==2.13.0"
TORCH_CPU_INDEX="https://download.pytorch.org/whl/cpu"
case "${PROTOLEARN_TORCH:-}" in
    "") TORCH_ARGS=("$TORCH_PIN") ;;
    cpu) TORCH_ARGS=("$TORCH_PIN" --index-url "$TORCH_CPU_INDEX") ;;
    *) echo "setup: PROTOLEARN_TORCH='$PROTOLEARN_TORCH' is not understood; use PROTOLEARN_TORCH=cpu, or leave it unset" >&2; exit 1 ;;
esac

if ! "$PY" -c 'import sys; sys.exit(sys.version_info < (3, 11))' 2>/dev/null; then
    echo "protolearn needs Python >= 3.11; '$PY' is $("$PY" --version 2>&1). Set PYTHON=/path/to/python3.11." >&2
    exit 1
fi

# iptables, for the NAT end-to-end test: tests/e2e/netns.py builds home routers in network namespaces.
# Best effort and only as root with apt-get: nothing else needs it, and without it that test skips.
if ! command -v iptables >/dev/null 2>&1 && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    if ! { timeout 600 apt-get update -qq && DEBIAN_FRONTEND=noninteractive timeout 600 apt-get install -y -qq --no-install-recommends iptables; } >/dev/null 2>&1; then
        echo "setup: could not install iptables; the NAT e2e test (tests/e2e/test_netns_topology.py) will skip"
    fi
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
    if [ "${PROTOLEARN_TORCH:-}" = cpu ]; then
        echo "setup: installing the CPU build of torch ($TORCH_PIN from $TORCH_CPU_INDEX)"
    else
        echo "setup: installing $TORCH_PIN from pip's index (on Linux x86_64, PyPI's is the CUDA build; PROTOLEARN_TORCH=cpu for the CPU one)"
    fi
    .venv/bin/python -m pip install -q "${TORCH_ARGS[@]}"
fi
.venv/bin/python -m pip install -q -e ".[test]"
# pip byte-compiles what it installs, but not an editable project's own sources. Where PYTHONDONTWRITEBYTECODE
# is set (as on this project's CI machines), every process would compile them again: about 0.5 s of CPU more per
# node, coordinator or CLI start. Python still checks each source's mtime, so an edit is picked up.
.venv/bin/python -m compileall -q -j 0 protolearn protocol stages node coordinator scripts >/dev/null
.venv/bin/python -c 'import protolearn.cli.main' || { echo "setup: protolearn failed to import" >&2; exit 1; }
echo "setup: ready. Run .venv/bin/protolearn --help"
