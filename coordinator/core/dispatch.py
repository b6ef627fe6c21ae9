"""The coordinator's request logic: one sans-IO object that turns (peer, request, now) into a reply.

:class:`CoordinatorCore` ties the registry, the ticket ledger, the verdict policy and the rate
limiter together. Every request passes the per-peer rate limit and the ban check first; a refused
request raises :class:`~protolearn.coordinator.errors.Refusal` (code + reason) and leaves the state
unchanged. The service (``service.py``) is a thin trio adapter: it calls :meth:`handle` with the
wall clock, persists :meth:`drain` into SQLite, and runs the long poll of ``WaitStep`` on top of
:meth:`step_info`.

Departures cost tickets: when a member leaves, expires or is banned, the open step's tickets it
leased *or that were routed through it* are freed, because the gradients it accumulated for them are
gone (or untrusted), and they are redone by others (I1). A member whose connection to the coordinator
closed (it died) and stays closed for ``disconnect_grace_s`` has its leases ended at once rather than
at their expiry, so another stage-0 replica picks its tickets up within about a second; the service
passes those connection events in with ``now``.

Requests that could stall or corrupt a step are bounded (issue 12): a peer may have at most
``max_redos_per_peer`` redos of other peers' work granted per step (past that it is flagged
``redo_storm`` and refused ``redo_limit``), and a step reopens at most ``max_revisions`` times. A
completion needs the last stage's signed acknowledgement of its route and loss (``bad_ack``,
``protocol/acks.py``) and a plausible loss (``bad_loss``). A stage-0 member that sits on its leases
(held past ``lease_late_fraction`` of ``lease_s`` while it completed nothing) gets a strike
(``late_leases``); each strike halves its share of the step down to one ticket, and each ticket it then
completes on time takes one strike off. Its tickets are re-issued when their lease runs out, so a step
it sits on closes at most about one ``lease_s`` later, and each later sitting costs it more share.

Liveness (issue 11): a strike taken while another stage-0 replica completed a ticket since the late
leases began (so the pipeline behind it works: the fault is this peer's) also ends its leases at once, so its
tickets are re-issued after ``lease_late_fraction * lease_s`` rather than ``lease_s``, and counts toward
expulsion: ``expel_after_strikes`` of them with no completion in between ban it (``liveness: held N
leases past X s without completing any``). Any completion clears that count, even one refused because
its ticket went to another replica meanwhile, provided the last stage's ack of it checks out: a slow
honest replica still delivers, a blackhole never does. Reports of lost microbatches against later-stage
peers (reason ``liveness:``) go to :meth:`VerdictPolicy.liveness_report` (a majority of the stage before).
"""

from __future__ import annotations

import logging
import math
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial

from protolearn.coordinator.config import CoordinatorSettings
from protolearn.coordinator.core.assignment import shares_from_layers
from protolearn.coordinator.core.corpus import decide_corpus
from protolearn.coordinator.core.integrity import EvidenceRecord, IntegrityDesk, IntegrityRefused
from protolearn.coordinator.core.ratelimit import RateLimiter
from protolearn.coordinator.core.reachability import MAX_MEMBER_RELAYS, ReachabilityDesk, Verdict, offered_relays, usable_from
from protolearn.coordinator.core.registry import LIVE, HeartbeatInfo, JoinInfo, Member, Registry
from protolearn.coordinator.core.run import RunInfo
from protolearn.coordinator.core.status import build_status
from protolearn.coordinator.core.tickets import ClosedStep, LossRecord, Ticket, TicketLedger
from protolearn.coordinator.core.verdicts import LIVENESS_REASON, Ban, VerdictPolicy
from protolearn.coordinator.errors import Refusal
from protolearn.protocol import coordination as cm
from protolearn.protocol.acks import ack_statement
from protolearn.protocol.errors import SignatureError
from protolearn.protocol.identity import verify_peer
from protolearn.protocol.statements import contradiction
from protolearn.protocol.wire import Message, encode

log = logging.getLogger("protolearn.coordinator")

# Closed steps kept in memory with their full routes (older ones live in the store only).
KEEP_CLOSED = 1000
# Compact (step, loss, tickets, closed_at) history kept in memory for status and tokens/s.
KEEP_HISTORY = 10_000


@dataclass
class Changes:
    """What changed since the last :meth:`CoordinatorCore.drain`, for the store to write."""

    step: int
    members: list[Member] = field(default_factory=list)
    removed: list[str] = field(default_factory=list)
    # All tickets of the open step when it changed wholesale (close or reopen), else the dirty ones.
    tickets: list[Ticket] = field(default_factory=list)
    tickets_reset: bool = False
    closed: list[ClosedStep] = field(default_factory=list)
    bans: list[Ban] = field(default_factory=list)
    # The new last committed step, when it changed.
    committed: int | None = None
    # The corpus fingerprint, when it was just set.
    corpus: str | None = None
    # Integrity reports judged since the last drain (coordinator/core/integrity.py).
    evidence: list[EvidenceRecord] = field(default_factory=list)

    def empty(self) -> bool:
        return not (
            self.members or self.removed or self.tickets or self.tickets_reset or self.closed or self.bans
            or self.committed is not None or self.corpus is not None or self.evidence
        )


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
    ) -> None:
        self.run = run
        self.settings = settings
        self.peer_id = peer_id
        self.started_at = started_at
        self.verify = verify
        self.registry = Registry(run.num_stages, shares_from_layers(run.layers), settings)
        # An untrained model's loss is about ln(V); no honest microbatch is max_loss_factor times worse.
        max_loss = settings.max_loss_factor * math.log(run.vocab_size) if run.vocab_size >= 2 else math.inf
        self.ledger = TicketLedger(
            run.microbatches_per_step, run.num_stages, lease_s=settings.lease_s, block=settings.lease_block,
            keep_closed=KEEP_CLOSED, max_revisions=settings.max_revisions, max_loss=max_loss,
        )
        self.verdicts = VerdictPolicy(settings)
        self.integrity = IntegrityDesk(self.registry, self.verdicts, run, enabled=settings.integrity_bans)
        self.limiter = RateLimiter(settings.rate_per_s, settings.rate_burst, max_peers=settings.max_members * 2)
        self.history: deque[LossRecord] = deque(maxlen=KEEP_HISTORY)
        self._new_closed: list[ClosedStep] = []
        self._last_rebalance = started_at
        # Counters for metrics.
        self.refusals: dict[str, int] = {}
        self.reissued = 0
        self._reported_expired: set[tuple[int, int, float]] = set()
        # The training data's fingerprint, decided by stage 0's majority (coordinator/core/corpus.py); persisted when it changes.
        self.corpus: str | None = None
        self._corpus_dirty: str | None = None
        # (step, peer) → redos of other peers' work granted (only the open and the last closed step are kept).
        self._redos: dict[tuple[int, str], int] = {}
        # Stage-0 peers' late-lease strikes, when each last completed a ticket, and the late leases seen.
        self._lease_strikes: dict[str, int] = {}
        self._last_completed: dict[str, float] = {}
        self._late_seen: set[tuple[int, int, float]] = set()
        # Stage-0 peers' liveness strikes (late while others progressed) and the leases they sat on, since
        # each one's last completion; expel_after_strikes of them ban it.
        self._idle: dict[str, tuple[int, int]] = {}
        # The tickets (step, index) whose leases a liveness strike ended early, per struck peer: a late
        # completion of one of them (refused, as it went elsewhere) still shows the peer works.
        self._ended_early: dict[str, set[tuple[int, int]]] = {}
        # When each stage-0 peer last completed a ticket (not pruned by time, unlike _last_completed).
        self._progress_at: dict[str, float] = {}
        # Reachability checks running and the verdicts (coordinator/core/reachability.py); the service dials.
        self.reachability = ReachabilityDesk()

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
    ) -> None:
        """Load persisted state after a restart, giving live members and leases a fresh term."""
        self.registry.restore(members, now)
        self.ledger.restore(step=step, tickets=tickets, closed=closed, committed_through=committed, now=now)
        self.verdicts.restore(bans)
        self.integrity.restore(evidence or [])
        self.corpus = corpus
        self.history.extend(history)

    # -- requests -----------------------------------------------------------------------------

    def refuse(self, code: str, reason: str) -> Refusal:
        self.refusals[code] = self.refusals.get(code, 0) + 1
        return Refusal(code, reason)

    def admit(self, peer: str, now: float) -> None:
        """Rate limit and ban check, done before any request is looked at."""
        if not self.limiter.allow(peer, now):
            raise self.refuse("rate_limited", f"over the limit of {self.settings.rate_per_s:g} requests/s; slow down")
        if self.verdicts.is_banned(peer):
            raise self.refuse("banned", f"banned: {self.verdicts.bans[peer].reason}")

    def handle(self, peer: str, msg: Message, now: float) -> Message:
        """Answer one request (everything except the long-poll wait, see :meth:`check_wait`)."""
        self.admit(peer, now)
        if isinstance(msg, cm.StatusRequest):
            return build_status(self, now, msg.loss_history)
        if isinstance(msg, cm.StageHashesRequest):
            hashes = self.registry.stage_hashes(msg.stage, cm.MAX_STAGE_HASHES)
            return cm.StageHashes(
                stage=msg.stage, step=self.ledger.frontier, param_hashes=[cm.ParamHash(peer_id=p, step=t, hash=h) for p, t, h in hashes],
            )
        if isinstance(msg, cm.MembersRequest):
            members = self.registry.view.snapshot(range(self.run.num_stages), peer)
            return cm.Members(run_toml=self.run.run_toml, run_hash=self.run.run_hash, step=self.ledger.step, members=members)
        if isinstance(msg, cm.Join):
            return self._join(peer, msg, now)
        if isinstance(msg, cm.Report):
            return self._report(peer, msg, now)
        if isinstance(msg, cm.IntegrityReport):
            return self._integrity_report(peer, msg, now)
        member = self._live_member(peer)
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
        if isinstance(msg, cm.CorpusCheck):
            return self._corpus_check(member, msg)
        if isinstance(msg, cm.Leave):
            return self._leave(peer, msg, now)
        raise self.refuse("unknown_request", f"no handler for {msg.KIND}")

    def check_wait(self, peer: str, msg: cm.WaitStep, now: float) -> None:
        self.admit(peer, now)
        self._live_member(peer)
        if msg.step > self.ledger.step:
            raise self.refuse("bad_step", f"step {msg.step} is beyond the open step {self.ledger.step}")

    def begin_reachability(self, peer: str, now: float) -> None:
        """Admit ``peer``'s reachability check (rate limit, bans, one running per peer) before the
        service dials it back; every begun check ends with :meth:`end_reachability`."""
        self.admit(peer, now)
        if not self.reachability.begin(peer):
            raise self.refuse("check_running", "a reachability check is already running for this node; wait for its reply")

    def end_reachability(self, peer: str, verdict: Verdict | None) -> None:
        """``peer``'s check is over; with a verdict, it is what the registry keeps for it from now on."""
        self.reachability.end(peer)
        if verdict is not None:
            self.reachability.record(peer, verdict)
            self.registry.set_reachability(peer, verdict.verdict)

    def may_reserve(self, peer: str) -> str | None:
        """Why ``peer`` may not reserve a slot on this coordinator's relay, or None: the relay is for nodes
        behind NATs, which its reachability check found private (the verdict in memory, or, after a
        restart, the one persisted with the member), not for any identity that asks."""
        if self.verdicts.is_banned(peer):
            return "banned"
        m = self.registry.members.get(peer)
        if self.reachability.verdict_of(peer) == "private" or (m is not None and m.reachability == "private"):
            return None
        return "this relay serves nodes that the coordinator's reachability check found behind a NAT"

    def reachability_reply(self, peer: str, verdict: Verdict, observed: tuple[str, int] | None, own_relays: list[str]) -> cm.ReachabilityReply:
        """The answer to ``peer``'s check: the verdict, what the coordinator saw, and relays to try
        (``own_relays``, the coordinator's addresses when it relays, first)."""
        ip, port = observed if observed is not None else ("", 0)
        usable = partial(usable_from, observed_ip=ip)
        relays = offered_relays(usable(own_relays), self.registry.relays(peer, MAX_MEMBER_RELAYS, usable))
        return cm.ReachabilityReply(
            verdict=verdict.verdict, reason=verdict.reason[: cm.MAX_TEXT], observed_ip=ip[:64], observed_port=port,
            reachable=[a for a in verdict.reachable if len(a) <= cm.MAX_ADDR][: cm.MAX_ADDRS],
            relays=[a for a in relays if len(a) <= cm.MAX_ADDR][: cm.MAX_RELAYS],
        )

    def _live_member(self, peer: str) -> Member:
        m = self.registry.members.get(peer)
        if m is None or m.status != LIVE:
            state = "has not joined" if m is None else f"is {m.status}"
            raise self.refuse("not_member", f"{peer} {state}; join first")
        return m

    def _join(self, peer: str, msg: cm.Join, now: float) -> cm.JoinReply:
        """Register ``peer`` and answer it; a join whose reply cannot be built within the frame cap is
        taken back (the peer is not registered), so that its retry is a plain join again."""
        if self.verdicts.is_banned(peer):
            raise self.refuse("banned", "banned")
        old = self.registry.members.get(peer)
        # The coordinator's own verdict, never the node's claim (msg.reachability); a rejoiner it has
        # forgotten keeps the verdict it had.
        reach = self.reachability.verdict_of(peer)
        if reach == "unknown" and old is not None:
            reach = old.reachability
        d = self.registry.join(
            peer, JoinInfo(list(msg.addrs), msg.device, msg.memory_gb, msg.throughput, msg.name, reach, msg.relay), now
        )
        if not d.accepted:
            raise self.refuse(d.code, d.reason)
        try:
            reply = self._join_reply(peer, d.stage, d.rejoined, d.reason)
            size = len(encode(reply))
        except (ValueError, TypeError, OverflowError):  # a reply that does not validate or encode
            self.registry.unjoin(peer, old)
            log.exception("join reply failed peer=%s; the join was taken back", peer)
            raise self.refuse("join_failed", "the coordinator could not build the join reply; the join was not registered, retry") from None
        if size > cm.MAX_REPLY_BYTES:
            self.registry.unjoin(peer, old)
            raise self.refuse(
                "reply_too_large", f"the join reply would be {size} bytes, over the frame cap of {cm.MAX_REPLY_BYTES}; "
                "the join was not registered, retry later",
            )
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
            heartbeat_interval_s=s.heartbeat_interval_s,
            expiry_s=s.expiry_s,
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
        info = HeartbeatInfo(
            msg.state, msg.throughput, msg.queue_len, msg.step, msg.param_hash, msg.loss, msg.stage, tuple((r.step, r.hash) for r in msg.recent),
            msg.path, tuple(msg.addrs),
        )
        d = self.registry.heartbeat(peer, info, now, frontier=self.ledger.frontier)
        if not d.accepted:
            raise self.refuse(d.code, d.reason)
        self.integrity.observe_checks(peer, msg.checks)
        member = self.registry.members[peer]
        stages = self._view_stages(member, delta=msg.view_delta)
        view = self.registry.view.update_for(peer, stages, msg.view_version, delta=msg.view_delta)
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
        )

    def _lease(self, member: Member, msg: cm.Lease, now: float) -> cm.LeaseReply:
        if member.stage != 0:
            raise self.refuse("not_stage0", f"only stage-0 members lease tickets; {member.peer_id} holds stage {member.stage}")
        # Each working stage-0 replica may hold at most its share of the step at once, so a replica
        # that asks a moment later (e.g. one that just synced) is not starved by a faster one.
        share = -(-self.run.microbatches_per_step // max(1, self.registry.working(0)))
        # A replica that sat on its leases gets half the share per strike (down to one ticket).
        share = max(1, share >> min(self._lease_strikes.get(member.peer_id, 0), 62))
        d = self.ledger.lease(member.peer_id, now, msg.max_tickets, share=share)
        if d.reissued:
            self.reissued += len(d.reissued)
            log.info("re-issued expired leases step=%d tickets=%s to peer=%s", d.step, d.reissued, member.peer_id)
        return cm.LeaseReply(step=d.step, indices=d.indices, lease_s=self.settings.lease_s, reason=d.reason)

    def _complete(self, member: Member, msg: cm.Complete, now: float) -> cm.CompleteReply:
        for stage, hop in enumerate(msg.route):
            m = self.registry.members.get(hop)
            if m is None or m.status != LIVE or m.stage != stage:
                raise self.refuse(
                    "bad_route", f"route hop {stage} is {hop}, which is not a live member of stage {stage}; redo the ticket"
                )
        early = self.ledger.check_complete(member.peer_id, msg.step, msg.index, msg.route, msg.loss)
        if early is not None:  # refused before any signature is checked
            if early.code in ("not_leaseholder", "duplicate", "step_closed") and member.peer_id in self._idle:
                self._credit_late_work(member.peer_id, msg)
            raise self.refuse(early.code, early.reason)
        if len(msg.route) > 1:
            # Only the last stage knows that the ticket went the whole way and what its loss was.
            if msg.ack is None:
                raise self.refuse("bad_ack", f"no acknowledgement from the last stage {msg.route[-1]}; redo the ticket")
            statement = ack_statement(self.run.run_hash, msg.step, msg.index, msg.route, msg.loss)
            if not self.verify(msg.route[-1], statement, msg.ack):
                raise self.refuse(
                    "bad_ack", f"the acknowledgement is not the last stage {msg.route[-1]}'s signature of this route and loss"
                )
        d = self.ledger.complete(member.peer_id, msg.step, msg.index, msg.route, msg.loss, now)
        if not d.accepted:
            raise self.refuse(d.code, d.reason)
        self._on_completed(member.peer_id, d.held_s, now)
        if d.closed is not None:
            self._on_closed(d.closed)
            log.info("step closed step=%d loss=%.4f revision=%d", d.closed.step, d.closed.loss, d.closed.revision)
        return cm.CompleteReply(step=msg.step, index=msg.index, step_closed=d.closed is not None, remaining=d.remaining)

    def _on_closed(self, closed: ClosedStep) -> None:
        self._new_closed.append(closed)
        while self.history and self.history[-1].step >= closed.step:
            self.history.pop()  # a reopened step closes again: replace its point
        self.history.append(LossRecord(closed.step, closed.loss, closed.num_tickets, closed.closed_at))

    def _credit_late_work(self, peer: str, msg: cm.Complete) -> None:
        """A struck peer finished a ticket whose lease a strike ended and that went to another replica
        meanwhile: it is slow, not a blackhole, if the last stage acknowledged its route."""
        if (msg.step, msg.index) not in self._ended_early.get(peer, ()) or len(msg.route) != self.run.num_stages or msg.route[0] != peer:
            return
        if len(msg.route) > 1:
            statement = ack_statement(self.run.run_hash, msg.step, msg.index, msg.route, msg.loss)
            if msg.ack is None or not self.verify(msg.route[-1], statement, msg.ack):
                return
        self._idle.pop(peer, None)
        self._ended_early.pop(peer, None)

    def _on_completed(self, peer: str, held_s: float, now: float) -> None:
        """A completion is progress; one within the late fraction of its lease takes a strike off."""
        self._last_completed[peer] = now
        self._progress_at[peer] = now
        if self._idle.pop(peer, None) is not None:
            self._ended_early.pop(peer, None)
        strikes = self._lease_strikes.get(peer, 0)
        if strikes and held_s <= self.settings.lease_late_fraction * self.settings.lease_s:
            if strikes > 1:
                self._lease_strikes[peer] = strikes - 1
            else:
                del self._lease_strikes[peer]

    def _redo(self, member: Member, msg: cm.Redo, now: float) -> cm.RedoReply:
        peer = member.peer_id
        key = (msg.step, peer)
        limit = self.settings.max_redos_per_peer
        if self._redos.get(key, 0) >= limit:
            if self._redos[key] == limit:  # flag once per step, however long the storm goes on
                self._redos[key] += 1
                self.verdicts.flag(peer, "redo_storm", f"asked for more than {limit} redos of others' work in step {msg.step}", now)
                log.warning("redo storm peer=%s step=%d: flagged, its further redos of the step are refused", peer, msg.step)
            raise self.refuse("redo_limit", f"already had {limit} redos of other peers' work granted in step {msg.step}; no more")
        d = self.ledger.redo(
            msg.step, msg.indices, by=peer, by_stage=member.stage, orphaned=self._orphaned(msg.step, member.stage), revision=msg.revision,
        )
        if not d.accepted:
            raise self.refuse(d.code, d.reason)
        if d.foreign:
            if len(self._redos) > 2 * self.registry.num_live + 64:
                oldest = self.ledger.last_closed
                self._redos = {k: n for k, n in self._redos.items() if k[0] >= oldest}
            self._redos[key] = self._redos.get(key, 0) + 1
        log.info("redo peer=%s step=%d tickets=%s reopened=%s reason=%s", peer, msg.step, d.indices, d.reopened, msg.reason)
        return cm.RedoReply(step=msg.step, indices=d.indices, reopened=d.reopened, open_step=self.ledger.step)

    def _orphaned(self, step: int, stage: int) -> bool:
        """Whether every peer that processed ``step``'s tickets at ``stage`` is gone: left, expired, banned,
        or its connection closed and stayed closed past the grace."""
        closed = self.ledger.closed.get(step)
        if closed is None:
            return False
        peers = {route[stage] for route in closed.routes if len(route) > stage}
        return bool(peers) and not any(self.registry.present(p) for p in peers)

    def _averaged(self, member: Member, msg: cm.Averaged, now: float) -> cm.StepInfo:
        # A replica moving to another stage still finishes (and reports) the step of the stage it serves.
        stage = member.serving if member.serving >= 0 else member.stage
        d = self.ledger.averaged(
            member.peer_id, stage, msg.step, msg.revision, result_hash=msg.result_hash, needed=self.registry.serving
        )
        if d.code == "result_mismatch":
            self.verdicts.flag(member.peer_id, "result_mismatch", d.reason, now)
            log.warning("averaged result mismatch peer=%s step=%d: %s", member.peer_id, msg.step, d.reason)
        if d.committed and self.ledger.commit_dirty:
            log.info("step committed step=%d revision=%d (every stage averaged it)", msg.step, msg.revision)
        if not d.accepted:
            raise self.refuse(d.code, d.reason)
        return self.step_info(msg.step, msg.revision)

    def _corpus_check(self, member: Member, msg: cm.CorpusCheck) -> cm.CorpusCheckReply:
        """Nodes that read the data must read the same tokens; stage 0's majority decides (coordinator/core/corpus.py)."""
        if member.stage == 0:
            self.registry.vote_corpus(member.peer_id, msg.fingerprint)
        d = decide_corpus(self.corpus, member.stage, msg.fingerprint, self.registry.corpus_votes)
        if d.code:
            raise self.refuse(d.code, d.reason)
        if d.fingerprint != self.corpus:
            log.log(logging.WARNING if d.replaced else logging.INFO, "corpus fingerprint set by peer=%s fingerprint=%s votes=%d",
                    member.peer_id, msg.fingerprint[:16], self.registry.corpus_votes(msg.fingerprint))
            self.corpus = self._corpus_dirty = d.fingerprint
        return cm.CorpusCheckReply(fingerprint=msg.fingerprint, first=d.first)

    def _leave(self, peer: str, msg: cm.Leave, now: float) -> cm.LeaveReply:
        d = self.registry.leave(peer, now)
        if not d.accepted:
            raise self.refuse(d.code, d.reason)
        freed = self.ledger.revoke_peer(peer)
        self.integrity.forget(peer)
        log.info("leave peer=%s stage=%d freed=%s reason=%s", peer, d.stage, freed, msg.reason or "-")
        return cm.LeaveReply(released=freed)

    def _report(self, peer: str, msg: cm.Report, now: float) -> cm.ReportReply:
        self._live_member(peer)
        if msg.target == peer:
            raise self.refuse("bad_report", "a peer cannot report itself")
        if msg.target not in self.registry.members:
            raise self.refuse("unknown_peer", f"{msg.target} is not a member of this swarm")
        verified = False
        if msg.evidence is None and msg.conflicting is None and msg.reason.startswith(LIVENESS_REASON):
            return self._liveness_report(peer, msg, now)
        if msg.evidence is not None or msg.conflicting is not None:
            # Proof is two statements the *accused* signed that contradict each other. The reporter's own
            # signature proves nothing (it can sign anything): that once let one member ban every other.
            a, b = msg.evidence, msg.conflicting
            if a is None or b is None:
                raise self.refuse("bad_evidence", "evidence is two conflicting statements the target signed; one was sent")
            if not (self.verify(msg.target, a.data, a.signature) and self.verify(msg.target, b.data, b.signature)):
                raise self.refuse("bad_evidence", "the evidence is not signed by the reported peer")
            why = contradiction(a.data, b.data)
            if not why:
                raise self.refuse("bad_evidence", "the two signed statements do not contradict each other")
            verified = True
        v = self.verdicts.report(peer, msg.target, msg.reason, evidence_verified=verified, now=now)
        log.info("report reporter=%s target=%s verified=%s ban=%s reason=%s", peer, msg.target, verified, v.ban, v.reason)
        if v.ban:
            self._apply_ban(msg.target, now)
        return cm.ReportReply(banned=v.ban, reason=v.reason)

    def _integrity_report(self, peer: str, msg: cm.IntegrityReport, now: float) -> cm.ReportReply:
        self._live_member(peer)
        try:
            banned, reason = self.integrity.report(peer, msg, now, self.ledger.frontier)
        except IntegrityRefused as err:
            raise self.refuse(err.code, err.reason) from None
        if banned and self.registry.is_live(msg.target):
            self._apply_ban(msg.target, now)
        return cm.ReportReply(banned=banned, reason=reason)

    def _liveness_report(self, peer: str, msg: cm.Report, now: float) -> cm.ReportReply:
        """``peer`` says microbatches it handed ``msg.target`` never came back (see verdicts.py)."""
        target = self.registry.members[msg.target]
        stage = target.serving if target.serving >= 0 else target.stage
        v = self.verdicts.liveness_report(
            peer, msg.target, msg.reason, target_stage=stage, upstream=self.registry.serving(stage - 1) if stage >= 1 else (), now=now,
            replicas=len(self.registry.serving(stage)),
        )
        log.info("liveness report reporter=%s target=%s ban=%s reason=%s", peer, msg.target, v.ban, v.reason)
        if v.ban and msg.target in self.registry.members and self.registry.members[msg.target].status == LIVE:
            self._apply_ban(msg.target, now)
        return cm.ReportReply(banned=v.ban, reason=v.reason)

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
        """The host saw ``peer``'s first connection open or its last one close."""
        self.registry.connection_changed(peer, connected, now)

    # -- long poll ----------------------------------------------------------------------------

    def step_info(self, step: int, min_revision: int = 1) -> cm.StepInfo:
        """The step's frozen accounting once closed (at ``min_revision`` or later), else ``closed=False``."""
        open_step = self.ledger.step
        closed = self.ledger.closed.get(step)
        if step >= open_step or closed is None or closed.revision < min_revision:
            if step < open_step and closed is None:
                point = next((p for p in self.history if p.step == step), None)
                return cm.StepInfo(
                    step=step, closed=True, revision=1, loss=point.loss if point else None,
                    num_tickets=self.run.microbatches_per_step, accounting=[], open_step=open_step,
                    committed=self.ledger.committed(step),
                )
            rev = closed.revision if closed is not None else 0
            return cm.StepInfo(
                step=step, closed=False, revision=rev, loss=None, num_tickets=self.run.microbatches_per_step,
                accounting=[], open_step=open_step,
            )
        accounting = [
            cm.StageAccount(
                stage=stage,
                peers=[cm.PeerTickets(peer_id=p, tickets=t) for p, t in sorted(peers.items())],
            )
            for stage, peers in sorted(closed.accounting().items())
        ]
        return cm.StepInfo(
            step=step, closed=True, revision=closed.revision, loss=float(closed.loss),
            num_tickets=closed.num_tickets, accounting=accounting, open_step=open_step,
            committed=self.ledger.committed(step),
        )

    # -- timers -------------------------------------------------------------------------------

    def housekeeping(self, now: float) -> list[str]:
        """Expire silent members, prune reports, maybe rebalance. Returns log lines of what happened."""
        events = []
        for m in self.registry.expire(now):
            self.integrity.forget(m.peer_id)
            freed = self.ledger.revoke_peer(m.peer_id)
            events.append(f"expired peer={m.peer_id} stage={m.stage} freed={freed}")
        for peer in self.registry.newly_gone(now):
            ended = self.ledger.expire_leases(peer, now)
            if ended:
                events.append(f"disconnected peer={peer} leases ended early step={self.ledger.step} tickets={ended}")
        expired = {(self.ledger.step, i, self.ledger.tickets[i].expires_at) for i in self.ledger.expired(now)}
        fresh = sorted(i for _, i, _ in expired - self._reported_expired)
        self._reported_expired = expired
        if fresh:
            events.append(f"leases expired step={self.ledger.step} tickets={fresh} (re-issued on the next lease)")
        events += self._strike_late_leases(now)
        self.verdicts.prune(now)
        # A replica the commit waited for may have died: the step can commit without it now.
        if self.ledger.try_commit(self.registry.serving).committed:
            events.append(f"step committed step={self.ledger.committed_through} (the replicas it waited for are gone)")
        if now - self._last_rebalance >= self.settings.rebalance_interval_s:
            self._last_rebalance = now
            move = self.registry.rebalance(now)
            if move is not None:
                freed = self.ledger.revoke_peer(move.peer_id)
                events.append(f"rebalance {move.reason} freed={freed}")
        return events

    def _strike_late_leases(self, now: float) -> list[str]:
        """Strike each stage-0 peer holding a lease past the late fraction of ``lease_s`` that completed
        nothing for as long (once per lease term; O(B), the open step's tickets)."""
        late_s = self.settings.lease_late_fraction * self.settings.lease_s
        late: set[tuple[int, int, float]] = set()
        struck: dict[str, list[int]] = {}
        began: dict[str, float] = {}  # the earliest start of each struck holder's late leases
        for t in self.ledger.tickets:
            # (An expired lease, or one ended early, waits for re-issue: its holder was struck for it already.)
            if t.done or t.holder is None or t.expires_at <= now or now - (t.expires_at - self.settings.lease_s) < late_s:
                continue
            key = (self.ledger.step, t.index, t.expires_at)
            if key in self._late_seen:
                late.add(key)  # struck once for this lease term already
            elif now - self._last_completed.get(t.holder, -math.inf) >= late_s:
                # (A late lease of a holder that completed something lately is looked at again on the next
                # pass: completing one ticket of a block does not buy the right to sit on the rest.)
                late.add(key)
                struck.setdefault(t.holder, []).append(t.index)
                began[t.holder] = min(began.get(t.holder, math.inf), t.expires_at - self.settings.lease_s)
        self._late_seen = late
        # Only a completion within late_s counts as progress: older ones go (O(recently active stage-0 peers)).
        self._last_completed = {p: at for p, at in self._last_completed.items() if now - at < late_s}
        events = []
        for peer, tickets in sorted(struck.items()):
            if not self.registry.present(peer):
                continue  # it left, expired or lost its connection: its leases are freed or ended anyway
            strikes = self._lease_strikes[peer] = self._lease_strikes.get(peer, 0) + 1
            why = f"held tickets {tickets} of step {self.ledger.step} past {late_s:g} s without completing any"
            self.verdicts.flag(peer, "late_leases", why, now)
            events.append(f"late leases peer={peer} strikes={strikes} {why}")
            if self.settings.expel_after_strikes is not None and any(
                p != peer and at >= began[peer] for p, at in self._progress_at.items()
            ):
                events.append(self._liveness_strike(peer, len(tickets), late_s, now))
        if len(self._lease_strikes) > 2 * self.registry.working(0) + 64:
            self._lease_strikes = {p: n for p, n in self._lease_strikes.items() if self.registry.is_live(p)}
            self._idle = {p: v for p, v in self._idle.items() if self.registry.is_live(p)}
            self._ended_early = {p: v for p, v in self._ended_early.items() if p in self._idle}
        if len(self._progress_at) > 2 * self.registry.working(0) + 64:
            self._progress_at = {p: v for p, v in self._progress_at.items() if self.registry.is_live(p)}
        return events

    def _liveness_strike(self, peer: str, num_leases: int, late_s: float, now: float) -> str:
        """``peer`` sat on ``num_leases`` leases while other stage-0 replicas completed tickets: end its
        leases now (they are re-issued on the next request) and ban it after ``expel_after_strikes``."""
        strikes, leases = self._idle.get(peer, (0, 0))
        strikes, leases = strikes + 1, leases + num_leases
        self._idle[peer] = (strikes, leases)
        limit = self.settings.expel_after_strikes
        assert limit is not None
        if strikes >= limit:
            del self._idle[peer]
            self._ended_early.pop(peer, None)
            reason = (f"liveness: held {leases} leases past {late_s:g} s without completing any "
                      f"({strikes} times while other stage-0 replicas completed theirs)")
            self.ban(peer, reason, now)
            return f"expelled peer={peer} {reason}"
        ended = self.ledger.expire_leases(peer, now)
        self._ended_early.setdefault(peer, set()).update((self.ledger.step, i) for i in ended)
        return f"liveness strike peer={peer} {strikes}/{limit}: others complete tickets, it does not; leases ended early tickets={ended}"

    def drain(self, *, soft: bool = False) -> Changes:
        """Take the changes to persist; ``soft`` includes heartbeat-only telemetry too."""
        members, removed = self.registry.drain(soft=soft)
        tickets = self.ledger.drain()
        ch = Changes(
            step=self.ledger.step, members=members, removed=removed, tickets=tickets.tickets, tickets_reset=tickets.reset,
            closed=list(self._new_closed), bans=self.verdicts.drain(), committed=tickets.committed, corpus=self._corpus_dirty,
            evidence=self.integrity.drain(),
        )
        self._new_closed.clear()
        self._corpus_dirty = None
        return ch
