"""The coordinator's sans-IO cores stay free of trio and libp2p, so the simulator can drive them."""

from __future__ import annotations

import json
import subprocess
import sys

# Every module of these packages is a core (walked, so a new core is covered without editing this list).
CORE_PACKAGES = ["protolearn.coordinator.core"]
# Pure modules outside the core package that the cores build on.
ALSO_PURE = [
    "protolearn.protocol.coordination",
    "protolearn.protocol.acks",
    "protolearn.coordinator.config",
    "protolearn.coordinator.errors",
    # The SQLite store is an IO adapter (it writes files), so it lives outside the core package; it loads
    # no event loop all the same, because the node-core simulator persists the core through it.
    "protolearn.coordinator.store",
]

_PROBE = r"""
import importlib, json, pkgutil, sys
seen = []
for name in sys.argv[1:]:
    module = importlib.import_module(name)
    seen.append(name)
    for info in pkgutil.walk_packages(getattr(module, "__path__", []), name + "."):
        importlib.import_module(info.name)
        seen.append(info.name)
print(json.dumps({"modules": seen, "loaded": [m for m in ("trio", "libp2p") if m in sys.modules]}))
"""


def test_coordinator_cores_import_neither_trio_nor_libp2p() -> None:
    out = subprocess.run(
        [sys.executable, "-c", _PROBE, *CORE_PACKAGES, *ALSO_PURE], capture_output=True, text=True, timeout=120, check=False
    )
    assert out.returncode == 0, out.stderr[-2000:]
    result = json.loads(out.stdout)
    assert "protolearn.coordinator.core.dispatch" in result["modules"], result["modules"]  # the walk found the cores
    assert result["loaded"] == [], f"a coordinator core pulls in {result['loaded']}"


# What `coordinator start` and `swarm status` load. The coordinator carries no tensors, and importing
# torch made each command take seconds longer to start.
COMMAND_PATHS = [
    "protolearn.cli.main",
    "protolearn.cli.coordinator",
    "protolearn.cli.swarm",
    "protolearn.coordinator.service",
    "protolearn.node.coordinator_link",
    "protolearn.protocol.transport",
    "protolearn.protocol.frames",
    "protolearn.stages.config",
]

_TORCH_PROBE = r"""
import importlib, json, sys
blame = {}
for name in sys.argv[1:]:
    importlib.import_module(name)
    if "torch" in sys.modules and not blame:
        blame = {"first": name}
import protolearn.protocol.tensors  # the torch side does load torch, so the probe can see it
print(json.dumps({**blame, "seen_after_tensors": "torch" in sys.modules}))
"""


def test_coordinator_and_status_commands_do_not_import_torch() -> None:
    out = subprocess.run([sys.executable, "-c", _TORCH_PROBE, *COMMAND_PATHS], capture_output=True, text=True, timeout=120, check=False)
    assert out.returncode == 0, out.stderr[-2000:]
    result = json.loads(out.stdout)
    assert "first" not in result, f"{result['first']} imports torch; import tensor support lazily (see protocol/frames.py)"
    assert result["seen_after_tensors"]
