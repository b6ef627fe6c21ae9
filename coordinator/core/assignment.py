"""Stage assignment and rebalancing: a sans-IO policy over (stage, throughput) pairs.

Throughput is measured in layer-tokens per second, so it does not depend on the stage a node holds.
Stage ``s`` holds a share ``w_s`` of the model's layers; with a total throughput ``T_s`` among its
replicas it passes ``T_s / w_s`` (scaled) tokens per second, and the pipeline runs at the rate of its
slowest stage, ``min_s T_s / w_s``. *Balance quality* is that rate divided by the ideal rate with the
same total compute, ``sum(T) / sum(w)``: 1.0 is perfect, 0.0 means some stage is empty.

- A joiner goes to a stage with the least throughput relative to its share, which is the stage that raises
  the bottleneck most. **It cannot choose which** (DESIGN.md, Trust; issue 27, rule 6): an empty stage comes
  first, and a stage below :data:`PLACEMENT_DRAW_MIN_REPLICAS` replicas is filled in order (with one or two
  replicas a stage has no majority a Sybil could be steered to take: one liar owns a stage of one and halts
  a stage of two, wherever it lands); otherwise every stage within :data:`PLACEMENT_SLACK` of the least is a
  candidate in throughput, among the stages within the slack of the fewest replicas per share (a stage's
  majorities count replicas, and a claim of almost no throughput moves no stage's throughput), and the
  coordinator's ``pick`` draws one with a keyed hash the joiner can neither predict nor repeat (its secret key,
  the joiner's ID and a count of the joins so far), so identities that join and leave until they land in a
  target stage need as many tries as there are candidates, each a fresh identity's join. A returning
  identity that holds its old stage's state (the registry checks its last reported hash against the
  stage's majority, or nobody serves that stage) goes back to that stage unless that would leave another stage empty (:func:`place`);
  any other returning identity is placed like a newcomer.
- Rebalancing (Petals-style): only a move into the bottleneck stage can raise the rate, so for every
  source stage with at least two replicas (never empty a stage) the best node to move is the one whose
  throughput is closest to the amount that equalises the two stages. The best such move is proposed
  only if ``rate_before < min_quality * rate_after`` (Petals uses 0.75). Each decision is O(nodes).

Every decision carries a reason string for the log.

**Claims are bounded.** Throughput is what a node says it measured, and a node can lie: one claim of
1e15 once made its stage look saturated, so every later joiner went elsewhere and the liar held its
stage alone. Since throughput is in layer-tokens/s, every member's claim measures the same quantity,
so the swarm's median claim is a reference a minority cannot move: :class:`ThroughputClaims` keeps the
live members' positive claims in log-spaced bins (O(1) to update, O(bins) for the median, whatever the
swarm's size) and a claim counts as at most ``factor`` times the lower median of the *other* claims.
A liar then weighs like ``factor`` honest nodes at most; honest nodes faster than that (a GPU among
CPUs) are undercounted, which costs only placement quality. With no other claim yet there is no
reference and the claim counts as made (one member cannot steer anyone: an empty stage always comes
first).
"""

from __future__ import annotations

import hashlib
import hmac
import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

# A node that reports zero throughput still counts a little, so an empty stage stays distinguishable
# from one whose replicas have not measured yet.
MIN_THROUGHPUT = 1e-6
# Stages whose throughput per share is within this fraction of the least are all candidates for a joiner, once
# the least loaded one has at least this many replicas (below, stages are filled in order).
PLACEMENT_SLACK = 0.25
PLACEMENT_DRAW_MIN_REPLICAS = 3


# Claims are binned by factors of 2**(1/_BINS_PER_DOUBLING) from MIN_THROUGHPUT up to MAX_CLAIM.
MAX_CLAIM = 1e15
_BINS_PER_DOUBLING = 4
_NUM_BINS = math.ceil(math.log2(MAX_CLAIM / MIN_THROUGHPUT) * _BINS_PER_DOUBLING) + 1


def _bin(throughput: float) -> int:
    x = math.log2(max(throughput, MIN_THROUGHPUT) / MIN_THROUGHPUT) * _BINS_PER_DOUBLING
    return min(_NUM_BINS - 1, int(x))


class ThroughputClaims:
    """A multiset of positive throughput claims, binned on a log scale (see the module docstring).

    The bin of the lower median is kept as claims come and go (every heartbeat bounds a claim by it, and a
    scan of the bins each time was a visible share of a 10,000-node simulation): it moves by the bins a change
    steps over, one for most."""

    def __init__(self) -> None:
        self._bins = [0] * _NUM_BINS
        self.count = 0
        self._at = 0  # the bin that holds the lower median claim (while there are claims)
        self._below = 0  # the claims in the bins before it

    def add(self, throughput: float, sign: int = 1) -> None:
        """Add (``sign`` 1) or take out (-1) one claim; zero claims (not measured yet) are not counted."""
        if throughput <= 0:
            return
        b = _bin(throughput)
        bins = self._bins
        bins[b] += sign
        self.count += sign
        if self.count <= 0:
            self._at = self._below = 0
            return
        if b < self._at:
            self._below += sign
        rank = (self.count - 1) // 2
        # (the bounds hold only if a claim taken out was one added; they keep a miscount from running off the bins)
        while rank < self._below and self._at > 0:  # the median claim is in an earlier bin
            self._at -= 1
            self._below -= bins[self._at]
        while rank >= self._below + bins[self._at] and self._at < _NUM_BINS - 1:  # or in a later one
            self._below += bins[self._at]
            self._at += 1

    def lower_median(self) -> float | None:
        """The upper edge of the bin that holds the lower median claim (None: no claims)."""
        if self.count <= 0:
            return None
        return MIN_THROUGHPUT * 2 ** ((self._at + 1) / _BINS_PER_DOUBLING)

    def bound(self, claim: float, factor: float) -> float:
        """``claim`` as it counts: at most ``factor`` times the lower median of the claims held here."""
        median = self.lower_median()
        return claim if median is None else min(claim, factor * median)


@dataclass(frozen=True)
class StageLoad:
    throughput: float
    replicas: int


@dataclass(frozen=True)
class Choice:
    stage: int
    reason: str


@dataclass(frozen=True)
class Move:
    peer_id: str
    src: int
    dst: int
    quality_before: float
    quality_after: float
    reason: str


def shares_from_layers(layers_per_stage: Sequence[int]) -> list[float]:
    """Each stage's share of the compute, proportional to its layer count (a stage with 0 layers gets 1)."""
    weights = [max(1, int(n)) for n in layers_per_stage]
    total = float(sum(weights))
    return [w / total for w in weights]


def stage_loads(nodes: Iterable[tuple[int, float]], num_stages: int) -> list[StageLoad]:
    """Aggregate (stage, throughput) pairs into per-stage loads."""
    thr = [0.0] * num_stages
    cnt = [0] * num_stages
    for stage, t in nodes:
        if 0 <= stage < num_stages:
            thr[stage] += max(t, MIN_THROUGHPUT)
            cnt[stage] += 1
    return [StageLoad(thr[s], cnt[s]) for s in range(num_stages)]


def swarm_rate(loads: Sequence[StageLoad], shares: Sequence[float]) -> float:
    """The pipeline's rate in share-normalised throughput: its slowest stage."""
    return min(load.throughput / w for load, w in zip(loads, shares, strict=True))


def balance_quality(loads: Sequence[StageLoad], shares: Sequence[float]) -> float:
    total = sum(load.throughput for load in loads)
    if total <= 0:
        return 0.0
    return swarm_rate(loads, shares) / (total / sum(shares))


def placement_key(secret: bytes) -> bytes:
    """The key of a joiner's stage draw, derived from the coordinator's secret (the lease-nonce key), distinct
    from the other keys derived from it."""
    return hmac.new(secret, b"protolearn/placement-draw", hashlib.sha256).digest()


def choose_stage(
    loads: Sequence[StageLoad], shares: Sequence[float], fits: Sequence[bool] | None = None, pick: Callable[[Sequence[int]], int] | None = None,
) -> Choice:
    """The stage a joiner should take: the least throughput relative to its share (among those that
    ``fits`` allows, all by default). ``pick`` draws one of several candidates (the coordinator's keyed draw:
    see the module docstring); without it, the least loaded (ties: fewer replicas per share, then the lower
    index)."""
    candidates = [s for s in range(len(loads)) if fits is None or fits[s]]
    if not candidates:
        raise ValueError("a run has at least one stage, and a joiner fits at least one")

    def key(s: int) -> tuple[float, float, int]:
        return (loads[s].throughput / shares[s], loads[s].replicas / shares[s], s)

    # A stage crowded in replicas per share takes no joiner while another stage has fewer (once every candidate
    # holds PLACEMENT_DRAW_MIN_REPLICAS): majorities count replicas, and a claim of almost no throughput moves no
    # stage's throughput, so identities that claim little keep their stage the least loaded and, by leaving whenever
    # they are placed elsewhere, could pile into it (abuse bench stage_steering: 7 of 9 replicas of a stage after 12
    # joins). Throughput then decides among the uncrowded stages; the rebalancer still moves fast nodes to slow stages.
    if min(loads[s].replicas for s in candidates) >= PLACEMENT_DRAW_MIN_REPLICAS:
        fewest = min(loads[s].replicas / shares[s] for s in candidates)
        candidates = [s for s in candidates if loads[s].replicas / shares[s] <= fewest * (1 + PLACEMENT_SLACK)]
    best = min(candidates, key=key)
    load = loads[best]
    if load.replicas == 0:
        return Choice(best, f"stage {best} has no replicas")
    least = load.throughput / shares[best]
    near = sorted(s for s in candidates if loads[s].throughput / shares[s] <= least * (1 + PLACEMENT_SLACK))
    if pick is not None and len(near) > 1 and load.replicas >= PLACEMENT_DRAW_MIN_REPLICAS:
        best = near[pick(near) % len(near)]
        load = loads[best]
        return Choice(best, f"stage {best} drawn among the {len(near)} stages within {PLACEMENT_SLACK:.0%} of the least throughput "
                            f"per share ({load.throughput / shares[best]:.3g}, {load.replicas} replicas)")
    return Choice(
        best,
        f"stage {best} has the least throughput per share ({load.throughput / shares[best]:.3g}, "
        f"{load.replicas} replicas)",
    )


def place(
    loads: Sequence[StageLoad], shares: Sequence[float], previous: int | None, fits: Sequence[bool] | None = None,
    pick: Callable[[Sequence[int]], int] | None = None,
) -> Choice:
    """The stage a joiner gets: :func:`choose_stage`'s (with ``pick``), or, for a returning identity that holds
    its stage's state, the stage it held before (``previous``): its local state is worth reusing, but a halted
    stage comes first, so not when another stage has no replica while its old one has some. With ``fits`` (per
    stage, whether the joiner's memory holds it: fit.py; at least one does) only those stages are candidates."""
    choice = choose_stage(loads, shares, fits, pick)
    if previous is not None and 0 <= previous < len(loads) and (fits is None or fits[previous]):
        halted_elsewhere = loads[choice.stage].replicas == 0 and loads[previous].replicas > 0
        if not halted_elsewhere:
            return Choice(previous, f"rejoined its previous stage {previous}")
    return choice


def propose_move(
    nodes: Iterable[tuple[str, int, float, bool]],
    shares: Sequence[float],
    *,
    min_quality: float = 0.75,
) -> Move | None:
    """The one move that raises the bottleneck rate most, if it beats ``min_quality``; else ``None``.

    ``nodes`` yields (peer_id, stage, throughput, movable). Immovable nodes count toward their stage's
    load and replica count but are never proposed (e.g. syncing, or recently moved).
    """
    num_stages = len(shares)
    nodes = [n for n in nodes if 0 <= n[1] < num_stages]
    loads = stage_loads(((stage, t) for _, stage, t, _ in nodes), num_stages)
    thr = [load.throughput for load in loads]
    cnt = [load.replicas for load in loads]
    movable_by_stage: list[list[tuple[str, float]]] = [[] for _ in range(num_stages)]
    for peer_id, stage, t, movable in nodes:
        if movable:
            movable_by_stage[stage].append((peer_id, max(t, MIN_THROUGHPUT)))
    if num_stages < 2:
        return None
    ratios = [thr[s] / shares[s] for s in range(num_stages)]
    order = sorted(range(num_stages), key=lambda s: (ratios[s], cnt[s] / shares[s], s))
    dst = order[0]
    rate_before = ratios[dst]
    total = sum(thr)
    ideal = total / sum(shares) if total > 0 else 0.0

    best: tuple[float, str, int, float] | None = None  # (rate_after, peer, src, throughput)
    for src in range(num_stages):
        if src == dst or cnt[src] < 2 or not movable_by_stage[src]:
            continue
        # The smallest ratio among the stages this move leaves alone (at most 3 look-ups in order).
        others = math.inf
        for s in order:
            if s not in (src, dst):
                others = ratios[s]
                break
        w_s, w_t = shares[src], shares[dst]
        # Moving x equalises the two stages at x* = (T_s w_t - T_t w_s) / (w_s + w_t).
        target_x = (thr[src] * w_t - thr[dst] * w_s) / (w_s + w_t)
        peer_id, x = min(movable_by_stage[src], key=lambda p: (abs(p[1] - target_x), p[0]))
        rate_after = min(others, (thr[src] - x) / w_s, (thr[dst] + x) / w_t)
        if best is None or rate_after > best[0]:
            best = (rate_after, peer_id, src, x)
    if best is None:
        return None
    rate_after, peer_id, src, x = best
    if not rate_before < min_quality * rate_after:
        return None
    q_before = balance_quality(loads, shares)  # rate_before / ideal
    q_after = rate_after / ideal if ideal > 0 else 0.0
    reason = (
        f"move {peer_id} (throughput {x:.3g}) from stage {src} to bottleneck stage {dst}: "
        f"balance quality {q_before:.2f} -> {q_after:.2f}"
    )
    return Move(peer_id, src, dst, q_before, q_after, reason)
