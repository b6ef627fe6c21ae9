"""What a node reads from the coordinator's view (node/membership.py) and its I2 check of its stage's
replicas' hashes (node/replica_hashes.py)."""

from __future__ import annotations

import trio
from protolearn.node.membership import Membership
from protolearn.node.replica_hashes import KEEP_STEPS, ReplicaHashes
from protolearn.protocol import coordination as cm
from protolearn.protocol.states import NodeState


def member(peer: str, stage: int, state: NodeState = NodeState.TRAINING) -> cm.MemberView:
    return cm.MemberView(peer_id=peer, stage=stage, addrs=[], state=state, throughput=0.0, queue_len=0)


VIEW = Membership(3, [member("b1", 1), member("a0", 0), member("c2", 2), member("d1", 1), member("e1", 1, NodeState.LEAVING)])


def test_the_neighbours_are_the_live_replicas_of_the_adjacent_stages() -> None:
    assert VIEW.stage_peers(1) == ["b1", "d1"] and VIEW.stage_peers(1, live=False) == ["b1", "d1", "e1"]
    assert VIEW.neighbours(1) == ["a0", "c2"] and VIEW.neighbours(0) == ["b1", "d1"] and VIEW.neighbours(2) == ["b1", "d1"]
    assert VIEW.stage_of("c2") == 2 and VIEW.stage_of("zz") is None
    assert VIEW.live() == {"a0", "b1", "c2", "d1"}


def test_a_departure_breaks_only_the_routes_through_it() -> None:
    """Issue 28: a stage-0 replica's death made the other stage-0 replica restart all its in-flight tickets,
    so stage 1 computed that step's microbatches twice. Stage-1 departures restart the tickets sent to them,
    later or unknown stages' restart everything, another stage-0 replica's restart nothing."""
    assert VIEW.broken_routes({"a0"}) == ([], False)
    assert VIEW.broken_routes({"d1", "b1"}) == (["b1", "d1"], False)
    assert VIEW.broken_routes({"c2"}) == ([], True)
    assert VIEW.broken_routes({"zz", "a0"}) == ([], True)  # a view delta's removal of a peer this view never held


def test_training_waits_for_the_other_stages_with_no_replica() -> None:
    view = Membership(1, [member("a0", 0), member("c3", 3)])
    assert view.empty_stages(4, []) == [1, 2]
    assert view.waiting_for(0, 4, []) == "stages 1, 2 have no replicas"
    assert view.waiting_for(1, 4, []) == "stage 2 has no replicas"  # its own stage is this node
    # A delta view holds only the neighbourhood: the coordinator's per-stage counts say more.
    assert view.waiting_for(0, 4, [1, 1, 1, 1]) == "" and view.empty_stages(4, [1, 0, 1, 1]) == [1]


class _Link:
    def __init__(self, reported: list[cm.ParamHash]) -> None:
        self.reported = reported
        self.asked = 0

    async def stage_hashes(self, stage: int) -> list[cm.ParamHash]:
        self.asked += 1
        return self.reported


class _Progress:
    def __init__(self) -> None:
        self.events: list[tuple[str, dict]] = []
        self.said: list[str] = []

    def event(self, event: str, **fields: object) -> None:
        self.events.append((event, fields))

    def say(self, line: str) -> None:
        self.said.append(line)


def test_a_replica_whose_hash_differs_after_a_step_is_reported_once() -> None:
    applied = [3]
    link = _Link([cm.ParamHash(peer_id="me", step=2, hash="x"), cm.ParamHash(peer_id="p", step=1, hash="h1"),
                  cm.ParamHash(peer_id="q", step=2, hash="bad")])
    progress = _Progress()
    hashes = ReplicaHashes(link, progress, "me", applied=lambda: applied[0])  # type: ignore[arg-type]
    for step, h in ((0, "h0"), (1, "h1"), (2, "h2")):
        hashes.record(step, h)
    assert hashes.latest(3) == "h2" and [r.step for r in hashes.recent(3)] == [0, 1, 2] and hashes.latest(9) == ""

    async def main() -> None:
        await hashes.check(1)
        await hashes.check(1)  # steps 1 and 2 were checked: only step 0 is still pending

    trio.run(main)
    assert [e for e, _ in progress.events] == ["replica_mismatch"]
    assert progress.events[0][1] == {"step": 2, "peer": "q", "theirs": "bad", "mine": "h2"}
    assert link.asked == 2 and len(progress.said) == 1
    # The bookkeeping keeps the last KEEP_STEPS steps behind the applied one.
    applied[0] = KEEP_STEPS + 2
    trio.run(hashes.check, 1)
    assert [r.step for r in hashes.recent(applied[0])] == [2]
