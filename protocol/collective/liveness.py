"""The failure detector of a collective round: adaptive deadlines, probes and suspicion.

A :class:`~protolearn.protocol.collective.CollectiveRound` waits on peers (an owner on the slices it
still lacks, a replica on each part's owner, a committed replica on the others' ``fin``). This module
decides, from those waits and ``now`` alone, which peers to probe and which to suspect dead; it never
does IO and knows nothing of parts or contributor sets, so the round's correctness argument only needs
its one promise: a peer is suspected only when it has been silent, or useless, for long enough.

How it works
------------
* Each wait has a key (chosen by the round) and the time it began; :meth:`FailureDetector.track` keeps
  those times while the round still waits on the same thing, so a deadline counts from the wait's start.
* A wait's limit is the round's (the phase's expected bytes over :class:`Bandwidth`, an EMA of the
  receive rate of past rounds that the adapter carries across rounds, never below ``floor_s``; see
  :meth:`FailureDetector.deadline_s`). Every round this replica commits is a sample, also one that left
  peers out: its rate then counts the wait for them, so the estimate errs low (longer deadlines) and
  never stays above what the link carries. A peer waited on is probed every ``floor_s / 2``.
* A peer is suspected once it shows no sign of life (a message, an acknowledged send, an answered probe)
  for a whole limit past the wait's start (it is **silent**: as good as dead), or, answering probes but
  delivering nothing, after ``STUCK_FACTOR`` limits (it is **stuck**: alive, but the round goes on
  without it). A failed stream or a refused probe suspects a peer at once; the round does that itself.
  The round treats the two apart: it stops waiting for a peer's fin only once that peer is silent or
  gone, never because it is stuck (a live peer, honest but waiting on a liar, can look stuck).
* What others say is not evidence (:class:`Suspicion`): a peer that another one claims to be dead is
  probed, and held to be out only once this replica's own detection finds it so (the probe fails, or
  a deadline passes), or once more than ``max_liars`` distinct peers claim it. So with at most
  ``max_liars`` liars, every peer held to be out was found so by some honest replica's own detector,
  and one liar's gossip never puts an honest live peer out.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

# Per-wait limit = max(FLOOR_S, FACTOR * bytes expected / bandwidth EMA).
DEFAULT_FLOOR_S = 2.0
DEFAULT_FACTOR = 4.0
# Past its limit a peer is suspected once it shows no sign of life for another limit; one that keeps
# answering probes but delivers nothing is suspected after this many limits.
STUCK_FACTOR = 3
# Before the first measurement: a slow home uplink (20 Mbit/s), so the first deadlines are generous. (It was
# 20e6 B/s, 160 Mbit/s; and while only rounds that left no peer out were samples, an estimate above the
# link's rate could not come down: every round outlived its deadlines and none was a sample.)
INITIAL_BYTES_PER_S = 2.5e6
EMA_ALPHA = 0.3


@dataclass
class Bandwidth:
    """EMA of the receive rate a replica saw in its collective rounds; the adapter keeps one per stage."""

    bytes_per_s: float = INITIAL_BYTES_PER_S
    alpha: float = EMA_ALPHA
    num_samples: int = 0

    def observe(self, nbytes: int, seconds: float) -> None:
        if nbytes <= 0 or seconds <= 0:
            return
        sample = nbytes / seconds
        self.bytes_per_s = sample if self.num_samples == 0 else (1 - self.alpha) * self.bytes_per_s + self.alpha * sample
        self.num_samples += 1


class Wait(NamedTuple):
    """What one wait is on right now: the peers that still owe something, and its limit in seconds.
    ``silence_only``: only silence ends this wait (its peers are stuck already; only death is news)."""

    peers: list[str]
    limit_s: float
    silence_only: bool = False


class Due(NamedTuple):
    """What :meth:`FailureDetector.due` found: peers to probe, peers to suspect, and which of those are silent."""

    probes: list[str]
    suspects: set[str]
    silent: set[str]


@dataclass
class FailureDetector:
    """Tracks when each wait began and each peer's last sign of life; turns ``now`` into probes and suspects."""

    floor_s: float = DEFAULT_FLOOR_S
    factor: float = DEFAULT_FACTOR
    bandwidth: Bandwidth = field(default_factory=Bandwidth)
    _since: dict[Hashable, float] = field(default_factory=dict, init=False)  # wait key -> when it began
    _probed: dict[str, float] = field(default_factory=dict, init=False)
    _alive_at: dict[str, float] = field(default_factory=dict, init=False)

    def deadline_s(self, nbytes: int) -> float:
        """The limit for receiving ``nbytes`` at the measured rate (never below ``floor_s``)."""
        return max(self.floor_s, self.factor * nbytes / max(self.bandwidth.bytes_per_s, 1.0))

    def alive(self, peer: str, now: float) -> None:
        """``peer`` showed a sign of life: a message, an acknowledged send or an answered probe."""
        self._alive_at[peer] = now

    def track(self, keys: Iterable[Hashable], now: float) -> None:
        """The round waits on exactly ``keys`` now: new ones begin at ``now``, finished ones are dropped."""
        self._since = {k: self._since.get(k, now) for k in keys}

    def wait_keys(self) -> list[Hashable]:
        return list(self._since)

    def next_deadline(self, waits: Mapping[Hashable, Wait]) -> float | None:
        """When :meth:`due` next has something to do (a probe or a suspicion), or None."""
        times = []
        for key, since in self._since.items():
            w = waits[key]
            for peer in w.peers:
                times.append(self._silent_at(since, peer, w.limit_s))
                if not w.silence_only:
                    times.append(since + STUCK_FACTOR * w.limit_s)
                times.append(max(since, self._probed.get(peer, since)) + self.floor_s / 2)
        return min(times, default=None)

    def due(self, now: float, waits: Mapping[Hashable, Wait]) -> Due:
        """The peers to probe now, and the peers to suspect (past their deadline; never probed as well)."""
        pending = [(since, peer, waits[key]) for key, since in self._since.items() for peer in waits[key].peers]
        silent = {peer for since, peer, w in pending if now >= self._silent_at(since, peer, w.limit_s)}
        stuck = {peer for since, peer, w in pending if not w.silence_only and now >= since + STUCK_FACTOR * w.limit_s}
        dead = silent | stuck
        probes = []
        for since, peer, _ in pending:
            last = max(since, self._probed.get(peer, since))
            if peer not in dead and self._probed.get(peer) != now and now - last >= self.floor_s / 2:
                self._probed[peer] = now
                probes.append(peer)
        return Due(probes, dead, silent)

    def _silent_at(self, since: float, peer: str, limit: float) -> float:
        # No sign of life for a whole limit (since the wait began, or since its last one).
        return max(since, self._alive_at.get(peer, since)) + limit


@dataclass
class Suspicion:
    """The peers this replica holds to be out of a round (``out``), and who claimed what.

    ``out`` grows two ways: :meth:`observed` (this replica's own evidence: a failed stream, a refused or
    unanswered probe, a passed deadline) and :meth:`claimed`, which counts each claimant once per
    suspect and puts a suspect out only once more than ``max_liars`` distinct peers claim it.
    """

    max_liars: int = 1
    out: set[str] = field(default_factory=set)
    _claims: dict[str, set[str]] = field(default_factory=dict, init=False)

    def observed(self, peer: str) -> bool:
        """This replica found ``peer`` dead itself; True if that is news."""
        if peer in self.out:
            return False
        self.out.add(peer)
        return True

    def claimed(self, claimant: str, suspects: Sequence[str]) -> tuple[list[str], list[str]]:
        """``claimant`` says ``suspects`` are dead: returns (now out, to probe). A peer is probed once per
        new claimant, so a liar repeating itself costs nothing and a second claimant gets a fresh look."""
        now_out, probe = [], []
        for x in suspects:
            if x == claimant or x in self.out:
                continue
            who = self._claims.setdefault(x, set())
            if claimant in who:
                continue
            who.add(claimant)
            if len(who) > self.max_liars:
                self.out.add(x)
                now_out.append(x)
            else:
                probe.append(x)
        return now_out, probe

    def claimants(self, peer: str) -> list[str]:
        return sorted(self._claims.get(peer, ()))
