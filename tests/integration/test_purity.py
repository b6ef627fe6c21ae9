"""Dependencies point one way (STYLE.md): the pure cores load no event loop, no network stack and no
torch where they must not, and the commands that carry no tensors start without torch.

One probe, one fresh interpreter per case (this test process has long imported all of them). Packages
are walked with pkgutil, so a module added later is checked without editing this test; adapter modules
are skipped before they are imported (walking would import an adapter subpackage to look inside it).
The report blames the first module after whose import a forbidden one shows up. Each case names
modules the walk must find, so an empty walk cannot pass, and where it can, a *witness* module that
does load the forbidden ones, to show the probe sees them.
"""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import dataclass

import pytest

_PROBE = r"""
import importlib, json, pkgutil, sys
spec = json.loads(sys.argv[1])

def exempt(name):
    return any(name == a or name.startswith(a + ".") for a in spec["exempt"])

def walk(pkg_name):
    for info in pkgutil.iter_modules(importlib.import_module(pkg_name).__path__, pkg_name + "."):
        if not exempt(info.name):
            yield info.name
            if info.ispkg:
                yield from walk(info.name)

def names():
    # lazy, so a package is imported (and blamed) in the loop below before walk() looks inside it
    for p in spec["packages"]:
        yield p
        yield from walk(p)
    yield from spec["modules"]

report, seen = {}, set()
for name in names():
    importlib.import_module(name)
    pulled = [f for f in spec["forbidden"] if f in sys.modules and f not in seen]
    seen.update(pulled)
    report[name] = pulled
witness = None
if spec["witness"]:
    importlib.import_module(spec["witness"])
    witness = [f for f in spec["forbidden"] if f in sys.modules]
print(json.dumps({"report": report, "witness": witness}))
"""


@dataclass(frozen=True)
class Pure:
    """``packages`` (walked) and ``modules`` must not load any of ``forbidden``."""

    packages: tuple[str, ...] = ()
    modules: tuple[str, ...] = ()
    forbidden: tuple[str, ...] = ("trio", "libp2p")
    exempt: tuple[str, ...] = ()  # adapter packages inside a walked package
    must_find: tuple[str, ...] = ()
    witness: str | None = None  # a module that does load every forbidden one
    why: str = ""


CASES = {
    # The wire, the stages and the node's decision cores, and the modules of protolearn.node that only
    # read and write files (checkpoints, model export), with the one adapter that binds them to libp2p.
    "protocol-stages-node-cores": Pure(
        packages=("protolearn.protocol", "protolearn.stages", "protolearn.node.core"),
        modules=("protolearn.codec_spec", "protolearn.sync_spec", "protolearn.node.checkpoint", "protolearn.node.export", "protolearn.node.hf_export",
                 "protolearn.data_dir_lock", "protolearn.precision", "protolearn.node.memory"),
        exempt=("protolearn.protocol.transport",),
        must_find=("protolearn.protocol.wire", "protolearn.protocol.tensors", "protolearn.protocol.codecs", "protolearn.protocol.identity",
                   "protolearn.stages.model", "protolearn.stages.reference", "protolearn.node.core.closed_step", "protolearn.node.core.leasing",
                   "protolearn.stages.outer", "protolearn.protocol.sync_compression.powersgd", "protolearn.protocol.sync_compression.wire"),
        witness="protolearn.protocol.transport",
        why="move that code into the adapter (protolearn.protocol.transport)",
    ),
    # The node simulator drives these with no sockets and no tensors.
    "node-cores-no-socket-or-torch": Pure(
        packages=("protolearn.node.core",), forbidden=("trio", "libp2p", "socket", "torch"),
        must_find=("protolearn.node.core.closed_step", "protolearn.node.core.events", "protolearn.node.core.leasing",
                   "protolearn.node.core.accounting", "protolearn.node.core.inner_step", "protolearn.node.core.outer_round"),
        why="the node's decision cores take plain values; keep IO and tensors in the node's adapters",
    ),
    # The coordinator's cores, and the pure modules they build on. The SQLite store is an IO adapter (it
    # writes files) outside the core package; it loads no event loop all the same, because the node-core
    # simulator persists the core through it.
    "coordinator-cores": Pure(
        packages=("protolearn.coordinator.core",),
        modules=("protolearn.protocol.coordination", "protolearn.protocol.acks", "protolearn.coordinator.config",
                 "protolearn.coordinator.errors", "protolearn.coordinator.store"),
        must_find=("protolearn.coordinator.core.dispatch", "protolearn.coordinator.core.outer_rounds", "protolearn.coordinator.core.outer_desk"),
        why="the coordinator's cores must run in the simulator; keep IO in coordinator/service.py",
    ),
    # The coordinator checks a reducer's proof without torch.
    "reducer-check-no-torch": Pure(
        modules=("protolearn.protocol.reducer_check",), forbidden=("torch",), witness="protolearn.protocol.tensors",
        why="the evidence message must decode without torch",
    ),
    # What `coordinator start` and `swarm status` load: the coordinator carries no tensors, and importing
    # torch made each command take seconds longer to start.
    "commands-without-torch": Pure(
        modules=("protolearn.cli.main", "protolearn.cli.coordinator", "protolearn.cli.swarm", "protolearn.coordinator.service",
                 "protolearn.node.coordinator_link", "protolearn.protocol.transport", "protolearn.protocol.frames",
                 "protolearn.stages.config", "protolearn.sync_spec"),
        forbidden=("torch",), witness="protolearn.protocol.tensors",
        why="import tensor support lazily (see protocol/frames.py)",
    ),
    # Every command's module, as `protolearn --help` and a config mistake load them: loading libp2p and torch
    # there made `--help` take 2.5 s and a bad `train-local --config` 6.6 s to say so (now under 1 s).
    "cli-without-network-or-torch": Pure(
        modules=("protolearn.cli.main", "protolearn.cli.local", "protolearn.cli.node", "protolearn.cli.demo", "protolearn.cli.links",
                 "protolearn.cli.coordinator", "protolearn.cli.swarm", "protolearn.cli.model", "protolearn.cli.generate",
                 "protolearn.stages.config"),
        forbidden=("libp2p", "torch"), witness="protolearn.node.lifecycle",
        why="import it inside the command that runs (see protolearn/cli/links.py)",
    ),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_pure_modules_do_not_load_what_they_must_not(case: str) -> None:
    pure = CASES[case]
    spec = {"packages": pure.packages, "modules": pure.modules, "forbidden": pure.forbidden, "exempt": pure.exempt,
            "witness": pure.witness}
    out = subprocess.run([sys.executable, "-c", _PROBE, json.dumps(spec)], capture_output=True, text=True, timeout=120, check=False)
    assert out.returncode == 0, out.stderr[-2000:]
    result = json.loads(out.stdout)
    report: dict[str, list[str]] = result["report"]
    assert {*pure.must_find, *pure.modules} <= set(report), sorted(report)  # the walk really found them
    offenders = {name: pulled for name, pulled in report.items() if pulled}
    assert not offenders, f"{case}: {offenders}; {pure.why}"
    if pure.witness is not None:
        assert result["witness"] == list(pure.forbidden), result["witness"]
