"""What a simulated run measures: where every node-second went, and what each step cost.

**Node-time.** Every node accrues time from its arrival until it leaves or the run ends. Its *work* is
compute (forward and backward passes of microbatch attempts, on its accelerator), replica averaging
(from joining a round to its end) and state downloads (a join or resync). Work that ends up in a
committed step is *useful*: an attempt's compute when the committed accounting credits that node with
that ticket at its stage, and a round of the committed revision. The rest is *wasted*: redone or
dropped attempts, rounds that failed or were superseded by a reopen, state downloads. Node-time that
is no work at all is *idle* (a pipeline bubble, a wait on the commit or on a neighbour).

``goodput`` = useful ÷ (useful + wasted work): the share of the work the swarm did that ended up in a
committed step. ``node_time_goodput`` = useful ÷ all node-time (idle counted against it), and
``busy_share`` = work ÷ node-time, are reported beside it.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field


@dataclass
class StepRecord:
    step: int
    closed_at: list[float] = field(default_factory=list)  # each closing (revision 1, 2, ...)
    reopened: int = 0
    committed_at: float | None = None
    revision: int = 0
    redone_tickets: int = 0
    round_failures: int = 0
    round_exclusions: int = 0


@dataclass
class Metrics:
    """Counters and records of one simulated run."""

    useful_compute_s: float = 0.0
    wasted_compute_s: float = 0.0
    useful_avg_s: float = 0.0
    wasted_avg_s: float = 0.0
    sync_s: float = 0.0
    node_s: float = 0.0  # node-time of departed nodes; the live ones are added at the end
    steps: dict[int, StepRecord] = field(default_factory=dict)
    # Bytes sent across each boundary s -> s+1 (activations) and back (gradients), and by replica averaging.
    fwd_bytes: Counter[int] = field(default_factory=Counter)
    bwd_bytes: Counter[int] = field(default_factory=Counter)
    sync_bytes: float = 0.0
    committed_tokens: int = 0
    events: Counter[str] = field(default_factory=Counter)
    # Crashes: (when, peer), and when the coordinator stopped counting each one (left the view).
    crashes: list[tuple[float, str]] = field(default_factory=list)
    last_crash: dict[str, float] = field(default_factory=dict)  # each peer's latest of them
    recoveries: list[float] = field(default_factory=list)
    detections: list[float] = field(default_factory=list)
    # Per stage: seconds with no serving replica.
    empty_s: Counter[int] = field(default_factory=Counter)
    arrivals: int = 0
    departures: Counter[str] = field(default_factory=Counter)
    round_sizes: Counter[int] = field(default_factory=Counter)

    def step(self, step: int) -> StepRecord:
        rec = self.steps.get(step)
        if rec is None:
            rec = self.steps[step] = StepRecord(step)
        return rec
