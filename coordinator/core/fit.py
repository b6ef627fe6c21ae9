"""Which stages a joiner's memory holds: the memory side of placement (sans-IO, pure arithmetic).

A node says at join how much memory its stage may use (``Join.memory_gb``: ``--max-memory``, or on CUDA
the device's free memory; 0: not said) and how many microbatches it lets in at once (``max_in_flight``).
Each stage's footprint at that ``max_in_flight`` is :func:`~protolearn.stages.footprint.stage_footprint`'s
estimate (parameters, optimizer state, gradients, held activations; the formula is there). A stage fits
when its footprint is at most the memory offered; placement (``assignment.place``) then chooses among the
stages that fit only, and a joiner that fits none is refused with one line saying what it has and what
the smallest stage needs.

**Claims.** Both numbers are the node's word (bounded in ``protocol/bounds.py``). They can only narrow
where *that* node goes, never move anyone else; what a liar can do with that is in docs/SECURITY.md.
"""

from __future__ import annotations

from collections.abc import Sequence

from protolearn.stages.footprint import GB, StageFootprint


def fitting(footprints: Sequence[StageFootprint], memory_gb: float, max_in_flight: int) -> list[bool]:
    """Per stage, whether a node offering ``memory_gb`` (0: not said, fits all) with ``max_in_flight``
    (0: not said, the whole step's microbatches) holds it."""
    if memory_gb <= 0 or not footprints:
        return [True] * len(footprints)
    return [f.total(max_in_flight or f.microbatches_per_step) <= memory_gb * GB for f in footprints]


def no_fit_reason(footprints: Sequence[StageFootprint], memory_gb: float, max_in_flight: int) -> str:
    """The one line for a node whose memory holds no stage."""
    smallest = min(footprints, key=lambda f: f.total(max_in_flight or f.microbatches_per_step))
    g = max_in_flight or smallest.microbatches_per_step
    return (
        f"this node offers {memory_gb:.3g} GB and the smallest stage of this run (stage {smallest.stage}) needs "
        f"{smallest.total(g) / GB:.3g} GB ({smallest.describe(g)}); give it more with --max-memory, or fewer "
        "microbatches at once with --max-in-flight, or join from a device with more memory"
    )
