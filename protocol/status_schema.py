"""The swarm status a coordinator serves (:class:`~protolearn.protocol.coordination.StatusRequest` →
:class:`Status`): the run, each stage, each node, the loss history and the bans.

This is the schema only; ``coordinator/core/status.py`` builds it from the coordinator's state (bounded in
size at any swarm size) and documents its JSON form, which is what ``swarm status --json`` prints
(``status.model_dump(mode="json")``). Its records reuse the coordination messages' field types, so a
state or a reachability verdict reads the same in a heartbeat and in the status.
"""

from __future__ import annotations

from typing import ClassVar, Literal

from pydantic import Field

from protolearn.protocol.coordination import NodePath, ParamHash, Reachability, State
from protolearn.protocol.wire import Message, Record


class RunView(Record):
    name: str
    run_hash: str
    num_stages: int
    microbatches_per_step: int
    tokens_per_step: int
    # The run's optimizer steps (schema 4; 0: not said).
    steps: int = 0
    # How replicas stay in step (schema 5): "step" (every step) or "diloco" (an outer sync every inner_steps).
    sync: Literal["step", "diloco"] = "step"
    inner_steps: int = 0


class LeftOut(Record):
    peer_id: str
    reason: str


class OuterView(Record):
    """A DiLoCo stage's last outer round (schema 5): round ``round`` (attempt ``attempt``) after inner step
    ``step``, decided at ``decided_at`` with ``quorum``; who contributed, who followed, who was left out."""

    round: int
    attempt: int
    step: int
    decided_at: float
    quorum: int
    participants: list[str]
    followers: list[str]
    left_out: list[LeftOut]


class StageView(Record):
    index: int
    layers: int
    replicas: int
    throughput: float
    # Hashes of the stage's parameters after the last step each replica applied.
    param_step: int
    param_hashes: list[ParamHash]
    hashes_agree: bool
    # DiLoCo (schema 5): the stage's last outer round (None: none yet, or not in DiLoCo mode).
    outer: OuterView | None = None


class NodeView(Record):
    peer_id: str
    # The name it joined with (``--name``, schema 4; "": none given).
    name: str = ""
    stage: int
    state: State
    last_seen_s: float
    throughput: float
    queue_len: int
    step: int
    loss: float | None
    flags: list[str]
    # Integrity (schema 2): the median monitor score its checkers report (None: nobody checks it yet),
    # their majority probation state ("" when none), spot checks passed and failed, evidence against it.
    integrity: float | None = None
    probation: str = ""
    checks_passed: int = 0
    checks_failed: int = 0
    evidence: int = 0
    # NAT (schema 3): the coordinator's reachability verdict, and how its stage peers reach it ("": not said yet).
    reachability: Reachability = "unknown"
    path: NodePath = ""
    # DiLoCo (schema 5): the last inner step it applied (-1: not said); ``step`` is then its last outer sync's.
    inner_step: int = -1


class LossPoint(Record):
    step: int
    loss: float
    tickets: int
    closed_at: float


class BanView(Record):
    peer_id: str
    reason: str
    at: float


class Status(Message):
    """The swarm view. Its JSON form (``model_dump(mode="json")``) is the documented ``--json`` schema."""

    KIND: ClassVar[str] = "coord.status"
    schema_version: int
    coordinator: str
    uptime_s: float
    run: RunView
    step: int
    last_closed: int
    last_committed: int = -1
    healthy: bool
    verdict: Literal["healthy", "degraded", "halted", "finished"]
    verdict_reason: str
    # Schema 4: stages one failure away from halting (a single live replica), healthy or not.
    at_risk: list[int] = Field(default_factory=list)
    # Seconds until the run's last step at the recent pace (None: not training, or finished).
    eta_s: float | None = None
    # The step of the finished run's model the coordinator holds (-1: none; `swarm export` fetches it).
    final_step: int = -1
    tokens_per_s: float
    loss: float | None
    loss_history: list[LossPoint]
    stages: list[StageView]
    nodes: list[NodeView]
    bans: list[BanView]


StageView.model_rebuild()
