"""The pure core stays pure: no module of protolearn.protocol (but the libp2p adapter) or of
protolearn.stages may pull in trio or libp2p (STYLE.md, "Dependencies point one way").

Modules are discovered with pkgutil, so a module added later is checked without editing this test.
Each runs in a fresh interpreter, since this test process has long imported trio and libp2p.
"""

from __future__ import annotations

import json
import subprocess
import sys

# The adapter that binds the wire protocol to libp2p streams (the host, and framed streams).
ADAPTERS = frozenset({"protolearn.protocol.transport", "protolearn.protocol.streams"})
FORBIDDEN = ("trio", "libp2p")

_PROBE = r"""
import importlib, json, pkgutil, sys
adapters, forbidden = set(sys.argv[1].split(",")), sys.argv[2].split(",")
report = {}
for pkg_name in ("protolearn.protocol", "protolearn.stages"):
    pkg = importlib.import_module(pkg_name)
    for info in pkgutil.walk_packages(pkg.__path__, pkg_name + "."):
        if info.name in adapters or any(info.name.startswith(a + ".") for a in adapters):
            continue
        importlib.import_module(info.name)
        # Checked after each import, so the report names the first module that pulls one in.
        pulled = [f for f in forbidden if f in sys.modules and not any(f in found for found in report.values())]
        report[info.name] = pulled
print(json.dumps(report))
"""


def test_pure_modules_import_neither_trio_nor_libp2p() -> None:
    out = subprocess.run(
        [sys.executable, "-c", _PROBE, ",".join(ADAPTERS), ",".join(FORBIDDEN)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    report: dict[str, list[str]] = json.loads(out.stdout)
    # the discovery really found the pure modules (so an empty report cannot pass by accident)
    assert {"protolearn.protocol.wire", "protolearn.protocol.tensors", "protolearn.protocol.codecs", "protolearn.protocol.identity"} <= set(report)
    offenders = {name: pulled for name, pulled in report.items() if pulled}
    assert not offenders, f"pure modules pull in {offenders}; move that code into the adapter ({', '.join(sorted(ADAPTERS))})"
