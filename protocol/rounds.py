"""Round ids of the stage collective: one owner for how (step, revision, phase) maps to a round.

Revision r of step t averages in the rounds of **revision index** ``t * REVISIONS_PER_STEP + r - 1``;
a revision has :data:`PHASES_PER_REVISION` rounds, one per phase, numbered in time order:
``round_id(t, r, k) = revision_index * PHASES_PER_REVISION + k``. A plain step averages in phase 0
alone; PowerSGD (:mod:`protolearn.protocol.sync_compression.powersgd`) averages its two factors in
phases 0 and 1. The coordinator's ``max_revisions`` setting is validated against
:data:`REVISIONS_PER_STEP`, so a reopened step never lands in the next step's round ids.

Windows (which rounds a replica holds early parts of, which results it still serves) are counted in
revisions (:func:`revision_index`), so every phase of a revision is in a window together.
"""

from __future__ import annotations

# Round ids per step. The coordinator caps revisions far below this (its max_revisions, 32 by default).
REVISIONS_PER_STEP = 1 << 12
# DiLoCo: attempts of one outer round whose collective failed, before its replicas give up on it. An outer
# round after step b uses b's round ids (attempt a is revision a, its phases as a step's), which no inner
# step uses in that mode.
MAX_OUTER_ATTEMPTS = 64
# Rounds per revision: phase 0, and phase 1 for a sync that averages twice per step (PowerSGD).
PHASES_PER_REVISION = 2


def round_id(step: int, revision: int = 1, phase: int = 0) -> int:
    """The collective round of ``step``'s accounting at ``revision`` and ``phase`` (a reopened step closes
    again at a higher revision, and its replicas average again in fresh rounds)."""
    if not 1 <= revision <= REVISIONS_PER_STEP:
        raise ValueError(f"step {step} revision {revision} is outside 1..{REVISIONS_PER_STEP}")
    if not 0 <= phase < PHASES_PER_REVISION:
        raise ValueError(f"phase {phase} is outside 0..{PHASES_PER_REVISION - 1}")
    return (step * REVISIONS_PER_STEP + revision - 1) * PHASES_PER_REVISION + phase


def revision_index(round_: int) -> int:
    """Which revision of which step ``round_`` belongs to, as ``step * REVISIONS_PER_STEP + revision - 1``."""
    return round_ // PHASES_PER_REVISION


def phase_round(round_: int, phase: int) -> int:
    """The round of ``phase`` in the same revision as ``round_``."""
    if not 0 <= phase < PHASES_PER_REVISION:
        raise ValueError(f"phase {phase} is outside 0..{PHASES_PER_REVISION - 1}")
    return revision_index(round_) * PHASES_PER_REVISION + phase


def in_early_window(next_round: int, round_: int) -> bool:
    """Whether parts of ``round_`` may be held before it starts, when this replica averages ``next_round``
    next: any phase of that revision or of the one after (the step may reopen)."""
    return 0 <= revision_index(round_) - revision_index(next_round) <= 1
