"""The stages package is pure: importing it never pulls in trio or libp2p."""

from __future__ import annotations

import subprocess
import sys

MODULES = ["config", "partition", "model", "stage", "optim", "tokenizer", "corpus", "sampling", "reference", "errors"]


def test_stages_modules_do_not_import_io_libraries() -> None:
    code = (
        "import sys\n"
        + "".join(f"import protolearn.stages.{m}\n" for m in MODULES)
        + "print(sorted(m for m in sys.modules if m.split('.')[0] in ('trio', 'libp2p', 'multiaddr')))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    assert out.stdout.strip() == "[]"
