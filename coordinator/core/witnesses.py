"""Who recomputes a spot-checked output: the coordinator draws the witnesses, never the accuser (sans-IO).

A node that spot-checks a replica A of stage s asks the coordinator for witnesses
(:class:`~protolearn.protocol.coordination.WitnessDraw`). The coordinator draws them from its own records (the
live members it assigned to s, other than A and the reporter, none banned) and remembers the draw. Evidence
convicts A only if its other signers are exactly that draw, every one of them agreeing with the others and
disagreeing with A (``integrity.py``). So a reporter cannot pick colluding witnesses, and a witness that refuses
to answer cannot make a conviction either.

The draw ranks the eligible replicas by HMAC(key, run, step, ticket, direction, accused, peer) with the
coordinator's secret key: nobody else can predict it, and asking again for the same check gives the same draw
(no re-rolling). It takes :func:`needed` of them: a strict majority of the eligible replicas, at least 2 and at
most :data:`MAX_WITNESSES`. So with f colluders among n eligible replicas a frame needs all the drawn ones to be
colluders: impossible while f < needed(n), which holds whenever the colluders are a minority of the stage and
the stage has at most 2·MAX_WITNESSES replicas; past that the chance per check is :func:`framing_chance`.
"""

from __future__ import annotations

import hashlib
import hmac
import math
from collections import OrderedDict
from collections.abc import Iterable

from protolearn.protocol.boundary import MAX_WITNESSES

# Draws the coordinator remembers, oldest forgotten first (a check's evidence comes within seconds of its draw).
MAX_DRAWS = 4096

DrawKey = tuple[str, str, int, int, str]  # (reporter, accused, step, ticket, direction)


def witness_key(secret: bytes) -> bytes:
    """The draw's key, derived from the coordinator's secret (the lease-nonce key) so the two never coincide."""
    return hmac.new(secret, b"protolearn/witness-draw", hashlib.sha256).digest()



def needed(eligible: int) -> int:
    """Witnesses a conviction needs when ``eligible`` replicas could be drawn: a strict majority, 2 to 8."""
    return min(MAX_WITNESSES, max(2, eligible // 2 + 1))


def draw(key: bytes, run_hash: str, step: int, ticket: int, direction: str, accused: str, eligible: Iterable[str]) -> list[str]:
    """The witnesses for the check of ``accused``'s (step, ticket, direction) output: ``needed(len(eligible))`` of
    ``eligible`` (all of them when there are fewer), ranked by the keyed hash."""
    peers = sorted(set(eligible))
    head = f"{run_hash}|{step}|{ticket}|{direction}|{accused}|".encode()
    ranked = sorted(peers, key=lambda p: hmac.new(key, head + p.encode(), hashlib.sha256).digest())
    return ranked[: needed(len(peers))]


def framing_chance(eligible: int, colluders: int) -> float:
    """The chance that one draw among ``eligible`` replicas holds only colluders (so a frame could stand)."""
    k = needed(eligible)
    if colluders < k or eligible < 2:
        return 0.0
    return math.comb(colluders, k) / math.comb(eligible, k)


class Draws:
    """The draws handed out lately, so evidence is judged against the draw its reporter was given."""

    def __init__(self, key: bytes, limit: int = MAX_DRAWS) -> None:
        self.key = key
        self.limit = limit
        self._draws: OrderedDict[DrawKey, tuple[str, ...]] = OrderedDict()

    def give(self, run_hash: str, reporter: str, accused: str, step: int, ticket: int, direction: str, eligible: Iterable[str]) -> tuple[str, ...]:
        """The draw for ``reporter``'s check of ``accused``: the one handed out before for the same check, if any."""
        k = (reporter, accused, step, ticket, direction)
        got = self._draws.get(k)
        if got is None:
            got = tuple(draw(self.key, run_hash, step, ticket, direction, accused, eligible))
            self._draws[k] = got
            while len(self._draws) > self.limit:
                self._draws.popitem(last=False)
        return got

    def given(self, reporter: str, accused: str, step: int, ticket: int, direction: str) -> tuple[str, ...] | None:
        return self._draws.get((reporter, accused, step, ticket, direction))
