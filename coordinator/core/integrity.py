"""Integrity reports: the coordinator checks a spot check's evidence itself and convicts (sans-IO).

A node that caught a neighbouring stage computing wrong sends :class:`~protolearn.protocol.coordination.IntegrityReport`
(see ``node/integrity.py``). The coordinator takes nobody's word:

- the reporter must be a live member of a stage next to the accused's (the one that received its
  output), and cannot report itself;
- with evidence (``protocol/boundary.py``), every signer but the accused must be a live member the
  coordinator assigned to the accused's stage (its own record, never a heartbeat's claim of the stage a
  node serves), other than the reporter and none banned, and :func:`~protolearn.protocol.boundary.verify_evidence` must pass: the three signatures
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
from collections.abc import Callable
from dataclasses import dataclass, field

from protolearn.coordinator.core.members import Member
from protolearn.coordinator.core.registry import Registry
from protolearn.coordinator.core.run import RunInfo
from protolearn.coordinator.core.verdicts import VerdictPolicy
from protolearn.coordinator.errors import Refusal
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
    # target → reporter → what the reporter's checks found of it (each heartbeat replaces the reporter's list).
    checks: dict[str, dict[str, cm.PeerCheck]] = field(default_factory=dict)
    _checked_by: dict[str, set[str]] = field(default_factory=dict)

    def observe_checks(self, reporter: str, checks: list[cm.PeerCheck]) -> None:
        """Record ``reporter``'s heartbeat view of its checks (a claim: shown as the median, never acted on)."""
        for target in self._checked_by.pop(reporter, set()):
            by = self.checks.get(target)
            if by is not None:
                by.pop(reporter, None)
                if not by:
                    del self.checks[target]
        if not checks:
            return
        for c in checks:
            if c.peer_id != reporter:
                self.checks.setdefault(c.peer_id, {})[reporter] = c
        self._checked_by[reporter] = {c.peer_id for c in checks if c.peer_id != reporter}

    def forget(self, peer: str) -> None:
        """``peer`` left: its reports of others go (what others report of it stays until they report again)."""
        self.observe_checks(peer, [])

    def summary(self, peer: str, live: Callable[[str], bool]) -> tuple[float | None, str, int, int]:
        """(median score, majority probation state, checks passed, failed) as ``peer``'s live checkers report."""
        reports = [c for r, c in self.checks.get(peer, {}).items() if live(r)]
        if not reports:
            return None, "", 0, 0
        scores = sorted(c.score for c in reports)
        states = Counter(c.state for c in reports)
        (state, n), = states.most_common(1)
        if 2 * n <= len(reports):
            state = "probation"
        return scores[(len(scores) - 1) // 2], state, sum(c.passed for c in reports), sum(c.failed for c in reports)

    def restore(self, records: list[EvidenceRecord]) -> None:
        self.against = Counter(r.accused for r in records)
        self.filed = Counter(r.reporter for r in records)
        self.dirty.clear()

    def drain(self) -> list[EvidenceRecord]:
        out, self.dirty = self.dirty, []
        return out

    def report(self, reporter: str, msg: cm.IntegrityReport, now: float, frontier: int) -> tuple[bool, str]:
        """Judge ``msg`` from ``reporter``: (ban, reason). A malformed report, or evidence that does not
        hold, raises :class:`~protolearn.coordinator.errors.Refusal`."""
        target = msg.target
        if target == reporter:
            raise Refusal("bad_report", "a peer cannot report itself")
        accused = self.registry.members.get(target)
        me = self.registry.members.get(reporter)
        if accused is None or me is None:
            raise Refusal("unknown_peer", f"{target} is not a member of this swarm")
        banned = self.verdicts.already_banned(target)
        if banned is not None:
            return True, banned.reason
        stages = accused.stages
        if msg.reducer_fault is not None:
            return self._reducer_fault(reporter, me, msg, stages, now)
        if not any(abs(m - s) == 1 for m in me.stages for s in stages):
            raise Refusal("bad_report", "only a stage next to the accused's receives its outputs and can check them")
        ev = msg.evidence
        if ev is None:
            self.verdicts.flag(target, "integrity", f"{reporter[-8:]}: {msg.reason}", now)
            self._record(EvidenceRecord(now, reporter, target, -1, "flag", msg.reason))
            return False, f"{target} flagged: a report without evidence never bans"
        if ev.accused != target or ev.stage not in stages:
            raise Refusal("bad_evidence", f"the evidence accuses {ev.accused[-8:]} of stage {ev.stage}, not {target[-8:]} of its stage")
        if ev.step >= frontier + 1:
            raise Refusal("bad_evidence", f"step {ev.step} has not started")
        for out in ev.outputs:
            # Roles come from the coordinator's own records: a live member it assigned to the stage, never a
            # heartbeat's claim of the stage it serves, a departed member, or the reporter (issue 27).
            if out.signer != target and not self.registry.assigned(out.signer, ev.stage) or out.signer == reporter:
                raise Refusal("bad_evidence", f"signer {out.signer[-8:]} is not a replica of stage {ev.stage} "
                                              "(a live member the coordinator assigned to it, other than the reporter)")
            if out.signer != target and self.verdicts.is_banned(out.signer):
                raise Refusal("bad_evidence", f"signer {out.signer[-8:]} is banned: its output counts for nothing")
        from protolearn.protocol.boundary import verify_evidence  # loads torch: only when evidence comes
        from protolearn.subspace import make_subspace

        n = 1
        for d in self.run.boundary_shape:
            n *= d
        try:
            why = verify_evidence(
                ev, run_hash=self.run.run_hash, codec=self.run.codec, check_tolerance=self.run.check_tolerance,
                shape=list(self.run.boundary_shape), verify=verify_peer, limits=TensorLimits(max_elements=n, max_bytes=8 * n + 4096),
                subspace=None if self.run.subspace is None else make_subspace(*self.run.subspace), precisions=self.run.precisions,
            )
        except ProtocolError as err:
            raise Refusal("bad_evidence", err.reason) from None
        return self._convict(reporter, target, ev.step, why, hashlib.sha256(encode(ev)).hexdigest(), now)

    def _reducer_fault(self, reporter: str, me: Member, msg: cm.IntegrityReport, stages: set[int], now: float) -> tuple[bool, str]:
        """A replica of the reporter's own stage signed a wrong reduced part: checked by recomputing it."""
        ev = msg.reducer_fault
        assert ev is not None
        target = msg.target
        if ev.reducer != target or not me.stages & stages:
            raise Refusal("bad_evidence", "a reducer's proof accuses a replica of the reporter's own stage")
        for peer in {s.peer for s in ev.slices}:
            m = self.registry.members.get(peer)
            if m is None or not m.stages & stages:
                raise Refusal("bad_evidence", f"slice signer {peer[-8:]} is not a replica of the reducer's stage")
        from protolearn.protocol.reducer_check import peer_id_public_key, verify_reducer_fault

        ok, why = verify_reducer_fault(ev, peer_id_public_key, aggregation_cfg=self.run)
        if not ok:
            raise Refusal("bad_evidence", why)
        why = f"collective: it signed part {ev.part} of round {ev.round} with bytes that are not the reduction of the slices it was sent ({why})"
        return self._convict(reporter, target, ev.round, why, hashlib.sha256(encode(ev)).hexdigest(), now)

    def _convict(self, reporter: str, target: str, step: int, why: str, digest: str, now: float) -> tuple[bool, str]:
        """Verified evidence: ban ``target`` (or only flag it where integrity bans are off) and record it."""
        if not self.enabled:
            self.verdicts.flag(target, "integrity", why, now)
            self._record(EvidenceRecord(now, reporter, target, step, "flag", why, digest))
            return False, f"{target} convicted, but integrity bans are off: {why}"
        ban = self.verdicts.ban(target, f"integrity: {why} (reported by {reporter[-8:]})", now)
        self._record(EvidenceRecord(now, reporter, target, step, "ban", why, digest))
        log.warning("integrity conviction peer=%s reporter=%s step=%d reason=%s", target, reporter, step, why)
        return True, ban.reason

    def _record(self, r: EvidenceRecord) -> None:
        self.against[r.accused] += 1
        self.filed[r.reporter] += 1
        self.dirty.append(r)
