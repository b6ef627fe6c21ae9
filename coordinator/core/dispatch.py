"""The coordinator's request dispatch: one sans-IO object that turns (peer, request, now) into a reply.

:class:`CoordinatorCore` ties the parts of the core together: the registry (``registry.py``), the ticket
ledger and its commit barrier (``tickets.py``, ``commit.py``), the verdict policy (``verdicts.py``), the
reports desk (``reports.py``), the lease discipline (``leases.py``), the redo budget (``redo.py``), the
reachability decisions (``reachability.py``), the finished run's final model (``final_model.py``) and the
rate limiter. Every request passes the per-peer
rate limit and the ban check first; a refused request raises :class:`~protolearn.coordinator.errors.Refusal`
(code + reason), counted by code for the metrics, and leaves the state unchanged. The service
(``coordinator/service.py``) is a thin trio adapter: it calls :meth:`CoordinatorCore.handle` with the
wall clock, persists :meth:`~CoordinatorCore.drain` into SQLite, and runs the long poll of ``WaitStep``
on top of :meth:`~CoordinatorCore.step_info`.

Departures cost tickets: when a member leaves, expires or is banned, the open step's tickets it
leased *or that were routed through it* are freed, because the gradients it accumulated for them are
gone (or untrusted), and they are redone by others (I1). A member whose connection to the coordinator
closed (it died) and stays closed for ``disconnect_grace_s`` has its leases ended at once rather than
at their expiry, so another stage-0 replica picks its tickets up within about a second; the service
passes those connection events in with ``now``.

Requests that could stall or corrupt a step are bounded (issue 12): redos per peer and step
(``redo.py``), reopenings per step (``max_revisions``, ``tickets.py``), and a stage-0 member's hold on its
leases (``leases.py``, which also expels a member that sits on them while others progress: issue 11). A
completion needs the last stage's signed acknowledgement of its route and loss (``bad_ack``,
``protocol/acks.py``) and a plausible loss (``bad_loss``).
"""

from __future__ import annotations

import logging
import math
from collections import deque
from collections.abc import Callable
from functools import partial

from protolearn.coordinator.config import CoordinatorSettings
from protolearn.coordinator.core.acks import AckDesk, default_nonce_key
from protolearn.coordinator.core.admission import Admission, counted
from protolearn.coordinator.core.assignment import placement_key, shares_from_layers
from protolearn.coordinator.core.changes import Changes
from protolearn.coordinator.core.close_rule import CloseRule
from protolearn.coordinator.core.cooldown import BanCooldown
from protolearn.coordinator.core.corpus import CorpusDesk
from protolearn.coordinator.core.final_model import FinalModelDesk
from protolearn.coordinator.core.gathering import Gathering
from protolearn.coordinator.core.history import LossRecord, StepHistory
from protolearn.coordinator.core.holdups import Holdups
from protolearn.coordinator.core.integrity import EvidenceRecord, IntegrityDesk
from protolearn.coordinator.core.leases import LeaseDiscipline
from protolearn.coordinator.core.members import LIVE, HeartbeatInfo, JoinInfo, Member
from protolearn.coordinator.core.outer_desk import OuterDesk, answer_ready
from protolearn.coordinator.core.outer_rounds import Decision
from protolearn.coordinator.core.pacing import Pacing
from protolearn.coordinator.core.reachability import ReachabilityDesk, Verdict, build_reply, relay_refusal
from protolearn.coordinator.core.redo import RedoBudget, orphaned
from protolearn.coordinator.core.registry import Registry
from protolearn.coordinator.core.round_faults import RoundFaults
from protolearn.coordinator.core.reports import Reports
from protolearn.coordinator.core.run import RunInfo
from protolearn.coordinator.core.status import build_status
from protolearn.coordinator.core.steps import DROPPED, ClosedStep, Ticket
from protolearn.coordinator.core.tickets import TicketLedger
from protolearn.coordinator.core.verdicts import Ban, VerdictPolicy
from protolearn.coordinator.core.witnesses import witness_key
from protolearn.coordinator.errors import Refusal
from protolearn.protocol import coordination as cm
from protolearn.protocol.errors import SignatureError
from protolearn.protocol.identity import verify_peer
from protolearn.protocol.wire import Message, encoded_size

log = logging.getLogger("protolearn.coordinator")


def _verify_evidence(peer_id: str, data: bytes, signature: bytes) -> bool:
    try:
        verify_peer(peer_id, data, signature)
    except SignatureError:
        return False
    return True


class CoordinatorCore:
    def __init__(
        self,
        run: RunInfo,
        settings: CoordinatorSettings,
        *,
        peer_id: str,
        started_at: float,
        verify: Callable[[str, bytes, bytes], bool] = _verify_evidence,
        nonce_key: bytes = b"",
    ) -> None:
        """``nonce_key``: the secret of the lease nonces (protocol/acks.py); the service derives it from its
        identity, so it holds across restarts. Without one (tests, benches) it is derived from ``peer_id``."""
        self.run = run
        self.settings = settings
        self.peer_id = peer_id
        self.started_at = started_at
        self.verify = verify
        secret = nonce_key or default_nonce_key(peer_id)
        # The heartbeat interval in force grows with the live members (pacing.py); expiry and the "silent" rules follow it.
        self.pacing = Pacing(settings, started_at)
        self.registry = Registry(
            run.num_stages, shares_from_layers(run.layers), settings, run.footprints, pacing=self.pacing, placement_key=placement_key(secret),
        )
        # An untrained model's loss is about ln(V); no honest microbatch is max_loss_factor times worse.
        max_loss = settings.max_loss_factor * math.log(run.vocab_size) if run.vocab_size >= 2 else math.inf
        self.ledger = TicketLedger(
            run.microbatches_per_step, run.num_stages, lease_s=settings.lease_s, block=settings.lease_block,
            max_revisions=settings.max_revisions, max_loss=max_loss, drop_departed=run.departures == "drop",
            close_rule=CloseRule(run.close_quorum, run.close_grace),
        )
        self.acks = AckDesk(run.run_hash, self.ledger, secret, verify)
        self.verdicts = VerdictPolicy(settings, pacing=self.pacing)
        self.integrity = IntegrityDesk(self.registry, self.verdicts, run, enabled=settings.integrity_bans, key=witness_key(self.acks.key))
        self.reports = Reports(self.registry, self.verdicts, self.integrity, verify=verify, apply_ban=self._apply_ban)
        self.leases = LeaseDiscipline(
            settings, self.registry, self.ledger, self.verdicts, ban=self.ban, acked=lambda msg: self.acks.signature_refusal(msg) is None,
        )
        self.holdups = Holdups(settings, self.ledger, self.verdicts, ban=self.ban, membership=self._joined_at)
        self.redos = RedoBudget(settings.max_redos_per_peer, self.verdicts)
        self.round_faults = RoundFaults(settings, self.verdicts, ban=self.ban)
        self.admission = Admission(settings, self.registry, self.verdicts)
        self.cooldown = BanCooldown(settings.ban_cooldown_s)
        self.step_history = StepHistory(self.ledger)
        self.gathering = Gathering(settings.start_members)
        self._last_rebalance = started_at
        # Expired leases re-issued, for the metrics.
        self.reissued = 0
        self._reported_expired: set[tuple[int, int, float]] = set()
        # The training data's fingerprint, decided by stage 0's majority (corpus.py).
        self.corpus_desk = CorpusDesk(self.registry)
        # Reachability checks running and the verdicts (reachability.py); the service dials.
        self.reachability = ReachabilityDesk()
        # Whether the run finished, and the final model the adapter keeps (final_model.py, settings.keep_final).
        self.final_model = FinalModelDesk(run, self.ledger, keep=settings.keep_final)
        # DiLoCo mode's outer rounds (outer_desk.py); None when the replicas average every step.
        self.outer = None if run.outer is None else OuterDesk(
            run.outer, run.num_stages, self.registry, self.ledger, self.verdicts, ban=self.ban, expel_after=settings.expel_after_strikes,
        )

    # -- restore ------------------------------------------------------------------------------

    def restore(
        self,
        *,
        members: list[Member],
        step: int,
        tickets: list[Ticket],
        closed: list[ClosedStep],
        history: list[LossRecord],
        bans: list[Ban],
        now: float,
        committed: int | None = None,
        corpus: str | None = None,
        evidence: list[EvidenceRecord] | None = None,
        outer: list[Decision] | None = None,
    ) -> None:
        """Load persisted state after a restart, giving live members and leases a fresh term."""
        self.registry.restore(members, now)
        self.ledger.restore(step=step, tickets=tickets, closed=closed, committed_through=committed, now=now)
        self.gathering.restore(step=step, tickets=len(tickets))
        self.verdicts.restore(bans)
        self.integrity.restore(evidence or [])
        self.corpus_desk.restore(corpus)
        self.step_history.restore(history)
        if self.outer is not None:
            self.outer.rounds.restore(outer or [])

    @property
    def corpus(self) -> str | None:
        """The swarm's corpus fingerprint (see corpus.py)."""
        return self.corpus_desk.fingerprint

    # -- requests -----------------------------------------------------------------------------

    @counted
    def handle(self, peer: str, msg: Message, now: float, *, connections: int = 1, ip: str | None = None) -> Message:
        """Answer one request (everything except the long-poll wait, see :meth:`check_wait`).

        ``connections``: how many connections with ``peer``'s identity are open now (a join checks it);
        ``ip``: the address a joiner's connection comes from, as the host sees it (``cooldown.py``).
        """
        self.admission.admit(peer, now)
        if isinstance(msg, cm.StatusRequest):
            return build_status(self, now, msg.loss_history)
        if isinstance(msg, cm.StageHashesRequest):
            hashes = self.registry.stage_hashes(msg.stage, cm.MAX_STAGE_HASHES)
            return cm.StageHashes(
                stage=msg.stage, step=self.ledger.frontier, param_hashes=[cm.ParamHash(peer_id=p, step=t, hash=h) for p, t, h in hashes],
            )
        if isinstance(msg, cm.MembersRequest):
            members = self.registry.view.snapshot(range(self.run.num_stages), peer)
            return cm.Members(
                run_toml=self.run.run_toml, run_hash=self.run.run_hash, step=self.ledger.step, members=members,
                final_step=self.final_model.held_step,
            )
        if isinstance(msg, cm.Join):
            self.pacing.update(self.registry.num_live + 1, now)  # the interval this joiner is told counts it
            return self._join(peer, msg, now, connections, ip)
        member = self.admission.live_member(peer)
        if isinstance(msg, cm.Heartbeat):
            return self._heartbeat(peer, msg, now)
        if isinstance(msg, cm.Lease):
            return self._lease(member, msg, now)
        if isinstance(msg, cm.Release):
            return cm.ReleaseReply(released=self.ledger.release(peer, msg.step, msg.indices))
        if isinstance(msg, cm.Complete):
            return self._complete(member, msg, now)
        if isinstance(msg, cm.Redo):
            return self._redo(member, msg, now)
        if isinstance(msg, cm.Averaged):
            return self._averaged(member, msg, now)
        if isinstance(msg, cm.OuterReady):
            return answer_ready(self.outer, member, msg, now)
        if isinstance(msg, cm.CorpusCheck):
            return self.corpus_desk.check(member, msg.fingerprint)
        if isinstance(msg, cm.Report):
            return self.reports.report(peer, msg, now)
        if isinstance(msg, cm.WitnessDraw):
            return self.integrity.witnesses(peer, msg, self.ledger.frontier)
        if isinstance(msg, cm.IntegrityReport):
            return self.reports.integrity_report(peer, msg, now, self.ledger.frontier)
        if isinstance(msg, cm.Leave):
            return self._leave(peer, msg, now)
        raise Refusal("unknown_request", f"no handler for {msg.KIND}")

    @counted
    def check_wait(self, peer: str, msg: cm.WaitStep, now: float) -> None:
        """Admit a long poll of ``msg.step``; the service waits for the answer (:meth:`step_info`)."""
        self.admission.admit(peer, now)
        self.admission.live_member(peer)
        if msg.step > self.ledger.step:
            raise Refusal("bad_step", f"step {msg.step} is beyond the open step {self.ledger.step}")

    @counted
    def begin_reachability(self, peer: str, now: float) -> None:
        """Admit ``peer``'s reachability check (rate limit, bans, one running per peer) before the
        service dials it back; every begun check ends with :meth:`end_reachability`."""
        self.admission.admit(peer, now)
        if not self.reachability.begin(peer):
            raise Refusal("check_running", "a reachability check is already running for this node; wait for its reply")

    def end_reachability(self, peer: str, verdict: Verdict | None) -> None:
        """``peer``'s check is over; with a verdict, it is what the registry keeps for it from now on."""
        self.reachability.end(peer)
        if verdict is not None:
            self.reachability.record(peer, verdict)
            self.registry.set_reachability(peer, verdict.verdict)

    def may_reserve(self, peer: str) -> str | None:
        """Why ``peer`` may not reserve a slot on this coordinator's relay, or None (see reachability.py)."""
        m = self.registry.members.get(peer)
        return relay_refusal(
            banned=self.verdicts.is_banned(peer), checked=self.reachability.verdict_of(peer), persisted=None if m is None else m.reachability
        )

    def reachability_reply(self, peer: str, verdict: Verdict, observed: tuple[str, int] | None, own_relays: list[str]) -> cm.ReachabilityReply:
        """The answer to ``peer``'s check: the verdict, what the coordinator saw, and relays to try
        (``own_relays``, the coordinator's addresses when it relays, first)."""
        return build_reply(verdict, observed, own_relays, partial(self.registry.relays, peer))

    def _join(self, peer: str, msg: cm.Join, now: float, connections: int = 1, ip: str | None = None) -> cm.JoinReply:
        """Register ``peer`` and answer it; a join whose reply cannot be built within the frame cap is taken back (the
        peer is not registered), so its retry is a plain join again. One identity is one process (Admission.one_identity)."""
        if self.verdicts.is_banned(peer):
            raise Refusal("banned", "banned")
        wait = self.cooldown.wait_s(peer, ip, self.verdicts.bans, now, known=peer in self.registry.members)
        if wait > 0:
            raise Refusal("cooldown", f"a member that joined from {ip} was banned recently; new identities from that address "
                                      f"may join in {wait:.0f} s (nodes that already joined are not affected)")
        if self.admission.one_identity(peer, self.peer_id, connections, msg):
            self._leave(peer, cm.Leave(reason="its own process joined again"), now)
        self.admission.precision(msg.precision, self.run.precisions)
        old = self.registry.members.get(peer)
        # The coordinator's own verdict, never the node's claim (msg.reachability).
        d = self.registry.join(peer, JoinInfo.of(msg, self.reachability.verdict_of(peer), ip), now)
        if not d.accepted:
            raise Refusal(d.code, d.reason)
        try:
            reply = self._join_reply(peer, d.stage, d.rejoined, d.reason)
            size = encoded_size(reply, "members", self.registry.view.encoded_bytes(reply.members), len(reply.members))
        except (ValueError, TypeError, OverflowError):  # a reply that does not validate or encode
            self.registry.unjoin(peer, old)
            log.exception("join reply failed peer=%s; the join was taken back", peer)
            raise Refusal("join_failed", "the coordinator could not build the join reply; the join was not registered, retry") from None
        if size > cm.MAX_REPLY_BYTES:
            self.registry.unjoin(peer, old)
            raise Refusal(
                "reply_too_large", f"the join reply would be {size} bytes, over the frame cap of {cm.MAX_REPLY_BYTES}; "
                "the join was not registered, retry later",
            )
        self.cooldown.joined(peer, ip, self.registry.members)
        if self.gathering.count(self.registry.num_live):
            log.info("the run starts: %d nodes have joined (--wait-for %d)", self.registry.num_live, self.settings.start_members)
        log.info("join peer=%s stage=%d rejoined=%s reason=%s", peer, d.stage, d.rejoined, d.reason)
        return reply

    def _join_reply(self, peer: str, stage: int, rejoined: bool, reason: str) -> cm.JoinReply:
        s = self.settings
        view = self.registry.view.full(peer, self._view_stages(self.registry.members[peer], delta=False))
        return cm.JoinReply(
            stage=stage,
            run_toml=self.run.run_toml,
            run_hash=self.run.run_hash,
            step=self.ledger.frontier,
            rejoined=rejoined,
            reason=reason,
            heartbeat_interval_s=self.pacing.interval_s,
            expiry_s=self.pacing.expiry_s,
            lease_s=s.lease_s,
            bans=self.verdicts.banned(),
            view_version=view.version,
            members=view.members,
        )

    def _view_stages(self, m: Member, *, delta: bool) -> tuple[int, ...]:
        """The stages ``m`` is told about: its neighbourhood when it merges deltas, else every stage
        (see coordinator/core/view.py)."""
        if delta:
            return self.registry.view.neighbourhood(m.stage, m.serving)
        return tuple(range(self.run.num_stages))

    def _heartbeat(self, peer: str, msg: cm.Heartbeat, now: float) -> cm.HeartbeatReply:
        d = self.registry.heartbeat(peer, HeartbeatInfo.of(msg), now, frontier=self.ledger.frontier)
        if not d.accepted:
            raise Refusal(d.code, d.reason)
        self.integrity.observe_checks(peer, msg.checks)
        member = self.registry.members[peer]
        stages = self._view_stages(member, delta=msg.view_delta)
        view = self.registry.view.update_for(peer, stages, msg.view_version, delta=msg.view_delta)
        interval = self.pacing.update(self.registry.num_live, now)
        return cm.HeartbeatReply(
            stage=d.stage,
            step=self.ledger.frontier,
            last_closed=self.ledger.last_closed,
            bans=self.verdicts.banned(),
            view_version=self.registry.view_version if view is None else view.version,
            view_changed=view is not None,
            members=[] if view is None else view.members,
            reason=d.reason,
            view_delta=view is not None and view.delta,
            removed=[] if view is None else view.removed,
            stage_replicas=self.registry.working_counts(),
            final=self.final_model.phase(),
            heartbeat_interval_s=interval,
        )

    def _lease(self, member: Member, msg: cm.Lease, now: float) -> cm.LeaseReply:
        if member.stage != 0:
            raise Refusal("not_stage0", f"only stage-0 members lease tickets; {member.peer_id} holds stage {member.stage}")
        step = self.ledger.step
        avoid = sorted(self._barred(step, 1)) if self.ledger.num_stages > 1 else []
        suspects = self.verdicts.suspects(lambda p: self._stage_of(p) == 1, now) if self.ledger.num_stages > 1 else []
        if not self.registry.present(member.peer_id):
            # Presumed dead: its connection stayed closed past the grace. A request of its own still held (service.py)
            # must not take back the tickets its death freed; once it reconnects it is present again.
            why = f"{member.peer_id} has had no connection to the coordinator for {self.settings.disconnect_grace_s:g} s"
            return cm.LeaseReply(step=step, indices=[], lease_s=self.settings.lease_s, reason=why, avoid=avoid, suspects=suspects)
        self.gathering.count(self.registry.num_live)
        gathering = self.gathering.waiting(self.registry.num_live)
        if gathering is not None:
            return cm.LeaseReply(step=step, indices=[], lease_s=self.settings.lease_s, reason=gathering, avoid=avoid, suspects=suspects)
        if member.peer_id in self._barred(step, 0):
            why = f"sits out the rest of step {step}: its stage named it the cause of a failed round of it (round_faults.py)"
            return cm.LeaseReply(step=step, indices=[], lease_s=self.settings.lease_s, reason=why, avoid=avoid, suspects=suspects)
        replicas = self.registry.working_present(0)
        d = self.ledger.lease(member.peer_id, now, msg.max_tickets, share=self.leases.share(member.peer_id, replicas), others=replicas > 1)
        if d.reissued:
            self.reissued += len(d.reissued)
            log.info("re-issued expired leases step=%d tickets=%s to peer=%s", d.step, d.reissued, member.peer_id)
        nonces = [self.nonce(d.step, i) for i in d.indices]
        listed = set(msg.holding)
        unlisted = [i for i in d.held if i not in listed]
        return cm.LeaseReply(step=d.step, indices=d.indices, lease_s=self.settings.lease_s, reason=d.reason, nonces=nonces, avoid=avoid,
                             suspects=suspects, held=unlisted, held_nonces=[self.nonce(d.step, i) for i in unlisted])

    def nonce(self, step: int, index: int, attempt: int | None = None) -> bytes:
        """The nonce of lease ``attempt`` (default: the latest) of ticket ``(step, index)``: :meth:`AckDesk.nonce`."""
        return self.acks.nonce(step, index, attempt)

    def _complete(self, member: Member, msg: cm.Complete, now: float) -> cm.CompleteReply:
        route = list(msg.route)
        for stage, hop in enumerate(msg.route):
            m = self.registry.members.get(hop)
            if m is None or m.status != LIVE or m.stage != stage:
                if self.ledger.drop_departed and stage > 0 and m is not None and m.status != LIVE and m.stage == stage:
                    route[stage] = DROPPED  # it departed with this ticket's gradients at its stage (tickets.py)
                    continue
                raise Refusal("bad_route", f"route hop {stage} is {hop}, which is not a live member of stage {stage}; redo the ticket")
        early = self.ledger.check_complete(member.peer_id, msg.step, msg.index, route, msg.loss)
        if early is not None:  # refused before any signature is checked
            self.leases.refused(member.peer_id, early.code, msg)
            raise Refusal(early.code, early.reason)
        refusal = self.acks.refusal(msg)
        if refusal is not None:
            raise refusal
        d = self.ledger.complete(member.peer_id, msg.step, msg.index, route, msg.loss, now)
        if not d.accepted:
            raise Refusal(d.code, d.reason)
        self.leases.completed(member.peer_id, d.held_s, now)
        self.verdicts.completed(msg.route, now)
        if d.closed is not None:
            self.step_history.closed(d.closed)
            log.info("step closed step=%d loss=%.4f revision=%d", d.closed.step, d.closed.loss, d.closed.revision)
        return cm.CompleteReply(step=msg.step, index=msg.index, step_closed=d.closed is not None, remaining=d.remaining)

    def _redo(self, member: Member, msg: cm.Redo, now: float) -> cm.RedoReply:
        peer = member.peer_id
        if self.ledger.drop_departed and msg.kind == "replica_out":
            # The run drops what departed replicas held (tickets.py): the survivors apply the step without it.
            raise Refusal("dropped", "this run drops the tickets of replicas that left a round: apply the step without them")
        free = self._round_failure_causes(member, msg, now)
        if not free:
            self.redos.check(peer, msg.step, now)

        def holds(p: str) -> bool:  # a participant that held the commit past its grace, silent since, holds nothing
            return self.registry.present(p) and not self.holdups.silent(p)

        d = self.ledger.redo(
            msg.step, msg.indices, by=peer, by_stage=member.stage, revision=msg.revision,
            orphaned=orphaned(self.ledger.closed.get(msg.step), member.stage, holds),
        )
        if not d.accepted:
            raise Refusal(d.code, d.reason)
        if d.foreign and not free:
            self.redos.charge(peer, msg.step, num_live=self.registry.num_live, oldest=self.ledger.last_closed)
        log.info("redo peer=%s step=%d tickets=%s reopened=%s kind=%s causes=%s reason=%s", peer, msg.step, d.indices, d.reopened,
                 msg.kind or "-", ",".join(msg.causes) or "-", msg.reason)
        return cm.RedoReply(step=msg.step, indices=d.indices, reopened=d.reopened, open_step=self.ledger.step)

    def _round_failure_causes(self, member: Member, msg: cm.Redo, now: float) -> bool:
        """Costs to their cause (round_faults.py): a participant whose round of the last closed step failed
        names its causes. True when a strict majority of the stage's participants named one of them: the
        sender's redo is then free, and so, in hindsight, are those of the others that named it."""
        closed = self.ledger.closed.get(msg.step)
        # The last closed step, or that step reopened already (by another participant's redo of this round).
        if msg.kind != "round_failed" or not msg.causes or closed is None or msg.step not in (self.ledger.last_closed, self.ledger.step):
            return False
        if msg.revision and msg.revision != closed.revision:
            return False  # about another closing: the ledger refuses it as stale
        stage = member.stage
        named = self.round_faults.name(
            member.peer_id, step=msg.step, revision=closed.revision, stage=stage, causes=msg.causes,
            participants=closed.accounting().get(stage, {}), now=now,
        )
        for p in named.refund:
            self.redos.refund(p, msg.step)
        if self.ledger.step == msg.step:  # already reopened: a stage-0 replica barred now gives back what it leased of it
            for p in self._barred(msg.step, 0):
                self.ledger.expire_leases(p, now)
        return bool(named.corroborated)

    def _joined_at(self, peer: str) -> float | None:
        """When a live member's current membership began (None: not a live member)."""
        m = self.registry.members.get(peer)
        return m.joined_at if m is not None and m.status == LIVE else None

    def _stage_of(self, peer: str) -> int | None:
        """A live member's assigned stage (None: not a live member)."""
        m = self.registry.members.get(peer)
        return m.stage if m is not None and m.status == LIVE else None

    def _barred(self, step: int, stage: int) -> set[str]:
        """The members of ``stage`` that sit out the rest of ``step`` (round_faults.py)."""
        return self.round_faults.barred(step, self._stage_of, self.registry.serving, stage)

    def _averaged(self, member: Member, msg: cm.Averaged, now: float) -> cm.StepInfo:
        # A replica moving to another stage still finishes (and reports) the step of the stage it serves.
        d = self.ledger.averaged(
            member.peer_id, member.serving_stage, msg.step, msg.revision, result_hash=msg.result_hash, needed=self.registry.reachable
        )
        if d.code in ("ok", "result_mismatch"):
            self.holdups.reported(member.peer_id)
        if d.code == "result_mismatch":
            self.verdicts.flag(member.peer_id, "result_mismatch", d.reason, now)
            log.warning("averaged result mismatch peer=%s step=%d: %s", member.peer_id, msg.step, d.reason)
        if d.committed and self.ledger.commit_dirty:
            log.info("step committed step=%d revision=%d (every stage averaged it)", msg.step, msg.revision)
        if not d.accepted:
            raise Refusal(d.code, d.reason)
        return self.step_info(msg.step, msg.revision)

    def _leave(self, peer: str, msg: cm.Leave, now: float) -> cm.LeaveReply:
        d = self.registry.leave(peer, now)
        if not d.accepted:
            raise Refusal(d.code, d.reason)
        freed = self.ledger.revoke_peer(peer)
        self.integrity.forget(peer)
        log.info("leave peer=%s stage=%d freed=%s reason=%s", peer, d.stage, freed, msg.reason or "-")
        return cm.LeaveReply(released=freed)

    def ban(self, peer: str, reason: str, now: float) -> Ban:
        """Ban a peer by operator decision (and the policy's)."""
        b = self.verdicts.ban(peer, reason, now)
        self._apply_ban(peer, now)
        return b

    def _apply_ban(self, peer: str, now: float) -> None:
        self.registry.ban(peer, now)
        freed = self.ledger.revoke_peer(peer)
        log.warning("ban peer=%s freed=%s reason=%s", peer, freed, self.verdicts.bans[peer].reason)

    # -- connections --------------------------------------------------------------------------

    def connection_changed(self, peer: str, connected: bool, now: float) -> None:
        """The host saw ``peer``'s first connection open or its last one close. A closed one may be the
        last report the commit waited for (a dead replica never sends it): the step may commit now."""
        self.registry.connection_changed(peer, connected, now)
        if not connected and self.ledger.try_commit(self.registry.reachable).committed:
            log.info("step committed step=%d (peer=%s, whose report it waited for, disconnected)", self.ledger.committed_through, peer)

    # -- long poll ----------------------------------------------------------------------------

    def step_info(self, step: int, min_revision: int = 1) -> cm.StepInfo:
        """The step's frozen accounting once closed (at ``min_revision`` or later), else ``closed=False``."""
        return self.step_history.step_info(step, min_revision)

    @property
    def history(self) -> deque[LossRecord]:
        """A loss record of each of the last closed steps (see history.py)."""
        return self.step_history.records

    # -- timers -------------------------------------------------------------------------------

    def housekeeping(self, now: float) -> list[str]:
        """Expire silent members, prune reports, maybe rebalance. Returns log lines of what happened."""
        events = []
        self.pacing.update(self.registry.num_live, now)
        for m in self.registry.expire(now):
            self.integrity.forget(m.peer_id)
            freed = self.ledger.revoke_peer(m.peer_id)
            events.append(f"expired peer={m.peer_id} stage={m.stage} freed={freed}")
        for peer in self.registry.newly_gone(now):
            ended = self.ledger.expire_leases(peer, now)
            # Step mode: what it completed of the open step is redone now, not when its stage's round leaves it out
            # after the step closed (0.5 s later in bench.py recovery). A DiLoCo replica's steps were its own.
            lost = self.ledger.forget_routes(peer) if self.outer is None else []
            if ended or lost:
                events.append(f"disconnected peer={peer} leases ended early step={self.ledger.step} tickets={ended} redone={lost}")
        expired = {(self.ledger.step, i, self.ledger.tickets[i].expires_at) for i in self.ledger.expired(now)}
        fresh = sorted(i for _, i, _ in expired - self._reported_expired)
        self._reported_expired = expired
        if fresh:
            self.ledger.noticed_expired()
            events.append(f"leases expired step={self.ledger.step} tickets={fresh} (re-issued on the next lease)")
        events += self.leases.strike(now)
        events += self.holdups.watch(self.registry.serving, now, self.leases.sat_out(self.ledger.last_closed))
        closed = self.ledger.close_due(now)
        if closed is not None:
            self.step_history.closed(closed)
            events.append(f"step closed step={closed.step} loss={closed.loss:.4f} revision={closed.revision} at its quorum: "
                          f"{closed.dropped} of {closed.num_tickets} tickets dropped (batch.close_quorum)")
        if self.outer is not None:
            events += self.outer.tick(now)
        self.verdicts.prune(now)
        # A replica the commit waited for may have died: the step can commit without it now.
        if self.ledger.try_commit(self.registry.reachable).committed:
            events.append(f"step committed step={self.ledger.committed_through} (the replicas it waited for are gone)")
        if now - self._last_rebalance >= self.settings.rebalance_interval_s:
            self._last_rebalance = now
            move = self.registry.rebalance(now)
            if move is not None:
                freed = self.ledger.revoke_peer(move.peer_id)
                events.append(f"rebalance {move.reason} freed={freed}")
        return events

    def drain(self, *, soft: bool = False) -> Changes:
        """Take the changes to persist; ``soft`` includes heartbeat-only telemetry too."""
        members, removed = self.registry.drain(soft=soft)
        tickets = self.ledger.drain()
        return Changes(
            step=self.ledger.step, members=members, removed=removed, tickets=tickets.tickets, tickets_reset=tickets.reset,
            closed=self.step_history.drain(), bans=self.verdicts.drain(), committed=tickets.committed, corpus=self.corpus_desk.drain(),
            evidence=self.integrity.drain(), outer=self.outer.rounds.drain() if self.outer is not None else None,
        )
