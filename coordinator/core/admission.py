"""Admission: who may ask the coordinator anything, and the count of what it refused (sans-IO).

Every request passes the per-peer rate limit (``ratelimit.py``) and the ban check before it is looked
at (:meth:`Admission.admit`); most also need the sender to be a live member
(:meth:`Admission.live_member`); a join must also be the only process with its identity
(:meth:`Admission.one_identity`, by the sessions it names) and compute in a precision the run admits (:meth:`Admission.precision`). A refused request raises :class:`~protolearn.coordinator.errors.Refusal`
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
from protolearn.protocol import coordination as cm

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

    def one_identity(self, peer: str, own_peer_id: str, connections: int, msg: cm.Join) -> bool:
        """Refuse a join that would put one identity in two processes; True: the join replaces ``peer``'s
        live entry, which is to be taken back first (as a leave would).

        A peer ID in two processes gets the other's streams (libp2p keys connections by peer ID), so its
        peers cannot tell them apart. The coordinator's own peer ID is refused. A live member's identity
        joins again only by proof that it is that member's process or its successor, never because a
        connection happened to be down: the join carries the member's own session (its reply was lost),
        or names it as its ``previous_session`` (the process that restarted on the member's data dir, whose
        lock says the member's process ended). Any other join of a live member is a second process with
        its key (a copied key, or a copied data dir whose original runs on) and is refused, as is one
        while another connection with the identity is open; a member that really died expires, and then
        its identity joins as any departed one. A join without a session is answered ``already_joined``.
        """
        if peer == own_peer_id:
            raise Refusal(
                "own_identity", "this node runs with the coordinator's own identity key (it was started with the coordinator's "
                "data dir, or --name coordinator); give it its own --data-dir or --name",
            )
        old = self.registry.members.get(peer)
        if old is None or old.status != LIVE:
            return False
        ours = msg.session != "" and msg.session == old.session
        successor = msg.previous_session != "" and msg.previous_session == old.session
        if ours or (successor and connections <= 1):
            return True
        if not msg.session and connections <= 1:
            return False
        raise Refusal(
            "identity_in_use", f"another process with this node's identity is a live member (stage {old.stage}): one identity "
            "runs in one process; stop the other one, or give this node its own --data-dir or --name (a node restarted on "
            f"another data dir joins once the coordinator expires the old one, {self.settings.expiry_s:g} s after its last heartbeat)",
        )

    @staticmethod
    def precision(declared: str, admitted: tuple[str, ...]) -> None:
        """Refuse a joiner computing in a precision the run does not admit (protolearn/precision.py): its
        outputs could be further from the others' than the run's tolerance allows."""
        if declared not in admitted:
            flag = "with --bf16" if "bf16" in admitted else "without --bf16"
            raise Refusal(
                "precision", f"this run admits only {' and '.join(admitted)} (its integrity.precisions) and this node "
                f"computes in {declared}: join {flag}",
            )

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
