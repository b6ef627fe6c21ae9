"""A step that commits while no live replica of a stage holds its result must not wedge the swarm.

The wedge (seen with a node that took the coordinator's identity, reproducible with honest nodes): a
replica that is still fetching a step's result drops off the coordinator's radar for a moment (its
connection closed), so the stage's other replica commits the step alone, applies it and dies. The
survivor's state is one step behind the committed frontier and nobody can finish that step any more:
the redo is refused (``step_committed``), the result is nowhere, and a resync finds no donor (or an
identical donor one step behind). Before the fix it resynced forever, or quit with "no live replica
and no checkpoint", and every other stage waited with it. Now it counts the step lost for its stage and
trains on; every step after it commits.
"""

from __future__ import annotations

from pathlib import Path

from protolearn.node.core import closed_step as nc
from protolearn.node.core import events as ev
from tests.unit.node_sim import Sim, SimNode


def _lose_the_holder(sim: Sim) -> dict[str, object]:
    """Add a replica ``y`` to stage 0; while it fetches a step's result it hangs and its connection drops,
    the step commits without it, and the replica that applied it dies. Returns what happened."""
    seen: dict[str, object] = {}
    carry = sim._carry

    def add() -> None:
        seen["y"] = sim.add_node("y")

    def carrying(node: SimNode, a: ev.Action) -> None:
        if isinstance(a, ev.Fetch) and node.peer == "y" and "step" not in seen:
            seen["step"] = a.step
            sim.coord.connection_changed("y", False, sim.now)
            sim.hang(node, 1.5)
        if isinstance(a, ev.Apply) and node.stage == 0 and node.peer != "y" and seen.get("step") == a.step and "killed" not in seen:
            carry(node, a)
            seen["killed"] = node.peer
            sim.kill(node)
            sim.coord.connection_changed("y", True, sim.now)
            return
        carry(node, a)

    sim._carry = carrying  # type: ignore[method-assign]
    sim.at(1.0, add)
    return seen


def test_a_step_committed_without_any_surviving_holder_is_lost_for_its_stage_and_training_goes_on(tmp_path: Path) -> None:
    sim = Sim(1, tmp_path, stages=2, replicas=1, tickets=4, steps=6)
    seen = _lose_the_holder(sim)
    sim.run_until_done(200)
    y = seen["y"]
    assert isinstance(y, SimNode) and y.stage == 0 and seen.get("killed") == "n0", seen
    lost = seen["step"]
    assert sim.finished(), f"wedged: applied {[(n.peer, n.core.applied, n.alive) for n in sim.nodes.values()]}"
    # Every step after the lost one committed and was applied by both stages (the coordinator's frontier).
    assert sim.coord.ledger.committed_through == sim.steps - 1
    full = tuple(range(sim.B))
    assert [t for t, p in enumerate(y.params) if p != full] == [lost], y.params
    assert y.decisions[(lost, 1)] == "skip" and any("step_lost" in e for e in y.events)
    assert all(p == full for p in sim.nodes["n1"].params) and len(sim.nodes["n1"].params) == sim.steps


def _committed_without_me(core: nc.NodeCore) -> list[ev.Action]:
    """A participant that restarted after step 0 closed (it holds none of its tickets) asks to redo them;
    the step committed meanwhile: the coordinator refuses with ``step_committed``."""
    (ask,) = [a for a in core.handle(ev.Closed(0, 1, {"me": [0, 1], "mate": [2, 3]}, 2.5, held=[]), 0.0) if isinstance(a, ev.AskReported)]
    (redo,) = [a for a in core.handle(ev.Reported(0, applied_elsewhere=False), 0.1) if isinstance(a, ev.Redo)]
    assert redo.tickets == [0, 1]
    return core.handle(ev.RedoAnswer(0, 1, granted=False, reason="step 0 cannot reopen", code="step_committed"), 0.2)


def _core() -> nc.NodeCore:
    core = nc.NodeCore("me", 0, nc.CoreConfig(microbatches_per_step=4, max_in_flight=4, max_deferred=4, averaging_timeout_s=10.0))
    core.handle(ev.Synced(0), 0.0)
    return core


def test_a_step_committed_without_this_replica_is_synced_from_a_replica_that_holds_it() -> None:
    core = _core()
    (ask,) = _committed_without_me(core)
    assert isinstance(ask, ev.AskReported) and ask.step == 0
    actions = core.handle(ev.Reported(0, applied_elsewhere=True), 0.3)
    assert [type(a) for a in actions] == [ev.Emit, ev.Resync] and core.applied == 0


def test_with_no_holder_left_after_a_few_asks_the_step_is_skipped_not_resynced_forever() -> None:
    core = _core()
    (ask,) = _committed_without_me(core)
    delays = [ask.delay_s]
    for k in range(nc.HOLDER_CHECKS - 1):
        (ask,) = core.handle(ev.Reported(0, applied_elsewhere=False), 1.0 + k)
        assert isinstance(ask, ev.AskReported)
        delays.append(ask.delay_s)
    assert delays == [0.0] + [nc.HOLDER_CHECK_S] * (nc.HOLDER_CHECKS - 1)
    emit, skip = core.handle(ev.Reported(0, applied_elsewhere=False), 9.0)
    assert isinstance(emit, ev.Emit) and emit.event == "step_lost" and emit.level >= 40
    assert isinstance(skip, ev.Skip) and skip.step == 0
    assert core.handle(ev.Applied(0, "unchanged"), 9.1) == []
    assert core.applied == 1 and core.next_round == nc.round_id(1)
