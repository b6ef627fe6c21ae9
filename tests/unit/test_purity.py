"""The pure core stays pure: no module of protolearn.protocol (but the libp2p adapter), of
protolearn.stages, of the node's decision cores (protolearn.node.core), nor the codec grammar they share,
nor the stage checkpoint and model export modules of protolearn.node may pull in trio or libp2p (STYLE.md,
"Dependencies point one way").

Packages are walked with pkgutil, so a module added later is checked without editing this test;
adapter modules are skipped before they are imported (pkgutil.walk_packages would import an adapter
subpackage to look inside it). Everything runs in one fresh interpreter, since this test process has
long imported trio and libp2p, and the report blames the first module after whose import trio or
libp2p shows up. The adapter is imported last, to show the probe does see trio/libp2p when they load.
"""

from __future__ import annotations

import json
import subprocess
import sys

# protolearn.node.core is the node's package of decision cores: every module in it is checked.
PURE_PACKAGES = ("protolearn.protocol", "protolearn.stages", "protolearn.node.core")
PURE_MODULES = ("protolearn.codec_spec", "protolearn.node.checkpoint", "protolearn.node.export")
# Module name prefixes of the adapter that binds the wire protocol to libp2p streams.
ADAPTERS = ("protolearn.protocol.transport",)  # the one adapter package, with its submodules
FORBIDDEN = ("trio", "libp2p")

_PROBE = r"""
import importlib, json, pkgutil, sys
packages, modules, adapters, forbidden = (a.split(",") for a in sys.argv[1:5])

def exempt(name):
    return any(name == a or name.startswith(a + ".") for a in adapters)

def walk(pkg_name):
    for info in pkgutil.iter_modules(importlib.import_module(pkg_name).__path__, pkg_name + "."):
        if not exempt(info.name):
            yield info.name
            if info.ispkg:
                yield from walk(info.name)

def names():
    # lazy, so a package is imported (and blamed) in the loop below before walk() looks inside it
    for p in packages:
        yield from walk(p)
    yield from modules

report, seen = {}, set()
for name in names():
    importlib.import_module(name)
    pulled = [f for f in forbidden if f in sys.modules and f not in seen]
    seen.update(pulled)
    report[name] = pulled
importlib.import_module(adapters[0])
print(json.dumps({"report": report, "adapter_pulls": [f for f in forbidden if f in sys.modules]}))
"""


def test_pure_modules_import_neither_trio_nor_libp2p() -> None:
    args = [",".join(PURE_PACKAGES), ",".join(PURE_MODULES), ",".join(ADAPTERS), ",".join(FORBIDDEN)]
    out = subprocess.run([sys.executable, "-c", _PROBE, *args], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    result = json.loads(out.stdout)
    report: dict[str, list[str]] = result["report"]
    # discovery really found the pure modules, so an empty report cannot pass by accident
    expected = {"protolearn.protocol.wire", "protolearn.protocol.tensors", "protolearn.protocol.codecs",
                "protolearn.protocol.identity", "protolearn.stages.model", "protolearn.stages.reference",
                "protolearn.node.core.closed_step", "protolearn.node.core.leasing", *PURE_MODULES}
    assert expected <= set(report)
    offenders = {name: pulled for name, pulled in report.items() if pulled}
    assert not offenders, f"pure modules pull in {offenders}; move that code into the adapter ({', '.join(ADAPTERS)})"
    # the probe does see trio/libp2p once the adapter loads them
    assert result["adapter_pulls"] == list(FORBIDDEN)
