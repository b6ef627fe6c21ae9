"""Round ids of the stage collective: one owner for how (step, revision) maps to a round.

Revision r of step t averages in round ``t * REVISIONS_PER_STEP + r - 1``. The coordinator's
``max_revisions`` setting is validated against :data:`REVISIONS_PER_STEP`, so a reopened step never
lands in the next step's round ids.
"""

from __future__ import annotations

# Round ids per step. The coordinator caps revisions far below this (its max_revisions, 32 by default).
REVISIONS_PER_STEP = 1 << 12
# DiLoCo: attempts of one outer round whose collective failed, before its replicas give up on it. An outer
# round after step b uses b's round ids (attempt a is revision a), which no inner step uses in that mode.
MAX_OUTER_ATTEMPTS = 64


def round_id(step: int, revision: int = 1) -> int:
    """The collective round of ``step``'s accounting at ``revision`` (a reopened step closes again at a
    higher revision, and its replicas average again in a fresh round)."""
    if not 1 <= revision <= REVISIONS_PER_STEP:
        raise ValueError(f"step {step} revision {revision} is outside 1..{REVISIONS_PER_STEP}")
    return step * REVISIONS_PER_STEP + revision - 1
