"""Integrity reports: the coordinator checks a spot check's evidence itself and convicts (sans-IO).

A node that caught a neighbouring stage computing wrong sends :class:`~protolearn.protocol.coordination.IntegrityReport`
(see ``node/integrity.py``). The coordinator takes nobody's word:

- the reporter must be a live member of a stage next to the accused's (the one that received its
  output), and cannot report itself;
- with evidence (``protocol/boundary.py``), every signer must be a member of the accused's stage, none
  banned, and :func:`~protolearn.protocol.boundary.verify_evidence` must pass: the three signatures
  over the same inputs, the two other replicas' outputs within tolerance of each other and the
  accused's beyond it (or one signed tensor with NaN/Inf). Then the accused is banned with the reason
  (``integrity_bans``, on by default): a conviction rests on two independent recomputations it signed
  nothing of, or on its own signature;
- without evidence (no third replica to break a tie) the report is a claim: an ``integrity`` flag
  strike, shown in ``swarm status``, never a ban.

Every report that reaches a verdict is an :class:`EvidenceRecord`, persisted in the store with the
bans, so ``swarm status`` can show how much evidence each peer faced and filed after a restart too.
"""

from __future__ import annotations

import hashlib
import logging
from collections import Counter
from dataclasses import dataclass, field

from protolearn.coordinator.registry import Registry
from protolearn.coordinator.run import RunInfo
from protolearn.coordinator.verdicts import VerdictPolicy
from protolearn.protocol import coordination as cm
from protolearn.protocol.errors import ProtocolError
from protolearn.protocol.frames import TensorLimits
from protolearn.protocol.identity import verify_peer
from protolearn.protocol.wire import encode

log = logging.getLogger("protolearn.coordinator")


@dataclass(frozen=True)
class EvidenceRecord:
    at: float
    reporter: str
    accused: str
    step: int
    verdict: str  # "ban" | "flag"
    reason: str
    digest: str = ""  # sha256 of the evidence message, "" for a claim without


class IntegrityRefused(Exception):
    """The report is malformed or its evidence does not hold: (code, reason) for the refusal."""

    def __init__(self, code: str, reason: str) -> None:
        super().__init__(reason)
        self.code = code
        self.reason = reason


@dataclass
class IntegrityDesk:
    registry: Registry
    verdicts: VerdictPolicy
    run: RunInfo
    enabled: bool = True
    # peer → evidence records against it / filed by it (status); records not yet persisted.
    against: Counter[str] = field(default_factory=Counter)
    filed: Counter[str] = field(default_factory=Counter)
    dirty: list[EvidenceRecord] = field(default_factory=list)

    def restore(self, records: list[EvidenceRecord]) -> None:
        self.against = Counter(r.accused for r in records)
        self.filed = Counter(r.reporter for r in records)
        self.dirty.clear()

    def drain(self) -> list[EvidenceRecord]:
        out, self.dirty = self.dirty, []
        return out

    def report(self, reporter: str, msg: cm.IntegrityReport, now: float, frontier: int) -> tuple[bool, str]:
        """Judge ``msg`` from ``reporter``: (ban, reason). Raises :class:`IntegrityRefused`."""
        target = msg.target
        if target == reporter:
            raise IntegrityRefused("bad_report", "a peer cannot report itself")
        accused = self.registry.members.get(target)
        me = self.registry.members.get(reporter)
        if accused is None or me is None:
            raise IntegrityRefused("unknown_peer", f"{target} is not a member of this swarm")
        if self.verdicts.is_banned(target):
            return True, f"{target} is already banned: {self.verdicts.bans[target].reason}"
        stages = {accused.stage, accused.serving} - {-1}
        if not any(abs(me.stage - s) == 1 or abs(me.serving - s) == 1 for s in stages):
            raise IntegrityRefused("bad_report", "only a stage next to the accused's receives its outputs and can check them")
        ev = msg.evidence
        if ev is None:
            self.verdicts.flag(target, "integrity", f"{reporter[-8:]}: {msg.reason}", now)
            self._record(EvidenceRecord(now, reporter, target, -1, "flag", msg.reason))
            return False, f"{target} flagged: a report without evidence never bans"
        if ev.accused != target or ev.stage not in stages:
            raise IntegrityRefused("bad_evidence", f"the evidence accuses {ev.accused[-8:]} of stage {ev.stage}, not {target[-8:]} of its stage")
        if ev.step >= frontier + 1:
            raise IntegrityRefused("bad_evidence", f"step {ev.step} has not started")
        for out in ev.outputs:
            m = self.registry.members.get(out.signer)
            if m is None or ev.stage not in (m.stage, m.serving):
                raise IntegrityRefused("bad_evidence", f"signer {out.signer[-8:]} is not a replica of stage {ev.stage}")
            if out.signer != target and self.verdicts.is_banned(out.signer):
                raise IntegrityRefused("bad_evidence", f"signer {out.signer[-8:]} is banned: its output counts for nothing")
        from protolearn.protocol.boundary import verify_evidence  # loads torch: only when evidence comes

        n = 1
        for d in self.run.boundary_shape:
            n *= d
        try:
            why = verify_evidence(
                ev, run_hash=self.run.run_hash, codec=self.run.codec, check_tolerance=self.run.check_tolerance,
                shape=list(self.run.boundary_shape), verify=verify_peer, limits=TensorLimits(max_elements=n, max_bytes=8 * n + 4096),
            )
        except ProtocolError as err:
            raise IntegrityRefused("bad_evidence", err.reason) from None
        digest = hashlib.sha256(encode(ev)).hexdigest()
        if not self.enabled:
            self.verdicts.flag(target, "integrity", why, now)
            self._record(EvidenceRecord(now, reporter, target, ev.step, "flag", why, digest))
            return False, f"{target} convicted, but integrity bans are off: {why}"
        ban = self.verdicts.ban(target, f"integrity: {why} (reported by {reporter[-8:]})", now)
        self._record(EvidenceRecord(now, reporter, target, ev.step, "ban", why, digest))
        log.warning("integrity conviction peer=%s reporter=%s step=%d reason=%s", target, reporter, ev.step, why)
        return True, ban.reason

    def _record(self, r: EvidenceRecord) -> None:
        self.against[r.accused] += 1
        self.filed[r.reporter] += 1
        self.dirty.append(r)
