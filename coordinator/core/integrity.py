"""Integrity reports: the coordinator checks a spot check's evidence itself and convicts (sans-IO).

A node that caught a neighbouring stage computing wrong sends :class:`~protolearn.protocol.coordination.IntegrityReport`
(see ``node/integrity.py``). The coordinator takes nobody's word:

- the reporter must be a live member of a stage next to the accused's (the one that received its
  output), and cannot report itself;
- the witnesses that recompute the checked output are the coordinator's draw (:meth:`IntegrityDesk.witnesses`,
  ``witnesses.py``), never the reporter's choice: evidence of a mismatch must hold the output of every drawn
  witness and of nobody else, each still a live member the coordinator assigned to the accused's stage (its
  own record, never a heartbeat's claim of the stage a node serves), none banned;
- :func:`~protolearn.protocol.boundary.verify_evidence` must pass: every signature over the same inputs, the
  witnesses' outputs within tolerance of each other and the accused's beyond it (or one signed tensor with
  NaN/Inf). Then the accused is banned with the reason (``integrity_bans``, on by default): a conviction
  rests on a strict majority of the other replicas recomputing what it signed, or on its own signature;
- without evidence (too few replicas to draw from, a witness that did not answer) the report is a claim: an ``integrity`` flag
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
from protolearn.coordinator.core.witnesses import Draws
from protolearn.coordinator.errors import Refusal
from protolearn.protocol import coordination as cm
from protolearn.protocol.boundary import OutputEvidence
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
    # The coordinator's secret for drawing witnesses (witnesses.py); "" in tests that never draw.
    key: bytes = b""
    # peer → evidence records against it / filed by it (status); records not yet persisted.
    against: Counter[str] = field(default_factory=Counter)
    filed: Counter[str] = field(default_factory=Counter)
    dirty: list[EvidenceRecord] = field(default_factory=list)
    # target → reporter → what the reporter's checks found of it (each heartbeat replaces the reporter's list).
    checks: dict[str, dict[str, cm.PeerCheck]] = field(default_factory=dict)
    _checked_by: dict[str, set[str]] = field(default_factory=dict)
    draws: Draws = field(init=False)

    def __post_init__(self) -> None:
        self.draws = Draws(self.key)

    def witnesses(self, reporter: str, msg: cm.WitnessDraw, frontier: int) -> cm.WitnessDrawReply:
        """The replicas ``reporter`` must ask to recompute ``msg.target``'s output (witnesses.py): drawn from the
        live replicas of the target's stage other than the target and the reporter, none banned."""
        accused, me = self._pair(reporter, msg.target)
        if msg.step >= frontier + 1:
            raise Refusal("bad_step", f"step {msg.step} has not started")
        if self.run.outer is not None and msg.step % self.run.outer.inner_steps:
            # DiLoCo: replicas share weights only on the first inner step after an outer sync; no other step is checkable.
            raise Refusal("not_checkable", f"step {msg.step} is not the first inner step after an outer sync; replicas differ there")
        if self.verdicts.is_banned(msg.target):
            return cm.WitnessDrawReply(witnesses=[])
        stage = accused.stage
        if not any(abs(m - stage) == 1 for m in me.stages):
            raise Refusal("bad_report", "only a stage next to the checked one receives its outputs and can check them")
        # Replicas that train at this stage now (they hold its weights) and that the coordinator assigned to it
        # (its own record, never a heartbeat's claim of the stage a node serves).
        eligible = [
            p for p in self.registry.serving(stage)
            if p not in (msg.target, reporter) and self.registry.assigned(p, stage) and not self.verdicts.is_banned(p)
        ]
        got = self.draws.give(self.run.run_hash, reporter, msg.target, msg.step, msg.ticket, msg.direction, eligible)
        return cm.WitnessDrawReply(witnesses=list(got))

    def _pair(self, reporter: str, target: str) -> tuple[Member, Member]:
        if target == reporter:
            raise Refusal("bad_report", "a peer cannot report itself")
        accused = self.registry.members.get(target)
        me = self.registry.members.get(reporter)
        if accused is None or me is None:
            raise Refusal("unknown_peer", f"{target} is not a member of this swarm")
        return accused, me

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
        accused, me = self._pair(reporter, target)
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
        self._drawn(reporter, ev)
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

    def _drawn(self, reporter: str, ev: OutputEvidence) -> None:
        """Refuse evidence whose witnesses are not exactly the draw handed to ``reporter`` for this check, each
        still a live replica the coordinator assigned to the stage and not banned (one signer alone: NaN/Inf)."""
        witnesses = {o.signer for o in ev.outputs} - {ev.accused}
        if not witnesses:
            return
        drawn = self.draws.given(reporter, ev.accused, ev.step, ev.ticket, ev.direction)
        if drawn is None:
            raise Refusal("bad_evidence", f"no witness draw on record for this check of {ev.accused[-8:]}: ask for one (coord.witness_draw)")
        if witnesses != set(drawn):
            raise Refusal("bad_evidence", "the evidence's witnesses are not the ones the coordinator drew for this check")
        for w in witnesses:
            # Roles come from the coordinator's own records: a live member it assigned to the stage (issue 27).
            if not self.registry.assigned(w, ev.stage):
                raise Refusal("bad_evidence", f"witness {w[-8:]} is no longer a live replica of stage {ev.stage}")
            if self.verdicts.is_banned(w):
                raise Refusal("bad_evidence", f"witness {w[-8:]} is banned: its output counts for nothing")

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

        ok, why = verify_reducer_fault(ev, peer_id_public_key, aggregation_cfg=self.run, compression=self.run.sync_compression)
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
