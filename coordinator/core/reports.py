"""Reports against members: what the core checks itself before the verdict policy weighs a report (sans-IO).

A live member may report another one (:class:`~protolearn.protocol.coordination.Report`), for three
kinds of cause:

- with *evidence*: two statements the accused signed that contradict each other. The reporter's own
  signature proves nothing (it can sign anything: that once let one member ban every other), so both
  statements must verify against the *accused's* key and contradict each other
  (:func:`~protolearn.protocol.statements.contradiction`) before the policy counts the report as
  verified;
- of lost microbatches (a reason starting ``liveness:``, without evidence): the reported peer acked
  activations and never sent their gradient back. The policy weighs these by the stage before the
  target's (:meth:`~.verdicts.VerdictPolicy.liveness_report`);
- anything else: a claim, counted and shown, that never bans on its own word.

Integrity reports (:class:`~protolearn.protocol.coordination.IntegrityReport`) go to the integrity desk
(``integrity.py``), which checks their evidence by recomputing. Whatever bans, :class:`Reports` hands the
ban to ``apply_ban``, which frees the banned peer's tickets.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from protolearn.coordinator.core.integrity import IntegrityDesk
from protolearn.coordinator.core.registry import Registry
from protolearn.coordinator.core.verdicts import LIVENESS_REASON, VerdictPolicy
from protolearn.coordinator.errors import Refusal
from protolearn.protocol import coordination as cm
from protolearn.protocol.statements import contradiction

log = logging.getLogger("protolearn.coordinator")


class Reports:
    """Checks members' reports of each other and applies the bans they lead to."""

    def __init__(
        self,
        registry: Registry,
        verdicts: VerdictPolicy,
        integrity: IntegrityDesk,
        *,
        verify: Callable[[str, bytes, bytes], bool],
        apply_ban: Callable[[str, float], None],
    ) -> None:
        """``verify(peer, data, signature)``: whether ``peer`` signed ``data``; ``apply_ban(peer, now)``
        carries out a ban the policy decided (the registry and the ledger let the peer go)."""
        self.registry = registry
        self.verdicts = verdicts
        self.integrity = integrity
        self.verify = verify
        self.apply_ban = apply_ban

    def report(self, peer: str, msg: cm.Report, now: float) -> cm.ReportReply:
        """``peer``, a live member, reports ``msg.target`` (see the module docstring)."""
        if msg.target == peer:
            raise Refusal("bad_report", "a peer cannot report itself")
        if msg.target not in self.registry.members:
            raise Refusal("unknown_peer", f"{msg.target} is not a member of this swarm")
        if msg.evidence is None and msg.conflicting is None and msg.reason.startswith(LIVENESS_REASON):
            return self._liveness(peer, msg, now)
        verified = False
        if msg.evidence is not None or msg.conflicting is not None:
            a, b = msg.evidence, msg.conflicting
            if a is None or b is None:
                raise Refusal("bad_evidence", "evidence is two conflicting statements the target signed; one was sent")
            if not (self.verify(msg.target, a.data, a.signature) and self.verify(msg.target, b.data, b.signature)):
                raise Refusal("bad_evidence", "the evidence is not signed by the reported peer")
            if not contradiction(a.data, b.data):
                raise Refusal("bad_evidence", "the two signed statements do not contradict each other")
            verified = True
        v = self.verdicts.report(peer, msg.target, msg.reason, evidence_verified=verified, now=now)
        log.info("report reporter=%s target=%s verified=%s ban=%s reason=%s", peer, msg.target, verified, v.ban, v.reason)
        if v.ban:
            self.apply_ban(msg.target, now)
        return cm.ReportReply(banned=v.ban, reason=v.reason)

    def integrity_report(self, peer: str, msg: cm.IntegrityReport, now: float, frontier: int) -> cm.ReportReply:
        """``peer``, a live member, reports an integrity fault of ``msg.target`` (see ``integrity.py``)."""
        banned, reason = self.integrity.report(peer, msg, now, frontier)
        if banned and self.registry.is_live(msg.target):
            self.apply_ban(msg.target, now)
        return cm.ReportReply(banned=banned, reason=reason)

    def _liveness(self, peer: str, msg: cm.Report, now: float) -> cm.ReportReply:
        """``peer`` says microbatches it handed ``msg.target`` never came back (see verdicts.py)."""
        target = self.registry.members[msg.target]
        stage = target.serving_stage
        v = self.verdicts.liveness_report(
            peer, msg.target, msg.reason, target_stage=stage, upstream=self.registry.serving(stage - 1) if stage >= 1 else (), now=now,
            replicas=len(self.registry.serving(stage)), heard_s_ago=now - target.last_seen, lost=msg.lost,
        )
        log.info("liveness report reporter=%s target=%s ban=%s reason=%s", peer, msg.target, v.ban, v.reason)
        if v.ban and self.registry.is_live(msg.target):
            self.apply_ban(msg.target, now)
        return cm.ReportReply(banned=v.ban, reason=v.reason)
