"""Every protocol the swarm speaks has one name, defined in one protocol module, and only the transport
turns names into ``/protolearn/<name>/<version>`` IDs (a second spelling of an ID once went unused while
the real one lived elsewhere)."""

from __future__ import annotations

import ast
import re
from pathlib import Path

from protolearn.protocol import collective, coordination, pipeline
from protolearn.protocol.transport import protocol_id

ROOT = Path(__file__).resolve().parents[2]
NAMES = {
    "pipeline.ACTIVATION": pipeline.ACTIVATION,
    "pipeline.GRADIENT": pipeline.GRADIENT,
    "pipeline.COLLECTIVE": pipeline.COLLECTIVE,
    "pipeline.STATE": pipeline.STATE,
    "coordination.COORDINATOR": coordination.COORDINATOR,
}
_FULL_ID = re.compile(r"^/protolearn/[^/\s]+/\d+\.\d+\.\d+$")


def test_protocol_names_are_distinct_and_make_versioned_ids() -> None:
    assert len(set(NAMES.values())) == len(NAMES), NAMES
    for name in NAMES.values():
        assert _FULL_ID.match(protocol_id(name)), protocol_id(name)
    assert not hasattr(collective, "PROTOCOL_ID")


def test_no_module_but_the_transport_spells_out_a_protocol_id_or_redefines_a_name() -> None:
    spelled: list[str] = []
    for package in ("protocol", "node", "coordinator", "stages", "protolearn"):
        for path in (ROOT / package).rglob("*.py"):
            rel = path.relative_to(ROOT).as_posix()
            if rel.startswith("protocol/transport/"):
                continue
            for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
                if isinstance(node, ast.Constant) and isinstance(node.value, str) and _FULL_ID.match(node.value):
                    spelled.append(f"{rel}:{node.lineno} {node.value}")
                # a module-level NAME = "coordinator" next to the real one
                if (
                    isinstance(node, ast.Assign)
                    and isinstance(node.value, ast.Constant)
                    and node.value.value in NAMES.values()
                    and rel not in ("protocol/pipeline.py", "protocol/coordination.py")
                    and any(isinstance(t, ast.Name) and t.id.isupper() for t in node.targets)
                ):
                    spelled.append(f"{rel}:{node.lineno} {ast.unparse(node)}")
    assert not spelled, f"import the protocol names from protocol/pipeline.py or protocol/coordination.py: {spelled}"
