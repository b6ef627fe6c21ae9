"""How often a receiver spot-checks a peer: trust earned by passed checks, lost by one failure.

DESIGN.md "Integrity": a newcomer is spot-checked on every microbatch it serves; each ``half_life``
checks it passes halve that rate, down to the run's floor ``rate`` (``integrity.spot_check_rate``),
where it is *trusted*. One failed check sends it back to rate 1.0 in state *failed*, which it leaves
only after passing ``half_life`` checks in a row (then it is on probation again, decaying from 1.0).
A peer that a boundary monitor (:mod:`~protolearn.protocol.monitors`) suspects is checked every time,
whatever its rate, so a trusted peer that starts lying is caught on its next microbatch.

The policy is sans-IO: the caller asks :meth:`SpotCheckPolicy.should_check` per microbatch, runs (or
asks a replica to run) the recomputation, and reports :meth:`~SpotCheckPolicy.passed` or
:meth:`~SpotCheckPolicy.failed`. The random draw comes from the injected ``random.Random``, so a test
or simulator replays the same checks.

Why this is safe to forget: an unknown peer is a newcomer at rate 1.0, the strictest rate, so the
memory bound (``max_peers``; the least recently used peer is dropped) can only make a peer checked
more often, never less.
"""

from __future__ import annotations

import random
from collections import OrderedDict
from dataclasses import dataclass

MAX_PEERS = 4096
# Below this a decayed rate counts as having reached a floor of 0 (a run that disabled spot checks).
MIN_RATE = 2.0**-20


@dataclass
class _Record:
    passes: int = 0  # checks passed since the last failure (or since first seen)
    failed: bool = False  # failed, and not yet ``half_life`` passes since


class SpotCheckPolicy:
    """Per-peer spot-check rate: 1.0 for a newcomer, halving every ``half_life`` passes, never below ``rate``."""

    def __init__(self, *, rate: float, half_life: int, rng: random.Random, max_peers: int = MAX_PEERS) -> None:
        if not 0.0 <= rate <= 1.0:
            raise ValueError(f"rate={rate} must be in [0, 1]")
        if half_life < 1:
            raise ValueError(f"half_life={half_life} must be >= 1")
        if max_peers < 1:
            raise ValueError(f"max_peers={max_peers} must be >= 1")
        self.floor = rate
        self.half_life = half_life
        self.max_peers = max_peers
        self._rng = rng
        self._peers: OrderedDict[str, _Record] = OrderedDict()

    def _decayed(self, rec: _Record) -> float:
        halvings = rec.passes // self.half_life
        return 0.5**halvings if halvings < 64 else 0.0

    def rate(self, peer: str) -> float:
        """The probability that a microbatch from ``peer`` is spot-checked (1.0 for a peer not remembered)."""
        rec = self._peers.get(peer)
        if rec is None or rec.failed:
            return 1.0
        return max(self.floor, self._decayed(rec))

    def state(self, peer: str) -> str:
        """``"failed"`` (failed its last ``half_life`` checks' worth), ``"trusted"`` (at the floor) or ``"probation"``."""
        rec = self._peers.get(peer)
        if rec is None:
            return "probation"
        if rec.failed:
            return "failed"
        return "trusted" if self._decayed(rec) <= max(self.floor, MIN_RATE) else "probation"

    def should_check(self, peer: str, *, suspect: bool = False) -> bool:
        """Draw whether to spot-check this microbatch of ``peer``; always for a monitor ``suspect``."""
        r = 1.0 if suspect else self.rate(peer)
        if r >= 1.0:
            return True
        return self._rng.random() < r

    def passed(self, peer: str) -> None:
        rec = self._touch(peer)
        rec.passes += 1
        if rec.failed and rec.passes >= self.half_life:
            rec.failed = False
            rec.passes = 0  # on probation again, from rate 1.0

    def failed(self, peer: str) -> None:
        rec = self._touch(peer)
        rec.passes = 0
        rec.failed = True

    def forget(self, peer: str) -> None:
        self._peers.pop(peer, None)

    def __len__(self) -> int:
        return len(self._peers)

    def _touch(self, peer: str) -> _Record:
        rec = self._peers.pop(peer, None)
        if rec is None:
            rec = _Record()
        self._peers[peer] = rec  # most recently used last
        while len(self._peers) > self.max_peers:
            self._peers.popitem(last=False)
        return rec
