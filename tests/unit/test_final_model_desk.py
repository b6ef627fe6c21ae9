"""The final-model desk of the coordinator core: when the run is half done (the adapter then loads what its fetch
needs), finished, and what members are told while the coordinator fetches the model."""

from __future__ import annotations

from protolearn.coordinator.config import CoordinatorSettings
from tests.support.coordinator import make_core, run_info


def test_half_done_and_finished_follow_the_committed_steps_and_members_stay_while_it_collects() -> None:
    core = make_core(run_info(steps=10), CoordinatorSettings(keep_final=True))
    desk = core.final_model
    seen = []
    for committed in range(-1, 10):
        core.ledger.barrier.committed_through = committed
        seen.append((committed, desk.half_done, desk.finished, desk.phase()))
    assert [c for c, half, _, _ in seen if half] == list(range(4, 10))  # steps 0-4 committed: half of 10
    assert [c for c, _, done, _ in seen if done] == [9]
    assert [phase for *_, phase in seen] == [""] * 10 + ["collecting"]
    desk.saved(9)
    assert desk.phase() == "saved" and desk.held_step == 9


def test_a_run_without_a_step_count_is_never_half_done_nor_finished() -> None:
    core = make_core(run_info(steps=0), CoordinatorSettings(keep_final=True))
    core.ledger.barrier.committed_through = 50
    assert not core.final_model.half_done and not core.final_model.finished and core.final_model.phase() == ""
