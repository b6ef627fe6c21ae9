"""What a replica computes in, and how far that may put its outputs from another replica's.

Volunteers bring what they have: a GPU that is fast in bf16, a CPU that is not. A run says which
precisions it **admits** (``integrity.precisions`` in the run config, so part of the run hash); a node
declares its own at join (``node join --bf16`` declares ``bf16``) and the coordinator refuses one the
run does not admit. Every comparison of two replicas' outputs for the same inputs (a spot check in
``node/integrity.py``, the coordinator's check of its evidence in ``protocol/boundary.py``, a joiner's
self-test in ``node/syncing.py``) then allows :func:`allowance` of the run's admitted precisions on top
of the codec's error and ``check_tolerance``.

**One run-wide allowance, not one per pair.** A declared precision is a claim, and a liar would declare
the loosest one: a per-pair tolerance would give any liar the bf16 allowance anyway while the coordinator
had to trust each member's word for which tolerance applies. Allowing the loosest admitted pair
everywhere is as strict against a liar, trusts no claim, and keeps every check a function of the run
alone. A run that wants the tight fp32 tolerance admits only ``fp32`` (the default).

:data:`PRECISION_ERROR` bounds each precision's relative L2 distance from a float32 computation of the
same inputs. Two replicas are at most the sum of their bounds apart (the triangle inequality through the
float32 result), and both sides may compute in the loosest admitted precision, so :func:`allowance` is
twice the largest admitted bound (two bf16 nodes on different hardware: ``2 × BF16_ERROR``).
``BF16_ERROR`` is measured, not guessed: ``tests/unit/test_precision.py`` computes the demo stages'
compared outputs (stage 0's activation, the last stage's input gradient, both self-test outputs) in fp32
and under CPU bf16 autocast, at init and after a few reference steps, and checks that ``BF16_ERROR`` is
2 to 8 times the largest distance. Measured on this machine: 0.0043 at init (stage 0's self-test
output), 0.0035 after 10 steps, 0.0039 after 30 (the last stage's input gradient), so
:data:`MEASURED_BF16` = 0.0043; ``BF16_ERROR`` = 7 × that leaves room for the distance growing with
training (an earlier, unrepeated measurement saw 0.0105 after 100 steps) and for CUDA's bf16 kernels,
which were not measured here. A much deeper stage, or a run trained far longer, must be measured again.

**The allowance for one input: its spread.** ``BF16_ERROR`` bounds the distance on typical inputs, not on
every input: where the computation is ill-conditioned the bf16 error of the whole tensor is many times
larger. Measured on the integrity run (2 stages): the last stage's input gradient of one microbatch was 0.145
from float32 (the other five of its step, 0.004), because one position's boundary hidden had a tenth of the
usual norm, so its RMSNorm multiplied that position's gradient, bf16 rounding included, by ten, and the
position's gradient then held almost all of the tensor's norm. No run-wide bound covers such inputs without
admitting lies. So in a run admitting a lower precision, every recomputation made for a spot check is made
twice, in float32 and in that precision, and both are signed (``protocol/boundary.py``): the distance between
the two, the **spread**, is how far that precision moves this very output, measured by the recomputing
replica on its own hardware. A check then allows :func:`spread_allowance` of the largest spread among its
recomputations on top of the run-wide tolerance. The largest, not the smallest: one witness that signs a
narrow spread cannot convict an honest replica; one that signs a wide spread can at most acquit, up to
``MAX_SPREAD``.
"""

from __future__ import annotations

from typing import Literal

PRECISIONS = ("fp32", "bf16")
Precision = Literal["fp32", "bf16"]

# The largest fp32/bf16 relative L2 distance tests/unit/test_precision.py measured on the demo run, and
# the bound set from it (see the module docstring).
MEASURED_BF16 = 0.0043
BF16_ERROR = 0.03
PRECISION_ERROR: dict[str, float] = {"fp32": 0.0, "bf16": BF16_ERROR}


# A check allows SPREAD_FACTOR times its recomputations' largest spread (one side measured on the recomputing
# replica's hardware, the accused's possibly on other kernels), the spread counted up to MAX_SPREAD.
SPREAD_FACTOR = 2.0
MAX_SPREAD = 0.25


def lower_precision(precisions: tuple[str, ...]) -> str | None:
    """The precision below float32 that a run admitting ``precisions`` recomputes its checks in too (None:
    float32 only, and a check is recomputed once)."""
    return "bf16" if "bf16" in precisions else None  # the one lower precision there is (PRECISIONS)


def spread_allowance(spreads: list[float]) -> float:
    """What a check allows on top of the run-wide tolerance for recomputations whose spreads (float32 against
    the lower precision, relative L2) are ``spreads``; a non-finite spread counts as ``MAX_SPREAD``."""
    widest = max((s if s == s and s != float("inf") else MAX_SPREAD for s in spreads), default=0.0)
    return SPREAD_FACTOR * min(widest, MAX_SPREAD)  # a spread is a distance: never below 0


def allowance(precisions: tuple[str, ...]) -> float:
    """How far two honest replicas of a run admitting ``precisions`` may be apart beyond float32's own
    nondeterminism: the loosest pair, each side any admitted precision (an unknown name counts as the
    loosest known one)."""
    loosest = max(PRECISION_ERROR.values())
    errors = sorted((PRECISION_ERROR.get(p, loosest) for p in precisions), reverse=True)
    return 2 * errors[0] if errors else 0.0
