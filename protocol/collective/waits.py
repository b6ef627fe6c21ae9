"""What a collective replica waits on, and on whom: the waits it hands its failure detector.

The failure detector (:mod:`.liveness`) knows waits only by key and the time each began; this module
says which waits a round has at a moment and which peers still owe each one, from what the replica
holds. A key names what is awaited:

* ``("own", j)``: this replica owns part ``j`` and lacks the slices of contributors in ``C`` it does not
  hold out. It waits one phase's limit (:meth:`~.round.CollectiveRound.wait_s`).
* ``("gather", j, o)``: part ``j`` has no counting part over ``C`` yet, and ``o`` owns it here.
* ``("check", j, c)``: a checker (or an owner relaying a dead owner's part) of a counting part that
  another peer signed lacks contributor ``c``'s slice to recompute it.
* ``("fin", p)``: this replica committed and lacks ``p``'s fin. It is waited for until it comes or
  ``p`` is dead; once ``p`` is held out (stuck, or claimed dead) only its silence ends the wait.

Every wait but an owner's lasts two limits: its peer may itself be waiting on an owner. An owner's wait
on nobody (every missing contributor is held out) is no wait at all.
"""

from __future__ import annotations

from collections.abc import Collection, Hashable, Mapping
from dataclasses import dataclass

import torch

from protolearn.protocol.collective.fins import FinBook
from protolearn.protocol.collective.liveness import FailureDetector, Wait
from protolearn.protocol.collective.ownership import checker, owner
from protolearn.protocol.collective.part_ledger import PartLedger
from protolearn.protocol.collective.spec import RoundSpec


@dataclass
class Waits:
    """The waits of one round at one replica. It reads the round's collections, which the round keeps
    up to date: ``slices`` (part -> contributor -> slice), ``suspects`` (held out) and ``dead``."""

    spec: RoundSpec
    detector: FailureDetector
    ledger: PartLedger
    fins: FinBook
    slices: Mapping[int, Mapping[str, torch.Tensor]]
    suspects: Collection[str]
    dead: Collection[str]

    def owing(self, key: Hashable, members: frozenset[str]) -> list[str]:
        """The peers that still owe what ``key`` waits for, with ``members`` the round's C."""
        assert isinstance(key, tuple)
        if key[0] == "own":
            held = self.slices.get(key[1], {})
            return sorted(c for c in members if c not in held and c not in self.suspects)
        if key[0] == "fin":
            return [key[1]] if key[1] not in self.dead else []
        return [key[-1]] if key[-1] not in self.suspects else []

    def current(self, members: frozenset[str], wait_s: float) -> dict[Hashable, Wait]:
        """Each tracked wait with its peers and limit (``wait_s``: one phase's limit)."""
        waits = {}
        for key in self.detector.wait_keys():
            assert isinstance(key, tuple)
            waits[key] = Wait(self.owing(key, members), wait_s * (1 if key[0] == "own" else 2), key[0] == "fin" and key[1] in self.suspects)
        return waits

    def track(self, members: frozenset[str], committed: bool, now: float) -> None:
        """Tell the detector what this replica waits on now (a deadline counts from a wait's start)."""
        peers, me, out = self.spec.peers, self.spec.me, self.suspects
        waits: set[tuple] = set()
        for j in range(len(peers)):
            if self.ledger.counted(j, members) is not None:
                continue
            o = owner(peers, j, out, me)
            waits.add(("own", j) if o == me else ("gather", j, o))
        if committed:
            waits.update(("fin", p) for p in peers if p != me and p not in self.dead and p not in self.fins)
        elif self.spec.cross_check:  # a part to check waits for the slices it was reduced from
            for j in range(len(peers)):
                p = self.ledger.counted(j, members)
                if p is not None and p.signer != me and me in (owner(peers, j, out, me), checker(peers, j, out, me)):
                    held = self.slices.get(j, {})
                    waits.update(("check", j, c) for c in members if c not in held and c != me)
        self.detector.track((k for k in waits if self.owing(k, members) or k[0] != "own"), now)

    def missing(self, members: frozenset[str]) -> list[str]:
        """Peers this replica is waiting on right now."""
        return sorted({p for key in self.detector.wait_keys() for p in self.owing(key, members)})
