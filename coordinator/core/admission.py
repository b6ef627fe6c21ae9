"""Admission: who may ask the coordinator anything, and the count of what it refused (sans-IO).

Every request passes the per-peer rate limit (``ratelimit.py``) and the ban check before it is looked
at (:meth:`Admission.admit`); most also need the sender to be a live member
(:meth:`Admission.live_member`). A refused request raises :class:`~protolearn.coordinator.errors.Refusal`
(a code and a reason) and leaves the state unchanged. Each refusal is counted by its code for the
metrics (:attr:`Admission.refusals`): those the core raises, through :func:`counted` on its entry
points, and those an adapter raises itself (:meth:`Admission.refuse`, e.g. the service's ``busy``).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Concatenate, ParamSpec, Protocol, TypeVar

from protolearn.coordinator.config import CoordinatorSettings
from protolearn.coordinator.core.members import LIVE, Member
from protolearn.coordinator.core.ratelimit import RateLimiter
from protolearn.coordinator.core.registry import Registry
from protolearn.coordinator.core.verdicts import VerdictPolicy
from protolearn.coordinator.errors import Refusal

P = ParamSpec("P")
R = TypeVar("R")


class Admission:
    """The rate limit, the ban and membership checks, and the refusals counted by code."""

    def __init__(self, settings: CoordinatorSettings, registry: Registry, verdicts: VerdictPolicy) -> None:
        self.settings = settings
        self.registry = registry
        self.verdicts = verdicts
        self.limiter = RateLimiter(settings.rate_per_s, settings.rate_burst, max_peers=settings.max_members * 2)
        self.refusals: dict[str, int] = {}

    def admit(self, peer: str, now: float) -> None:
        """Rate limit and ban check, done before any request is looked at."""
        if not self.limiter.allow(peer, now):
            raise Refusal("rate_limited", f"over the limit of {self.settings.rate_per_s:g} requests/s; slow down")
        if self.verdicts.is_banned(peer):
            raise Refusal("banned", f"banned: {self.verdicts.bans[peer].reason}")

    def live_member(self, peer: str) -> Member:
        """``peer``'s entry if it is a live member; else the refusal that tells it to join first."""
        m = self.registry.members.get(peer)
        if m is None or m.status != LIVE:
            state = "has not joined" if m is None else f"is {m.status}"
            raise Refusal("not_member", f"{peer} {state}; join first")
        return m

    def count(self, refusal: Refusal) -> None:
        self.refusals[refusal.code] = self.refusals.get(refusal.code, 0) + 1

    def refuse(self, code: str, reason: str) -> Refusal:
        """A refusal an adapter raises itself, counted like the core's."""
        refusal = Refusal(code, reason)
        self.count(refusal)
        return refusal


class _Admitting(Protocol):
    admission: Admission


S = TypeVar("S", bound=_Admitting)


def counted(method: Callable[Concatenate[S, P], R]) -> Callable[Concatenate[S, P], R]:
    """Count each :class:`~protolearn.coordinator.errors.Refusal` that ``method`` raises (the method of
    an object holding an :class:`Admission` as ``admission``) before it propagates."""

    @functools.wraps(method)
    def counting(self: S, *args: P.args, **kwargs: P.kwargs) -> R:
        try:
            return method(self, *args, **kwargs)
        except Refusal as refusal:
            self.admission.count(refusal)
            raise

    return counting
