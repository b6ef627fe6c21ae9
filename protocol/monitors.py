"""Boundary monitors: score each sender of activations and gradients from cheap statistics, with no recompute.

DESIGN.md "Integrity", first line of defence. A receiver of boundary tensors (activations ``fwd`` from
stage s to s+1, gradients ``bwd`` from s to s-1; ``(B, T, D)`` float32 after the codec's decode) calls
:meth:`BoundaryMonitor.observe` on each one. The monitor is sans-IO and cheap (a few vectorised
reductions per tensor; no trio, no IO), and the score it keeps per sender tells the spot-check policy
(:mod:`~protolearn.protocol.probation`) whom to check at rate 1.0.

What it measures, per tensor ``x`` viewed as ``(N, D)`` rows:

* ``rms``: log of the RMS of all elements (catches ``scale``, ``zero``, ``noise``);
* ``mean``: the mean of all elements over their RMS (catches ``signflip`` of activations);
* ``tail``: the fraction of elements beyond ``TAIL_K`` times the tensor's own RMS, a shape statistic
  independent of scale (catches ``random`` and ``noise``, which are Gaussian where honest tensors are not);
* ``rows``: the log of the coefficient of variation of the per-token norms ``(N,)`` (catches ``random`` and
  ``noise`` gradients: an honest gradient is large on the few tokens the model got wrong, a Gaussian one
  is equally large everywhere);
* ``dir``: the cosine of the per-feature mean vector ``x.mean(0)`` ``(D,)`` with the group's reference
  (catches ``signflip`` and ``random`` activations: the residual stream has a stable mean direction);
* ``profile``: the cosine of the per-feature RMS vector ``(D,)`` with the group's reference (catches
  ``random`` and ``noise`` in both directions: honest tensors carry the model's per-feature structure);
* non-finite values: any NaN or Inf gives the sender :data:`MAX_SCORE` at once, and it stays there
  until :meth:`~BoundaryMonitor.forget` (a codec never produces one; an honest sender never sends one).

How it compares. Senders are grouped by (stage, direction): the replicas of one stage, seen through one
codec, so like is compared with like (topk:0.05 changes every statistic, but for all of them alike).
Each sender keeps, per statistic, a fast EMA (rate :data:`FAST_ALPHA`), a slow EMA ``mu`` (rate
``alpha``; a plain average over the first ``1/alpha`` observations) with an EMA of ``(s - mu)^2``, and
fast EMAs of its mean and profile vectors. A sender is *warm* after ``warmup`` observations.

* Once a group has :data:`MIN_GROUP` warm senders (a median of 3 ignores one liar), an observation is
  compared with the group *now*: the reference is the median of the warm senders' fast EMAs (the
  vectors' coordinate-wise), which follows training's drift since all replicas drift together, and
  the spread is the root of the median of the senders' EMA of ``(s - ref)^2``, which holds
  microbatch-to-microbatch variation and the codec's error. An RMS rather than a mean absolute
  deviation, because some honest statistics are heavy-tailed (a gradient microbatch dominated by one
  token drops the profile cosine and, under topk, the tail fraction) and must get a wider tolerance;
* in a smaller group, a warm sender is compared with its own past (``mu``, and the RMS of ``s - mu``).

Spreads never go below :data:`FLOORS`. The badness of an observation is ``b = max over statistics of
|s - ref| / (threshold * TOLERANCE * spread)``; the sender's score is an EMA (rate :data:`SCORE_ALPHA`) of
``min(b, MAX_BADNESS)``, and a score >= 1 is *suspect*. So one wild honest tensor never makes a
suspect (it adds at most 0.6), while a liar whose every tensor is ``threshold`` spreads off or more is
suspect on its third; one NaN or Inf is enough.

Why honest training does not trip it: the comparison is with the stage's other replicas at the same
time, and the tolerance is in units of the group's own spread. All EMAs are winsorised at
``threshold * spread`` per tensor (the vectors' rate divided by ``b``), so a liar's tensors barely move
its own baseline and never the group's median; and since the fast EMAs still follow, a sudden change
shared by all replicas (a learning-rate warmup) is absorbed in a few tensors.

Use: ``observe(sender, stage, direction, t) -> score`` per received tensor (after decode; a tensor the
codec refused never gets here); ``suspect(sender)`` for :meth:`SpotCheckPolicy.should_check
<protolearn.protocol.probation.SpotCheckPolicy.should_check>`; ``reason(sender)`` for the log and the
evidence note; ``scores()`` for ``swarm status``; ``forget(sender)`` when a peer leaves or is banned.
Cost: ~200 us per (4, 64, 256) float32 tensor on one CPU thread (measured by the unit test).

Calibration (tests/unit/test_monitors.py): a 2-stage d_model=64 run trained 120 steps while 3 replicas
send ~240 tensors each per direction (two run seeds); with ``threshold`` 8 no honest score passed 0.78
(none/int8) or 0.87 (topk:0.05), on synthetic streams 0.82. In a 3-stage d_model=128 run (both
boundaries; not in the tests) the highest honest score was 0.94 (topk gradients), and x10 was caught
after 2-3 lies at every boundary and codec. A liar among 3, lying from step 50, is suspect after this
many lies ("no": not in its 140 lies, bar bwd topk noise: after 119):

=========  =====  =====  ========  ====  ======  ===  =====
boundary   scale  noise  signflip  zero  random  nan  stale
=========  =====  =====  ========  ====  ======  ===  =====
fwd none   3      3      3         3     3       1    no
fwd int8   3      3      3         3     3       1    no
fwd topk   3      no     3         4     5       1    no
bwd none   3      no     no        3     9       1    no
bwd int8   3      no     no        3     9       1    no
bwd topk   3      no     no        7     no      1    no
=========  =====  =====  ========  ====  ======  ===  =====

Limits. Gradients at these boundaries are sign-symmetric (their per-feature mean, skew and correlation
with the activation are noise), so a flipped gradient has an honest gradient's statistics. Noise of the
tensor's own RMS added to a gradient changes each statistic by 3-6 spreads, under the threshold that
keeps honest heavy-tailed gradients clear. topk:0.05 keeps only the largest 5% (with error feedback),
which hides added noise and most of a Gaussian gradient's difference; its error feedback also keeps a
``zero`` liar sending its residual for a while. ``stale`` outputs (weights 5 steps old) look honest.
A group of fewer than :data:`MIN_GROUP` warm senders compares a sender with its own past only, which a
liar that lies from its first tensor defeats. Spot checks are there for all of these.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from dataclasses import dataclass, field

import torch

# Statistic names, in the order of the per-sender vectors.
STATS = ("rms", "mean", "tail", "rows", "dir", "profile")
# Absolute floors of the spread (an RMS deviation) per statistic: below these, differences are codec
# rounding or float noise, never a lie worth a spot check.
FLOORS = (0.02, 0.005, 0.001, 0.05, 0.01, 0.002)
# Per statistic, the share of ``threshold`` (in spreads) it may be off. The log RMS is a log of a mean of
# many squares, light-tailed, so it is held tighter (5 spreads at the default threshold 8): a gradient
# boundary whose RMS varies a lot between microbatches still catches x10 at once. The others are
# heavy-tailed (a one-token microbatch moves the cosines and the tail fraction far).
TOLERANCE = (0.625, 1.0, 1.0, 1.0, 1.0, 1.0)
TAIL_K = 3.0
# The tail fraction is counted on at most this many elements (evenly strided) of a large tensor.
TAIL_SAMPLE = 1 << 14
# The group's reference needs this many warm senders: a median of 3 ignores one liar.
MIN_GROUP = 3
SCORE_ALPHA = 0.5
# Rate of the EMAs that form the group reference (statistics and vectors): fast, so the reference follows training.
FAST_ALPHA = 0.5
# One tensor adds at most SCORE_ALPHA * MAX_BADNESS = 0.6 to a score: an isolated honest outlier (the
# cosines are heavy-tailed early in training) never makes a suspect, two in a row reach 0.9, and a liar
# whose every tensor is off by ``threshold`` spreads or more is suspect on its third.
MAX_BADNESS = 1.2
MAX_SCORE = 100.0
# Senders remembered (least recently observed forgotten; a forgotten sender starts over, warmup included).
MAX_SENDERS = 1024
DIRECTIONS = ("fwd", "bwd")

DEFAULT_ALPHA = 0.1
DEFAULT_THRESHOLD = 8.0
DEFAULT_WARMUP = 8

_NUM = len(STATS)
_TINY = 1e-30


Stats = list[float]  # one value per name in STATS


@dataclass
class _Track:
    """One sender's history in one (stage, direction) group. Scalars are plain floats: cheaper than tiny tensors."""

    count: int = 0
    fast: Stats = field(default_factory=lambda: [0.0] * _NUM)  # EMA at FAST_ALPHA
    mu: Stats = field(default_factory=lambda: [0.0] * _NUM)  # EMA at alpha
    var_group: Stats = field(default_factory=lambda: [0.0] * _NUM)  # EMA of (s - group ref)^2
    var_self: Stats = field(default_factory=lambda: [0.0] * _NUM)  # EMA of (s - mu)^2
    group_count: int = 0  # observations compared with a group reference
    mean_vec: torch.Tensor | None = None  # (D,) EMA at FAST_ALPHA
    profile_vec: torch.Tensor | None = None  # (D,) EMA at FAST_ALPHA
    score: float = 0.0
    reason: str = ""


@dataclass
class _Sender:
    tracks: dict[tuple[int, str], _Track] = field(default_factory=dict)
    poisoned: str = ""  # why the sender sent a non-finite value, if it did


def _cos(a: torch.Tensor, b: torch.Tensor) -> float:
    den = float(torch.linalg.vector_norm(a)) * float(torch.linalg.vector_norm(b))
    return float(torch.dot(a, b)) / den if den > _TINY else 0.0


def _median(rows: list[Stats]) -> Stats:
    """Per-statistic median (the lower one of an even count, as torch's)."""
    k = (len(rows) - 1) // 2
    return [sorted(col)[k] for col in zip(*rows)]


def _clamp(v: float, limit: float) -> float:
    return -limit if v < -limit else limit if v > limit else v


class BoundaryMonitor:
    """Per-sender anomaly scores of the boundary tensors a receiver gets (see the module docstring).

    ``codec`` is recorded for :meth:`reason` and the caller's bookkeeping only: all senders of a group
    use the run's one codec, and the spreads learnt from their tensors absorb its error.
    """

    def __init__(
        self,
        *,
        codec: str = "none",
        alpha: float = DEFAULT_ALPHA,
        threshold: float = DEFAULT_THRESHOLD,
        warmup: int = DEFAULT_WARMUP,
        max_senders: int = MAX_SENDERS,
    ) -> None:
        if not 0.0 < alpha <= 1.0:
            raise ValueError(f"alpha={alpha} must be in (0, 1]")
        if not threshold > 0.0:
            raise ValueError(f"threshold={threshold} must be > 0")
        if warmup < 1 or max_senders < 1:
            raise ValueError(f"warmup={warmup} and max_senders={max_senders} must be >= 1")
        self.codec = codec
        self.alpha = alpha
        self.threshold = threshold
        self.warmup = warmup
        self.max_senders = max_senders
        self._senders: OrderedDict[str, _Sender] = OrderedDict()
        self._groups: dict[tuple[int, str], set[str]] = {}

    # -- queries -----------------------------------------------------------------------------------

    def score(self, sender: str) -> float:
        """0 for a sender like its group and its own past; >= 1 for a suspect; :data:`MAX_SCORE` after a NaN."""
        s = self._senders.get(sender)
        if s is None:
            return 0.0
        if s.poisoned:
            return MAX_SCORE
        return max((t.score for t in s.tracks.values()), default=0.0)

    def suspect(self, sender: str) -> bool:
        return self.score(sender) >= 1.0

    def reason(self, sender: str) -> str:
        """One line: the statistic that is furthest off for ``sender``'s worst group, and by how much."""
        s = self._senders.get(sender)
        if s is None:
            return "not observed"
        if s.poisoned:
            return s.poisoned
        if not s.tracks:
            return "not observed"
        key, track = max(s.tracks.items(), key=lambda kv: kv[1].score)
        return f"stage {key[0]} {key[1]} score {track.score:.2f}: {track.reason or 'no anomaly'}"

    def scores(self) -> dict[str, float]:
        """Every remembered sender's score (for ``swarm status``)."""
        return {name: self.score(name) for name in self._senders}

    def forget(self, sender: str) -> None:
        s = self._senders.pop(sender, None)
        if s is None:
            return
        for key in s.tracks:
            members = self._groups.get(key)
            if members is not None:
                members.discard(sender)
                if not members:
                    del self._groups[key]

    # -- the one event -----------------------------------------------------------------------------

    def observe(self, sender: str, stage: int, direction: str, t: torch.Tensor) -> float:
        """Fold tensor ``t`` ``(B, T, D)`` in; return ``sender``'s score.

        ``stage`` is the stage ``sender`` serves and ``direction`` is ``"fwd"`` for its activations,
        ``"bwd"`` for its gradients: the senders compared with each other are those of one (stage, direction).
        """
        if direction not in DIRECTIONS:
            raise ValueError(f"direction must be one of {DIRECTIONS}, got {direction!r}")
        s = self._touch(sender)
        key = (stage, direction)
        track = s.tracks.get(key)
        if track is None:
            track = s.tracks[key] = _Track()
            self._groups.setdefault(key, set()).add(sender)
        if s.poisoned:
            return MAX_SCORE
        x = t.detach()
        if x.dtype != torch.float32:
            x = x.float()
        d = x.shape[-1] if x.dim() else 1
        x = x.reshape(-1, d)  # (N, D)
        n = x.shape[0]
        if x.numel() == 0:
            return self.score(sender)
        sq = x * x  # (N, D)
        mean_vec = x.mean(0)  # (D,)
        profile_vec = (sq.sum(0) / n).sqrt_()  # (D,) per-feature RMS
        row_norms = sq.sum(1).sqrt_()  # (N,) per-token norms
        rms = math.sqrt(float(sq.sum()) / x.numel())
        mean = float(mean_vec.sum()) / d
        if not (math.isfinite(rms) and math.isfinite(mean)):
            bad = int((~torch.isfinite(x)).sum())
            s.poisoned = f"stage {stage} {direction}: {bad} non-finite value(s) in a {tuple(t.shape)} tensor"
            return MAX_SCORE
        row_mean = float(row_norms.mean())
        rows = float(row_norms.std()) / row_mean if n > 1 and row_mean > 0 else 0.0
        flat = sq.view(-1)
        if flat.numel() > TAIL_SAMPLE:  # a strided sample: the count is the costliest reduction
            flat = flat[:: -(-flat.numel() // TAIL_SAMPLE)]
        tail = float(torch.count_nonzero(flat > (TAIL_K * rms) ** 2)) / flat.numel() if rms > 0 else 0.0

        warm = [self._senders[m].tracks[key] for m in self._groups[key] if self._senders[m].tracks[key].count >= self.warmup]
        ref_mean_vec, ref_profile_vec = self._reference_vectors(warm, track, mean_vec, profile_vec)
        stats = [
            math.log(rms + _TINY),
            mean / rms if rms > 0 else 0.0,
            tail,
            math.log(rows + _TINY),
            _cos(mean_vec, ref_mean_vec) if ref_mean_vec is not None else 1.0,
            _cos(profile_vec, ref_profile_vec) if ref_profile_vec is not None else 1.0,
        ]
        (badness, why), ref = self._badness(stats, warm, track)
        if badness is not None:
            track.score = (1.0 - SCORE_ALPHA) * track.score + SCORE_ALPHA * min(badness, MAX_BADNESS)
            track.reason = why
        self._update(track, stats, ref, self._spread(warm, track), badness, mean_vec, profile_vec)
        return self.score(sender)

    # -- internals ---------------------------------------------------------------------------------

    def _reference_vectors(
        self, warm: list[_Track], own: _Track, mean_vec: torch.Tensor, profile_vec: torch.Tensor
    ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """The group's reference mean and profile vectors: a coordinate-wise median when the group is big enough."""
        pool = [w for w in warm if w.mean_vec is not None and w.mean_vec.shape == mean_vec.shape]
        if len(pool) >= MIN_GROUP:
            mv = torch.stack([w.mean_vec for w in pool]).median(0).values  # type: ignore[misc]
            pv = torch.stack([w.profile_vec for w in pool]).median(0).values  # type: ignore[misc]
            return mv, pv
        if own.mean_vec is not None and own.mean_vec.shape == mean_vec.shape:
            return own.mean_vec, own.profile_vec
        return None, None

    def _badness(self, stats: Stats, warm: list[_Track], own: _Track) -> tuple[tuple[float | None, str], Stats | None]:
        """((b, reason), group ref); b is None while there is nothing to compare with."""
        ref = None
        if len(warm) >= MIN_GROUP:
            # Against the group now: the median of the warm senders' fast EMAs drifts with training.
            ref = _median([w.fast for w in warm])
            spread = self._group_spread(warm)
            if spread is not None:
                return self._explain(stats, ref, spread), ref
            return (None, ""), ref
        if own.count >= self.warmup:
            # Too few replicas to tell who lies: against its own past only.
            return self._explain(stats, own.mu, self._own_spread(own)), None
        return (None, ""), None

    def _group_spread(self, warm: list[_Track]) -> Stats | None:
        seasoned = [w.var_group for w in warm if w.group_count >= self.warmup]
        if len(seasoned) < MIN_GROUP:
            return None
        return [max(math.sqrt(v), f) for v, f in zip(_median(seasoned), FLOORS)]

    def _own_spread(self, own: _Track) -> Stats:
        return [max(math.sqrt(v), f) for v, f in zip(own.var_self, FLOORS)]

    def _spread(self, warm: list[_Track], own: _Track) -> Stats:
        """The winsorising limit's unit: the group's spread when known, else the sender's own."""
        spread = self._group_spread(warm)
        if spread is not None:
            return spread
        if own.count >= self.warmup:
            return self._own_spread(own)
        return [math.inf] * _NUM

    def _explain(self, stats: Stats, base: Stats, spread: Stats) -> tuple[float, str]:
        z = [abs(v - b) / sp for v, b, sp in zip(stats, base, spread)]  # in spreads
        j = max(range(_NUM), key=lambda k: z[k] / TOLERANCE[k])
        why = f"{STATS[j]} {stats[j]:.4g} vs {base[j]:.4g}, {z[j]:.1f} spreads off"
        return z[j] / (self.threshold * TOLERANCE[j]), why

    def _update(
        self,
        track: _Track,
        stats: Stats,
        ref: Stats | None,
        spread: Stats,
        badness: float | None,
        mean_vec: torch.Tensor,
        profile_vec: torch.Tensor,
    ) -> None:
        track.count += 1
        if track.count == 1:
            track.mu, track.fast = list(stats), list(stats)
            track.mean_vec, track.profile_vec = mean_vec.clone(), profile_vec.clone()
            return
        a = max(self.alpha, 1.0 / track.count)
        g = max(self.alpha, 1.0 / (track.group_count + 1))
        for j in range(_NUM):
            # Winsorised: a lie moves a baseline by at most `limit` per tensor, and not at all the group's median.
            limit = self.threshold * spread[j]
            delta = _clamp(stats[j] - track.mu[j], limit)
            track.var_self[j] += a * (delta * delta - track.var_self[j])
            track.mu[j] += a * delta
            track.fast[j] += FAST_ALPHA * _clamp(stats[j] - track.fast[j], limit)
            if ref is not None:
                off = _clamp(stats[j] - ref[j], limit)
                track.var_group[j] += g * (off * off - track.var_group[j])
        if ref is not None:
            track.group_count += 1
        w = FAST_ALPHA / max(1.0, badness or 0.0)
        if track.mean_vec is None or track.mean_vec.shape != mean_vec.shape:
            track.mean_vec, track.profile_vec = mean_vec.clone(), profile_vec.clone()
        else:
            track.mean_vec.lerp_(mean_vec, w)
            track.profile_vec.lerp_(profile_vec, w)  # type: ignore[union-attr]

    def _touch(self, sender: str) -> _Sender:
        s = self._senders.pop(sender, None)
        if s is None:
            s = _Sender()
        self._senders[sender] = s
        while len(self._senders) > self.max_senders:
            oldest = next(iter(self._senders))
            self.forget(oldest)
        return s
