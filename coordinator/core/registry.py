"""Membership: who is in the swarm, which stage each member holds, and when it was last heard from.

A sans-IO core: every method takes ``now`` and returns a decision with a reason. A member is ``live``
from its join until it leaves, expires (no heartbeat for ``expiry_s``) or is banned. A second join
of a live peer is refused, and so is a heartbeat from another session than the one the member joined
with (``superseded``: another process with its key took its place; see admission.py). A departed peer (left or expired) may rejoin with the same ID and gets its
old stage back, unless another stage has no replica while its old one has some
(:func:`~.assignment.place`), and the reachability verdict it had unless a new check says otherwise.
Departed entries are forgotten after ``departed_retention_s``.

Heartbeat telemetry alone (last seen, throughput, queue length, and a flip between ``training`` and
``averaging``) marks a member ``soft``-dirty: the service persists it every few seconds rather than on
every heartbeat, since a restart resets ``last_seen`` anyway (:meth:`Registry.restore_grace`).

The *view version* (of :class:`~protolearn.coordinator.core.view.SwarmView`, which the registry keeps in
step) increases on every change other nodes must see: a join, leave, expiry, ban or stage move, and a
state change into or out of serving (``training``/``averaging``). Every member flips between those
two each step, and nobody routes differently because of it, so that flip is not a view change;
otherwise the view would change with every heartbeat of a large swarm.

Heartbeats are claims (hostile input is normal input), so each field is bounded before it counts:
*throughput* at ``throughput_claim_factor`` times the swarm's median claim (see assignment.py); a
*step* at or beyond the coordinator's frontier is not recorded (nobody applied an uncommitted step),
and the latest report replaces the previous one, so no absurd maximum sticks; a *state* change shows
in the view at most once per ``view_state_interval_s`` per member; *param_hash* counts only through
the stage's majority (:func:`~protolearn.protocol.majority.majority_state`). Live stage-0
members' corpus fingerprints are tallied here as votes (see corpus.py).

Every request path is O(1) in the number of members: the registry keeps :class:`~.tallies.StageTallies`
(replicas, throughput, working replicas, the live count) up to date as members change, rather than
scanning them. Only :meth:`Registry.rebalance` and :meth:`Registry.restore` (a timer and restarts) visit
every member, and a rebalance only when the tallies say a move could pay
(:meth:`~.tallies.StageTallies.could_rebalance`). :meth:`Registry.expire` visits only the members that
may be due (:class:`~.deadlines.Notes`): each live member has one note of a time it was heard from, and when
the note comes up past the expiry the member expires unless it was heard from since, in which case the note
moves to its last heartbeat; departed members have one note each for their retention the same way. At 10,000
simulated members a scan of every member each second was 12 ms a call, 8% of the simulation. The records themselves are in ``members.py``; where a
joiner or a returning identity goes is decided by ``assignment.py``.
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from functools import partial

from protolearn.coordinator.config import CoordinatorSettings
from protolearn.coordinator.core.address_cap import AddressCap, subnet_of
from protolearn.coordinator.core.assignment import Move, StageLoad, place, propose_move
from protolearn.coordinator.core.deadlines import Notes
from protolearn.coordinator.core.fit import fitting, no_fit_reason
from protolearn.coordinator.core.pacing import Pacing
from protolearn.coordinator.core.members import (
    BANNED,
    EXPIRED,
    LEFT,
    LIVE,
    HeartbeatInfo,
    JoinInfo,
    Member,
    MemberDecision,
    shows_change,
    view_entry,
)
from protolearn.coordinator.core.tallies import StageTallies
from protolearn.coordinator.core.view import SwarmView, first_version
from protolearn.protocol import coordination as cm
from protolearn.protocol.majority import is_strict_majority
from protolearn.protocol.states import NodeState
from protolearn.stages.footprint import StageFootprint

SUPERSEDED = ("another process with this node's identity joined after this one did: one identity runs in one process; "
              "stop the other one, or give each its own --data-dir or --name")


@dataclass
class Registry:
    num_stages: int
    shares: Sequence[float]
    settings: CoordinatorSettings
    # Each stage's memory footprint (stages/footprint.py; empty: placement ignores memory, fit.py).
    footprints: Sequence[StageFootprint] = ()
    # The heartbeat interval in force (pacing.py); None: the settings' fixed one.
    pacing: Pacing | None = None
    members: dict[str, Member] = field(default_factory=dict)
    # The first view version (see view.first_version): distinct per coordinator run.
    first_version: int = 0
    dirty: set[str] = field(default_factory=set)
    removed: set[str] = field(default_factory=set)
    # Members whose only change is heartbeat telemetry (last seen, throughput, queue): persisted lazily.
    soft: set[str] = field(default_factory=set)
    # After a restart nobody expires before this time: nodes are still backing off their reconnects.
    grace_until: float = 0.0
    # Each member's (step, hash) after its last few applied steps (not persisted: the next heartbeat says it).
    _recent: dict[str, tuple[tuple[int, str], ...]] = field(default_factory=dict)
    # Members whose last connection closed, and since when (cleared when they reconnect).
    _disconnected: dict[str, float] = field(default_factory=dict)
    # Members whose connection stayed closed past the grace: presumed dead until they reconnect.
    _gone: set[str] = field(default_factory=set)
    # Tallies of the live members: every change below takes a member out of them first and puts it back after.
    tallies: StageTallies = field(init=False)
    # What nodes are told about the live members (see view.py), kept in step by _touch.
    view: SwarmView = field(init=False)
    # The coordinator's secret for drawing a joiner's stage among the near-least loaded (assignment.py), and
    # the joins drawn so far (so a rejoining identity draws afresh). None: no draw, the least loaded stage (a
    # registry on its own, in unit tests; the coordinator core always passes its secret).
    placement_key: bytes | None = None
    _draws: int = 0
    # What :meth:`expire` looks at: one note per live member (a time it was heard from) and one per departed
    # member (a time it left); see the module docstring.
    _seen: Notes = field(default_factory=Notes)
    _departed: Notes = field(default_factory=Notes)

    def __post_init__(self) -> None:
        self.tallies = StageTallies(self.num_stages, self.members.values())
        self.view = SwarmView(self.num_stages, self.first_version, [view_entry(m) for m in self.live()])
        self._note_all()

    def _note_all(self) -> None:
        """Note every member afresh (after the members were replaced wholesale, or their times moved)."""
        self._seen = Notes((m.peer_id, m.last_seen) for m in self.members.values() if m.status == LIVE)
        self._departed = Notes((m.peer_id, m.left_at) for m in self.members.values() if m.status in (LEFT, EXPIRED))

    @property
    def heartbeat_interval_s(self) -> float:
        """The heartbeat interval in force (pacing.py)."""
        return self.settings.heartbeat_interval_s if self.pacing is None else self.pacing.interval_s

    @property
    def expiry_s(self) -> float:
        """How long a member may stay silent before it expires, at the interval in force."""
        return self.settings.expiry_s if self.pacing is None else self.pacing.expiry_s

    @property
    def view_version(self) -> int:
        return self.view.version

    def _draw(self, peer_id: str, candidates: Sequence[int]) -> int:
        """A keyed draw among ``candidates`` for ``peer_id``'s join, which it can neither predict nor repeat."""
        assert self.placement_key is not None
        self._draws += 1
        msg = f"{peer_id}|{self._draws}|{','.join(map(str, candidates))}".encode()
        return int.from_bytes(hmac.new(self.placement_key, msg, hashlib.sha256).digest()[:8], "big")

    def connection_changed(self, peer_id: str, connected: bool, now: float) -> None:
        """The host saw ``peer_id``'s first connection open or its last one close."""
        if connected:
            self._disconnected.pop(peer_id, None)
            self._gone.discard(peer_id)
        elif self.is_live(peer_id):
            self._disconnected.setdefault(peer_id, now)

    def next_gone_at(self) -> float | None:
        """When the first closed connection's grace ends (then :meth:`newly_gone` returns its peer); None: none is closed."""
        if not self._disconnected:
            return None
        return min(self._disconnected.values()) + self.settings.disconnect_grace_s

    def newly_gone(self, now: float) -> list[str]:
        """Members whose connection has now stayed closed for ``disconnect_grace_s``: presumed dead
        (until they reconnect), so their leases can end early. Each is returned once."""
        out = [p for p, since in self._disconnected.items() if now - since >= self.settings.disconnect_grace_s]
        for p in out:
            del self._disconnected[p]
            self._gone.add(p)
        return out

    def present(self, peer_id: str) -> bool:
        """Live, and not presumed dead by a closed connection."""
        return self.is_live(peer_id) and peer_id not in self._gone

    def working(self, stage: int) -> int:
        """Members that serve ``stage`` now and train (a member still moving there does not count)."""
        return len(self.tallies.working_peers(stage))

    def working_present(self, stage: int) -> int:
        """:meth:`working`, less the members presumed dead by a closed connection (O(the smaller set))."""
        working = self.tallies.working_peers(stage)
        return len(working) - len(working.intersection(self._gone))

    def working_counts(self) -> list[int]:
        """:meth:`working` of every stage, in stage order."""
        return self.tallies.working_counts()

    @property
    def num_live(self) -> int:
        return self.tallies.num_live

    def serving(self, stage: int) -> list[str]:
        """The replicas that serve ``stage`` now and train, and whose connection is not closed (sorted)."""
        return sorted(p for p in self.tallies.working_peers(stage) if p not in self._gone)

    def reachable(self, stage: int) -> list[str]:
        """:meth:`serving`, less the replicas whose connection is closed now, within the disconnect grace too:
        the ones a commit waits for. A dead replica cannot report, and waiting out the grace for it held
        every survivor's commit for most of a second; one whose connection only flapped reports when it is
        back (the same hash, or it resyncs). Nobody but the replica's own network closes that connection,
        so this gives a liar nothing the grace's end would not."""
        return [p for p in self.serving(stage) if p not in self._disconnected]

    def stage_hashes(self, stage: int, limit: int) -> list[tuple[str, int, str]]:
        """(peer, step, parameter hash) after each of the last few steps ``stage``'s serving replicas
        applied, at most ``limit`` entries (O(replicas of the stage), not O(members))."""
        if not 0 <= stage < self.num_stages:
            return []
        out: list[tuple[str, int, str]] = []
        for p in sorted(self.tallies.working_peers(stage)):
            m = self.members[p]
            if m.param_hash:
                out += [(p, s, h) for s, h in self._recent.get(p, ((m.step, m.param_hash),))]
            if len(out) >= limit:
                break
        return out[:limit]

    def _holds_stage_state(self, old: Member) -> bool:
        """Whether a returning identity holds its old stage's state, as far as the coordinator's own records
        show: the hash it last reported (at a committed step: heartbeat() keeps no other) is the one a strict
        majority of the stage's working replicas reported for that step, or nobody else serves the stage.
        Only then is its wish to go back worth granting; otherwise it joins like a newcomer, so that leaving
        and rejoining cannot steer identities into a stage (issue 27)."""
        if not 0 <= old.stage < self.num_stages:
            return False
        if not any(p != old.peer_id for p in self.tallies.working_peers(old.stage)):
            # Nobody serves its old stage (the whole swarm restarted, say, and the coordinator keeps no hashes
            # across its own restart): nothing to compare with, and an empty stage is the one a newcomer gets
            # first anyway, so going back steers nothing, while it lets a node restore its checkpoint there.
            return True
        if old.step < 0 or not old.param_hash:
            return False
        said = [h for p, s, h in self.stage_hashes(old.stage, 64 * cm.HASH_HISTORY) if s == old.step and p != old.peer_id]
        return bool(said) and is_strict_majority(said.count(old.param_hash), len(said))

    def assigned(self, peer_id: str, stage: int) -> bool:
        """Whether ``peer_id`` is a live member that the coordinator assigned to ``stage`` (its record, not a claim)."""
        m = self.members.get(peer_id)
        return m is not None and m.status == LIVE and m.stage == stage

    def live(self) -> Iterator[Member]:
        return (m for m in self.members.values() if m.status == LIVE)

    def is_live(self, peer_id: str) -> bool:
        m = self.members.get(peer_id)
        return m is not None and m.status == LIVE

    def loads(self) -> list[StageLoad]:
        """Each stage's summed throughput and replica count, as :func:`~.assignment.stage_loads` would give."""
        return self.tallies.loads()

    def _touch(self, m: Member, structural: bool) -> None:
        """``m`` changed and must be persisted; ``structural``: in a way the view shows, too."""
        self.dirty.add(m.peer_id)
        if structural:
            if m.status == LIVE:
                self.view.put(view_entry(m))
            else:
                self.view.drop(m.peer_id)

    def join(self, peer_id: str, info: JoinInfo, now: float) -> MemberDecision:
        old = self.members.get(peer_id)
        if old is not None and old.status == LIVE:
            return MemberDecision(False, "already_joined", f"{peer_id} is already a live member (stage {old.stage}); leave first")
        if old is not None and old.status == BANNED:
            return MemberDecision(False, "banned", f"{peer_id} is banned")
        if old is None and self.num_live >= self.settings.max_members:
            return MemberDecision(False, "full", f"the swarm is at its limit of {self.settings.max_members} members")
        fits = fitting(self.footprints, info.memory_gb, info.max_in_flight) if self.footprints else None
        if fits is not None and not any(fits):
            return MemberDecision(False, "no_fit", no_fit_reason(self.footprints, info.memory_gb, info.max_in_flight))
        if info.ip is not None and subnet_of(info.ip) is not None:
            cap = AddressCap(self.settings.max_stage_share_per_ip, self.settings.max_stage_share_per_subnet)
            admitted = cap.stages_admitting(info.ip, ((o.stage, o.ip) for o in self.live() if o.peer_id != peer_id), self.num_stages)
            fits = admitted if fits is None else [f and a for f, a in zip(fits, admitted, strict=True)]
            if not any(fits):
                return MemberDecision(False, "address_cap", cap.reason(info.ip))
        previous = old.stage if old is not None and self._holds_stage_state(old) else None
        choice = place(self.loads(), self.shares, previous, fits, None if self.placement_key is None else partial(self._draw, peer_id))
        rejoined = old is not None
        m = Member(
            peer_id=peer_id,
            addrs=list(info.addrs),
            device=info.device,
            memory_gb=info.memory_gb,
            throughput=self.tallies.claims.bound(info.throughput, self.settings.throughput_claim_factor),
            stage=choice.stage,
            joined_at=now,
            last_seen=now,
            name=info.name,
            moved_at=now,
            reachability=old.reachability if info.reachability == "unknown" and old is not None else info.reachability,
            relay=info.relay,
            session=info.session,
            ip=info.ip or "",
        )
        if old is not None:
            m.step, m.param_hash = old.step, old.param_hash
        self.members[peer_id] = m
        self._seen.note(peer_id, now)
        self.tallies.count(m, 1)
        self.removed.discard(peer_id)
        self._touch(m, True)
        return MemberDecision(True, "ok", choice.reason, choice.stage, rejoined)

    def unjoin(self, peer_id: str, old: Member | None) -> None:
        """Take back the join of ``peer_id`` that could not be answered: ``old`` is its entry before (None:
        it had none). Its view entry is dropped, so nodes that saw it drop it too; a retry joins afresh."""
        m = self.members.get(peer_id)
        if m is None or m.status != LIVE:
            return
        self.tallies.count(m, -1)
        if old is None:
            del self.members[peer_id]
            self.dirty.discard(peer_id)
            self.soft.discard(peer_id)
        else:
            self.members[peer_id] = old
            self._departed.note(peer_id, old.left_at)
            self.tallies.count(old, 1)
        self.view.drop(peer_id)

    def heartbeat(self, peer_id: str, hb: HeartbeatInfo, now: float, *, frontier: int | None = None) -> MemberDecision:
        """Record ``peer_id``'s heartbeat, each field bounded (see the module docstring); ``frontier``: the
        first step not yet committed (None: not checked), which no replica can have applied."""
        m = self.members.get(peer_id)
        if m is None:
            return MemberDecision(False, "not_member", f"{peer_id} has not joined; join first")
        if m.status != LIVE:
            return MemberDecision(False, "not_member", f"{peer_id} is {m.status}; join again")
        if hb.session and m.session and hb.session != m.session:
            return MemberDecision(False, "superseded", SUPERSEDED)
        state = NodeState(hb.state)
        step, param_hash = hb.step, hb.param_hash
        if frontier is not None and step >= frontier:
            step, param_hash = -1, ""  # it cannot have applied an uncommitted step: nothing it says of it counts
        persist = shows_change(m.state, state) or step != m.step or param_hash != m.param_hash
        self.tallies.count(m, -1)
        m.state = state
        claim = hb.throughput if hb.throughput > 0 else m.throughput
        m.throughput = self.tallies.claims.bound(claim, self.settings.throughput_claim_factor)
        m.queue_len = hb.queue_len
        if hb.stage >= 0:
            m.serving = hb.stage
        # A node still finishing its old stage after a move reports that stage's parameters: not this one's.
        if hb.stage in (-1, m.stage):
            m.step, m.param_hash = step, param_hash
            bound = m.step + 1 if frontier is None else min(frontier, m.step + 1)
            recent = {s: h for s, h in hb.recent[-cm.HASH_HISTORY:] if 0 <= s < bound and h}
            if param_hash:
                recent[step] = param_hash
            self._recent[peer_id] = tuple(sorted(recent.items()))
        if hb.loss is not None:
            m.loss = hb.loss
        if hb.inner_step != m.inner_step:
            # A claim for `swarm status` only, bounded by the frontier like the step above.
            m.inner_step = hb.inner_step if frontier is None or hb.inner_step < frontier else -1
        if hb.path:
            m.path = hb.path
        moved = bool(hb.addrs) and list(hb.addrs) != m.addrs
        if moved:
            m.addrs = list(hb.addrs)
        self.tallies.count(m, 1)
        m.last_seen = now  # (its note stays where it is: expire moves it here when it comes up)
        shown = self.view.get(peer_id)
        # New addresses go into the view at once: its peers cannot reach it at the old ones.
        structural = moved or shown is not None and shows_change(shown.state, state) and (
            m.shown_at is None or now - m.shown_at >= self.settings.view_state_interval_s
        )
        if structural:
            m.shown_at = now
        if persist or structural or m.move_reason:
            self._touch(m, structural)
        else:
            self.soft.add(peer_id)
        reason, m.move_reason = m.move_reason, ""
        return MemberDecision(True, "ok", reason, m.stage)

    def set_reachability(self, peer_id: str, verdict: str) -> None:
        """The coordinator checked ``peer_id`` again: a live member's verdict (and its relay offer) follows."""
        m = self.members.get(peer_id)
        if m is None or m.status != LIVE or m.reachability == verdict:
            return
        self.tallies.count(m, -1)
        m.reachability = verdict
        self.tallies.count(m, 1)
        self.dirty.add(peer_id)

    def relays(self, exclude: str, limit: int, usable: Callable[[list[str]], list[str]] = list) -> list[str]:
        """The first ``usable`` address of up to ``limit`` live, public members that offered to relay (not
        ``exclude``); O(limit), not O(members), but for members with no usable address."""
        out: list[str] = []
        for p in self.tallies.relays:
            if len(out) >= limit:
                break
            addrs = usable(self.members[p].addrs) if p != exclude else []
            if addrs:
                out.append(addrs[0])
        return out

    def vote_corpus(self, peer_id: str, fingerprint: str) -> None:
        """Record the corpus fingerprint ``peer_id`` reported (a vote while it is a live stage-0 member)."""
        m = self.members[peer_id]
        self.tallies.count(m, -1)
        m.corpus = fingerprint
        self.tallies.count(m, 1)
        self.dirty.add(peer_id)

    def corpus_votes(self, fingerprint: str) -> int:
        """How many live stage-0 members reported ``fingerprint``."""
        return self.tallies.corpus_votes(fingerprint)

    def leave(self, peer_id: str, now: float) -> MemberDecision:
        m = self.members.get(peer_id)
        if m is None or m.status != LIVE:
            return MemberDecision(False, "not_member", f"{peer_id} is not a live member")
        self.tallies.count(m, -1)
        m.status, m.left_at = LEFT, now
        self._departed.note(peer_id, now)
        self._touch(m, True)
        return MemberDecision(True, "ok", f"{peer_id} left stage {m.stage}", m.stage)

    def expire(self, now: float) -> list[Member]:
        """Expire silent members; forget departed ones past retention. Returns the newly expired, oldest
        silence first. Only the noted deadlines that passed are visited (see the module docstring)."""
        out = []
        expiry_s, retention_s = self.expiry_s, self.settings.departed_retention_s
        for peer in self._seen.due(now, expiry_s) if now >= self.grace_until else ():
            m = self.members.get(peer)
            if m is None or m.status != LIVE:
                continue  # it left, was banned or forgotten since its note
            if now - m.last_seen <= expiry_s:  # heard from since: the note moves to its last heartbeat
                self._seen.note(peer, m.last_seen)
                continue
            self.tallies.count(m, -1)
            m.status, m.left_at = EXPIRED, now
            self._departed.note(peer, now)
            self._touch(m, True)
            out.append(m)
        for peer in self._departed.due(now, retention_s):
            m = self.members.get(peer)
            if m is None or m.status not in (LEFT, EXPIRED):
                continue  # it rejoined or was banned since its note
            if now - m.left_at <= retention_s:  # it left again since: the note moves to that departure
                self._departed.note(peer, m.left_at)
                continue
            del self.members[peer]
            self._gone.discard(peer)  # (a crashed member's entry stayed there for good)
            self._disconnected.pop(peer, None)
            self._recent.pop(peer, None)
            self.dirty.discard(peer)
            self.removed.add(peer)
        return out

    def ban(self, peer_id: str, now: float) -> bool:
        """Mark a member banned; returns whether it was live."""
        m = self.members.get(peer_id)
        if m is None:
            return False
        was_live = m.status == LIVE
        self.tallies.count(m, -1)
        m.status, m.left_at = BANNED, now
        self._touch(m, True)
        return was_live

    def rebalance(self, now: float) -> Move | None:
        """Propose and apply at most one move (training members past their cooldown only, each heard from
        and leaving a replica behind that is too: :meth:`_leaves_a_holder`). None during a restart's grace, while
        the coordinator cannot yet tell the live members from the dead it restored."""
        if now < self.grace_until or not self.tallies.could_rebalance(self.shares, self.settings.rebalance_quality):
            return None
        cooldown = self.settings.move_cooldown_s
        heard: dict[int, set[str]] = {}  # per stage, its working replicas heard from lately (once per rebalance)
        fits: dict[float, bool] = {}  # per memory offered, whether it holds every stage (once per rebalance)
        move = propose_move(
            (
                (m.peer_id, m.stage, m.throughput,
                 m.state is NodeState.TRAINING and now - m.moved_at >= cooldown and self._fits_all(m, fits) and self._leaves_a_holder(m, now, heard))
                for m in self.live()
            ),
            self.shares,
            min_quality=self.settings.rebalance_quality,
        )
        if move is not None:
            m = self.members[move.peer_id]
            self.tallies.count(m, -1)
            m.stage, m.moved_at, m.state, m.move_reason = move.dst, now, NodeState.SYNCING, move.reason
            m.step, m.param_hash = -1, ""  # its hashes were of the old stage
            self._recent.pop(m.peer_id, None)
            self.tallies.count(m, 1)
            self._touch(m, True)
        return move

    def _leaves_a_holder(self, m: Member, now: float, heard: dict[int, set[str]] | None = None) -> bool:
        """Whether ``m`` and another replica of its stage that works there were both heard from in the last two
        heartbeat intervals. A stage's state lives only in its replicas, so a move must never take its last
        one; and a replica that went silent may be dead, not yet expired (counting it once emptied a stage),
        while moving it would fill nothing. ``heard``: the stages' sets already built at this ``now`` (one scan
        of a stage per rebalance, not one per member: that made a rebalance O(members x replicas a stage))."""
        got = heard.get(m.stage) if heard is not None else None
        if got is None:
            recent = 2 * self.heartbeat_interval_s
            got = {p for p in self.tallies.working_peers(m.stage) if now - self.members[p].last_seen <= recent}
            if heard is not None:
                heard[m.stage] = got
        return m.peer_id in got and len(got) >= 2

    def _fits_all(self, m: Member, known: dict[float, bool] | None = None) -> bool:
        """Whether ``m`` holds every stage with the whole step in flight: only such a member is moved (its
        own ``max_in_flight`` is not kept), so no move hands a member a stage it cannot hold. ``known``: the answers
        for the memory sizes already checked in this rebalance (each costs a look at every stage)."""
        got = known.get(m.memory_gb) if known is not None else None
        if got is None:
            got = all(fitting(self.footprints, m.memory_gb, 0))
            if known is not None:
                known[m.memory_gb] = got
        return got

    def restore(self, members: Iterable[Member], now: float) -> None:
        """Load the persisted members after a restart; live ones get a fresh term (:meth:`restore_grace`).

        Nothing counts as changed afterwards: the store already holds exactly this.
        """
        self.members = {m.peer_id: m for m in members}
        self.tallies = StageTallies(self.num_stages, self.members.values())
        self.first_version = first_version(now)
        self.view = SwarmView(self.num_stages, self.first_version, [view_entry(m) for m in self.live()])
        self.dirty.clear()
        self.removed.clear()
        self.soft.clear()
        self._disconnected.clear()
        self._gone.clear()
        self.restore_grace(now)

    def drain(self, *, soft: bool = False) -> tuple[list[Member], list[str]]:
        """Take what to persist: the changed members (``soft``: telemetry-only changes too) and the
        forgotten peer IDs, each sorted; the registry then counts as persisted."""
        dirty = self.dirty | self.soft if soft else self.dirty
        changed = [self.members[p] for p in sorted(dirty) if p in self.members]
        removed = sorted(self.removed)
        if soft:
            self.soft.clear()
        else:
            self.soft -= self.dirty  # written in full just now
        self.dirty.clear()
        self.removed.clear()
        return changed, removed

    def restore_grace(self, now: float) -> None:
        """After a restart, count live members as just seen: the coordinator, not they, was away.

        They get ``restart_grace_s`` to reach it again before expiry applies.
        """
        self.grace_until = now + self.settings.restart_grace_s
        for m in self.live():
            m.last_seen = max(m.last_seen, now)
        self._note_all()

