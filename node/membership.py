"""The membership as the coordinator last described it, and what this node reads from it.

Every heartbeat answer may carry a newer view (the whole membership, or a delta holding this node's
neighbourhood); :class:`Membership` keeps the last one and answers the node's questions about it: who
serves a stage, which members are this stage's neighbours (the live replicas of the adjacent stages,
which it exchanges tensors with), which stages have no replica left (training halts until one joins),
and whether a newer view lost a member (a departure breaks the routes through it).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from protolearn.protocol import coordination as cm


@dataclass
class Membership:
    """One view of the membership (``version`` -1: none yet)."""

    version: int = -1
    members: list[cm.MemberView] = field(default_factory=list)

    def stage_peers(self, stage: int, *, live: bool = True) -> list[str]:
        """The members serving ``stage`` (only the live ones unless ``live`` is False), sorted."""
        return sorted(m.peer_id for m in self.members if m.stage == stage and (not live or m.state.live))

    def neighbours(self, stage: int) -> list[str]:
        """The live replicas of the stages before and after ``stage``: the peers it exchanges tensors with."""
        return self.stage_peers(stage - 1) + self.stage_peers(stage + 1)

    def stage_of(self, peer: str) -> int | None:
        return next((m.stage for m in self.members if m.peer_id == peer), None)

    def live(self) -> set[str]:
        return {m.peer_id for m in self.members if m.state.live}

    def broken_routes(self, gone: set[str]) -> tuple[list[str], bool]:
        """Which of stage 0's in-flight tickets the departure of ``gone`` (members of this view, or of stages it
        cannot tell) breaks: (the stage-1 peers whose tickets restart, whether every ticket restarts). A
        later or unknown stage's departure breaks every route (stage 0 does not know which went through
        it); a stage-0 replica's breaks none of another stage-0 replica's routes."""
        stages = {p: self.stage_of(p) for p in gone}
        return sorted(p for p, st in stages.items() if st == 1), any(st is None or st > 1 for st in stages.values())

    def empty_stages(self, num_stages: int, replicas: list[int]) -> list[int]:
        """Stages with no live replica (training halts until one joins): the coordinator's per-stage
        counts when it sent them (a delta view holds only this node's neighbourhood), else the view's."""
        if len(replicas) == num_stages:
            return [s for s, n in enumerate(replicas) if n == 0]
        live = {m.stage for m in self.members if m.state.live}
        return [s for s in range(num_stages) if s not in live]

    def waiting_for(self, stage: int, num_stages: int, replicas: list[int]) -> str:
        """What training of ``stage`` waits for, in words ("" when nothing): the other stages with no replica."""
        empty = [s for s in self.empty_stages(num_stages, replicas) if s != stage]
        if not empty:
            return ""
        which = ", ".join(str(s) for s in empty)
        return f"stage{'s' if len(empty) > 1 else ''} {which} ha{'ve' if len(empty) > 1 else 's'} no replicas"
