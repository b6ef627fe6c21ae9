"""The coordinator's sans-IO cores stay free of trio and libp2p, so the simulator can drive them."""

from __future__ import annotations

import json
import subprocess
import sys

CORES = [
    "protolearn.protocol.coordination",
    "protolearn.coordinator.assignment",
    "protolearn.coordinator.tickets",
    "protolearn.coordinator.registry",
    "protolearn.coordinator.verdicts",
    "protolearn.coordinator.ratelimit",
    "protolearn.coordinator.core",
    "protolearn.coordinator.status",
    "protolearn.coordinator.store",
]

_PROBE = r"""
import importlib, json, sys
for name in sys.argv[1:]:
    importlib.import_module(name)
print(json.dumps([m for m in ("trio", "libp2p") if m in sys.modules]))
"""


def test_coordinator_cores_import_neither_trio_nor_libp2p() -> None:
    out = subprocess.run([sys.executable, "-c", _PROBE, *CORES], capture_output=True, text=True, timeout=120, check=False)
    assert out.returncode == 0, out.stderr[-2000:]
    assert json.loads(out.stdout) == [], f"a coordinator core pulls in {out.stdout.strip()}"
