"""Where a (re)starting node takes its stage's state from, and when it writes a checkpoint (pure decisions)."""

from __future__ import annotations

from pathlib import Path

from protolearn.node.checkpoint import CheckpointInfo
from protolearn.node.persistence import checkpoint_due, plan_restore


def info(step: int, state_hash: str = "h5", stage: int = 1) -> CheckpointInfo:
    return CheckpointInfo(path=Path(f"stage-{stage}-step-{step}.safetensors"), stage=stage, step=step, num_stages=2,
                          run_hash="r", state_hash=state_hash, state_digest="d", run_toml="")


def test_a_restarted_replica_whose_stage_has_not_moved_downloads_nothing() -> None:
    # The replicas report step 4 applied (applied = 5) with the hash the node's own checkpoint of step 5 has.
    plan = plan_restore(1, 5, num_donors=2, candidate=info(5, "h5"), reported=[("a", 4, "h5"), ("b", 4, "h5")])
    assert (plan.source, plan.applied, plan.checkpoint) == ("local", 5, info(5, "h5"))
    # A replica still applying step 4 (its reports end at step 3) does not make the node download.
    lagging = plan_restore(1, 5, num_donors=2, candidate=info(5, "h5"), reported=[("a", 3, "h3"), ("a", 4, "h5"), ("b", 3, "h3")])
    assert lagging.source == "local"


def test_one_lying_replica_does_not_make_a_restarted_replica_download() -> None:
    """Costs go to their cause: one replica's report, of another hash or of a later step, is outvoted."""
    honest = [("a", 4, "h5"), ("b", 4, "h5")]
    for liar in [("z", 4, "hX"), ("z", 5, "hY")]:
        plan = plan_restore(1, 5, num_donors=3, candidate=info(5, "h5"), reported=honest + [liar])
        assert plan.source == "local", (liar, plan.reason)
    # Where the liars are the majority they decide, as everywhere a stage's majority does.
    assert plan_restore(1, 5, num_donors=3, candidate=info(5, "h5"), reported=[("a", 4, "h5"), ("y", 4, "hX"), ("z", 4, "hX")]).source == "donor"


def test_a_restarted_replica_whose_stage_moved_syncs_from_a_replica() -> None:
    moved = plan_restore(1, 7, num_donors=1, candidate=info(5), reported=[("a", 6, "h7")])
    assert moved.source == "donor" and "moved from step 5 to 7" in moved.reason
    other = plan_restore(1, 5, num_donors=1, candidate=info(5, "h5"), reported=[("a", 4, "hX")])
    assert other.source == "donor" and "other parameters" in other.reason
    assert plan_restore(1, 5, num_donors=1, candidate=None, reported=[]).source == "donor"


def test_an_emptied_stage_restores_its_checkpoint_at_the_coordinators_step() -> None:
    exact = plan_restore(1, 6, num_donors=0, candidate=info(6), reported=[])
    assert (exact.source, exact.applied) == ("checkpoint", 6)
    behind = plan_restore(1, 9, num_donors=0, candidate=info(6), reported=[])
    assert (behind.source, behind.applied) == ("checkpoint", 9)
    assert "updates of steps 6..8 are lost" in behind.reason
    # Every live replica failed to hand over its state: the checkpoint is the fallback.
    failed = plan_restore(1, 6, num_donors=2, candidate=info(6), reported=[("a", 5, "h")], donor_error="2 replicas tried")
    assert failed.source == "checkpoint" and "syncing from its replicas failed" in failed.reason


def test_an_emptied_stage_without_a_checkpoint_is_lost_past_step_0() -> None:
    assert plan_restore(1, 0, num_donors=0, candidate=None, reported=[]).source == "init"
    lost = plan_restore(1, 3, num_donors=0, candidate=None, reported=[])
    assert lost.source == "lost" and "--checkpoint stage-1-step-<t>.safetensors" in lost.reason


def test_checkpoints_are_due_every_n_steps_and_at_the_last() -> None:
    assert [a for a in range(13) if checkpoint_due(a, 5, 12)] == [5, 10, 12]
    assert [a for a in range(13) if checkpoint_due(a, 0, 12)] == [12]
    # DiLoCo checkpoints the state after its outer syncs (every H = 4 steps): those in whose span a multiple of 5 falls.
    assert [a for a in range(4, 41, 4) if checkpoint_due(a, 5, 40, span=4)] == [8, 12, 16, 20, 28, 32, 36, 40]
