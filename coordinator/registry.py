"""Membership: who is in the swarm, which stage each member holds, and when it was last heard from.

A sans-IO core: every method takes ``now`` and returns a decision with a reason. A member is ``live``
from its join until it leaves, expires (no heartbeat for ``expiry_s``) or is banned. A second join
of a live peer is refused. A departed peer (left or expired) may rejoin with the same ID and gets its
old stage back, unless another stage has no replica while its old one has some: local state is worth
reusing, but a halted stage comes first. Departed entries are forgotten after
``departed_retention_s``.

Heartbeat telemetry alone (last seen, throughput, queue length, and a flip between ``training`` and
``averaging``) marks a member ``soft``-dirty: the service persists it every few seconds rather than on
every heartbeat, since a restart resets ``last_seen`` anyway (:meth:`Registry.restore_grace`).

The *view version* (of :class:`~protolearn.coordinator.view.SwarmView`, which the registry keeps in
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

Every request path is O(1) in the number of members: the registry keeps per-stage tallies (replicas,
throughput, working replicas) and the live count up to date as members change, rather than scanning
them. Only :meth:`Registry.expire`, :meth:`Registry.rebalance` and :meth:`Registry.restore` (timers
and restarts) visit every member.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field

from protolearn.coordinator.assignment import MIN_THROUGHPUT, Choice, Move, StageLoad, ThroughputClaims, choose_stage, propose_move
from protolearn.coordinator.config import CoordinatorSettings
from protolearn.coordinator.view import SwarmView, first_version
from protolearn.protocol import coordination as cm
from protolearn.protocol.states import NodeState

LIVE = "live"
LEFT = "left"
EXPIRED = "expired"
BANNED = "banned"
# The node states in which a member serves its stage (counts as working, and routes and averages).
SERVING_STATES = frozenset(s for s in NodeState if s.live)
# Stage throughput is summed in integer units of this many layer-tokens/s, so that adding and later
# subtracting a member's share leaves the sum exactly as a fresh sum would be (floats would drift).
_UNITS_PER_THROUGHPUT = 1_000_000


def _units(throughput: float) -> int:
    return round(max(throughput, MIN_THROUGHPUT) * _UNITS_PER_THROUGHPUT)


@dataclass
class Member:
    peer_id: str
    addrs: list[str]
    device: str
    memory_gb: float
    throughput: float
    stage: int
    joined_at: float
    last_seen: float
    name: str = ""
    status: str = LIVE
    state: NodeState = NodeState.SYNCING
    queue_len: int = 0
    step: int = -1
    param_hash: str = ""
    loss: float | None = None
    moved_at: float = 0.0
    left_at: float = 0.0
    move_reason: str = ""
    # The stage the node last said it serves (-1: not said). It lags ``stage`` while the node moves.
    serving: int = -1
    # When a state change of it last showed in the view (None: none since it joined); see view_state_interval_s.
    shown_at: float | None = None
    # The corpus fingerprint it reported (CorpusCheck); a vote while it is a live stage-0 member.
    corpus: str = ""
    # The coordinator's own reachability verdict on it (coordinator/reachability.py), whether it offered
    # to relay for others, and how its stage peers reach it (its last heartbeat's word; "" until then).
    reachability: str = "unknown"
    relay: bool = False
    path: str = ""

    def __post_init__(self) -> None:
        self.state = NodeState(self.state)  # the store keeps it as its string value


@dataclass(frozen=True)
class JoinInfo:
    addrs: list[str]
    device: str = "cpu"
    memory_gb: float = 0.0
    throughput: float = 0.0
    name: str = ""
    # The coordinator's verdict (never the node's claim) and the node's offer to relay.
    reachability: str = "unknown"
    relay: bool = False


@dataclass(frozen=True)
class HeartbeatInfo:
    state: NodeState
    throughput: float = 0.0
    queue_len: int = 0
    step: int = -1
    param_hash: str = ""
    loss: float | None = None
    stage: int = -1  # the stage the node serves now (-1: not said)
    # (step, hash) after its last few applied steps (protocol/coordination.py HASH_HISTORY), oldest first.
    recent: tuple[tuple[int, str], ...] = ()
    path: str = ""  # how its stage peers reach it ("": not said)
    addrs: tuple[str, ...] = ()  # where it is to be dialled now, if that changed since it joined (): unchanged)


@dataclass(frozen=True)
class MemberDecision:
    accepted: bool
    code: str
    reason: str
    stage: int = -1
    rejoined: bool = False


@dataclass
class Registry:
    num_stages: int
    shares: Sequence[float]
    settings: CoordinatorSettings
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
    # Per-stage tallies of live members, kept up to date by _count (see the module docstring).
    _num_live: int = field(default=0, init=False)
    _replicas: list[int] = field(init=False)
    _working: list[set[str]] = field(init=False)
    _throughput: list[int] = field(init=False)
    _claims: ThroughputClaims = field(init=False)
    _corpus_votes: Counter[str] = field(init=False)
    # Live members that offered to relay and that the coordinator found public, in join order (a dict as
    # an ordered set): the relays a reachability reply offers, found without scanning the members.
    _relays: dict[str, None] = field(init=False)
    # What nodes are told about the live members (see view.py), kept in step by _touch.
    view: SwarmView = field(init=False)

    def __post_init__(self) -> None:
        self._recount()
        self.view = SwarmView(self.num_stages, self.first_version, [_entry(m) for m in self.live()])

    @property
    def view_version(self) -> int:
        return self.view.version

    def _recount(self) -> None:
        self._num_live = 0
        self._replicas = [0] * self.num_stages
        self._working = [set() for _ in range(self.num_stages)]
        self._throughput = [0] * self.num_stages
        self._claims = ThroughputClaims()
        self._corpus_votes = Counter()
        self._relays = {}
        for m in self.members.values():
            self._count(m, 1)

    def _count(self, m: Member, sign: int) -> None:
        """Add (``sign`` 1) or take out (-1) ``m``'s part of the tallies: call with -1 before changing a
        member's status, stage, serving stage, state or throughput, and with 1 after."""
        if m.status != LIVE:
            return
        self._num_live += sign
        self._claims.add(m.throughput, sign)
        if m.relay and m.reachability == "public":
            if sign > 0:
                self._relays[m.peer_id] = None
            else:
                self._relays.pop(m.peer_id, None)
        s = m.stage
        if s == 0 and m.corpus:
            self._corpus_votes[m.corpus] += sign
            if not self._corpus_votes[m.corpus]:
                del self._corpus_votes[m.corpus]
        if not 0 <= s < self.num_stages:
            return
        self._replicas[s] += sign
        self._throughput[s] += sign * _units(m.throughput)
        if m.serving in (-1, s) and m.state in SERVING_STATES:
            if sign > 0:
                self._working[s].add(m.peer_id)
            else:
                self._working[s].discard(m.peer_id)

    def connection_changed(self, peer_id: str, connected: bool, now: float) -> None:
        """The host saw ``peer_id``'s first connection open or its last one close."""
        if connected:
            self._disconnected.pop(peer_id, None)
            self._gone.discard(peer_id)
        elif self.is_live(peer_id):
            self._disconnected.setdefault(peer_id, now)

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
        return len(self._working[stage]) if 0 <= stage < self.num_stages else 0

    def working_counts(self) -> list[int]:
        """:meth:`working` of every stage, in stage order."""
        return [len(w) for w in self._working]

    @property
    def num_live(self) -> int:
        return self._num_live

    def serving(self, stage: int) -> list[str]:
        """The replicas that serve ``stage`` now and train, and whose connection is not closed (sorted)."""
        if not 0 <= stage < self.num_stages:
            return []
        return sorted(p for p in self._working[stage] if p not in self._gone)

    def stage_hashes(self, stage: int, limit: int) -> list[tuple[str, int, str]]:
        """(peer, step, parameter hash) after each of the last few steps ``stage``'s serving replicas
        applied, at most ``limit`` entries (O(replicas of the stage), not O(members))."""
        if not 0 <= stage < self.num_stages:
            return []
        out: list[tuple[str, int, str]] = []
        for p in sorted(self._working[stage]):
            m = self.members[p]
            if m.param_hash:
                out += [(p, s, h) for s, h in self._recent.get(p, ((m.step, m.param_hash),))]
            if len(out) >= limit:
                break
        return out[:limit]

    def live(self) -> Iterator[Member]:
        return (m for m in self.members.values() if m.status == LIVE)

    def is_live(self, peer_id: str) -> bool:
        m = self.members.get(peer_id)
        return m is not None and m.status == LIVE

    def loads(self) -> list[StageLoad]:
        """Each stage's summed throughput and replica count, as :func:`~.assignment.stage_loads` would give."""
        return [StageLoad(t / _UNITS_PER_THROUGHPUT, n) for t, n in zip(self._throughput, self._replicas, strict=True)]

    def _touch(self, m: Member, structural: bool) -> None:
        """``m`` changed and must be persisted; ``structural``: in a way the view shows, too."""
        self.dirty.add(m.peer_id)
        if structural:
            if m.status == LIVE:
                self.view.put(_entry(m))
            else:
                self.view.drop(m.peer_id)

    def join(self, peer_id: str, info: JoinInfo, now: float) -> MemberDecision:
        old = self.members.get(peer_id)
        if old is not None and old.status == LIVE:
            return MemberDecision(False, "already_joined", f"{peer_id} is already a live member (stage {old.stage}); leave first")
        if old is not None and old.status == BANNED:
            return MemberDecision(False, "banned", f"{peer_id} is banned")
        if old is None and self._num_live >= self.settings.max_members:
            return MemberDecision(False, "full", f"the swarm is at its limit of {self.settings.max_members} members")
        loads = self.loads()
        choice = choose_stage(loads, self.shares)
        rejoined = old is not None
        if old is not None and 0 <= old.stage < self.num_stages:
            halted_elsewhere = loads[choice.stage].replicas == 0 and loads[old.stage].replicas > 0
            if not halted_elsewhere:
                choice = Choice(old.stage, f"rejoined its previous stage {old.stage}")
        m = Member(
            peer_id=peer_id,
            addrs=list(info.addrs),
            device=info.device,
            memory_gb=info.memory_gb,
            throughput=self._claims.bound(info.throughput, self.settings.throughput_claim_factor),
            stage=choice.stage,
            joined_at=now,
            last_seen=now,
            name=info.name,
            moved_at=now,
            reachability=info.reachability,
            relay=info.relay,
        )
        if old is not None:
            m.step, m.param_hash = old.step, old.param_hash
        self.members[peer_id] = m
        self._count(m, 1)
        self.removed.discard(peer_id)
        self._touch(m, True)
        return MemberDecision(True, "ok", choice.reason, choice.stage, rejoined)

    def unjoin(self, peer_id: str, old: Member | None) -> None:
        """Take back the join of ``peer_id`` that could not be answered: ``old`` is its entry before (None:
        it had none). Its view entry is dropped, so nodes that saw it drop it too; a retry joins afresh."""
        m = self.members.get(peer_id)
        if m is None or m.status != LIVE:
            return
        self._count(m, -1)
        if old is None:
            del self.members[peer_id]
            self.dirty.discard(peer_id)
            self.soft.discard(peer_id)
        else:
            self.members[peer_id] = old
            self._count(old, 1)
        self.view.drop(peer_id)

    def heartbeat(self, peer_id: str, hb: HeartbeatInfo, now: float, *, frontier: int | None = None) -> MemberDecision:
        """Record ``peer_id``'s heartbeat, each field bounded (see the module docstring); ``frontier``: the
        first step not yet committed (None: not checked), which no replica can have applied."""
        m = self.members.get(peer_id)
        if m is None:
            return MemberDecision(False, "not_member", f"{peer_id} has not joined; join first")
        if m.status != LIVE:
            return MemberDecision(False, "not_member", f"{peer_id} is {m.status}; join again")
        state = NodeState(hb.state)
        step, param_hash = hb.step, hb.param_hash
        if frontier is not None and step >= frontier:
            step, param_hash = -1, ""  # it cannot have applied an uncommitted step: nothing it says of it counts
        persist = _visible(m.state, state) or step != m.step or param_hash != m.param_hash
        self._count(m, -1)
        m.state = state
        claim = hb.throughput if hb.throughput > 0 else m.throughput
        m.throughput = self._claims.bound(claim, self.settings.throughput_claim_factor)
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
        if hb.path:
            m.path = hb.path
        moved = bool(hb.addrs) and list(hb.addrs) != m.addrs
        if moved:
            m.addrs = list(hb.addrs)
        self._count(m, 1)
        m.last_seen = now
        shown = self.view.get(peer_id)
        # New addresses go into the view at once: its peers cannot reach it at the old ones.
        structural = moved or shown is not None and _visible(shown.state, state) and (
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
        self._count(m, -1)
        m.reachability = verdict
        self._count(m, 1)
        self.dirty.add(peer_id)

    def relays(self, exclude: str, limit: int, usable: Callable[[list[str]], list[str]] = list) -> list[str]:
        """The first ``usable`` address of up to ``limit`` live, public members that offered to relay (not
        ``exclude``); O(limit), not O(members), but for members with no usable address."""
        out: list[str] = []
        for p in self._relays:
            if len(out) >= limit:
                break
            addrs = usable(self.members[p].addrs) if p != exclude else []
            if addrs:
                out.append(addrs[0])
        return out

    def vote_corpus(self, peer_id: str, fingerprint: str) -> None:
        """Record the corpus fingerprint ``peer_id`` reported (a vote while it is a live stage-0 member)."""
        m = self.members[peer_id]
        self._count(m, -1)
        m.corpus = fingerprint
        self._count(m, 1)
        self.dirty.add(peer_id)

    def corpus_votes(self, fingerprint: str) -> int:
        """How many live stage-0 members reported ``fingerprint``."""
        return self._corpus_votes.get(fingerprint, 0)

    def leave(self, peer_id: str, now: float) -> MemberDecision:
        m = self.members.get(peer_id)
        if m is None or m.status != LIVE:
            return MemberDecision(False, "not_member", f"{peer_id} is not a live member")
        self._count(m, -1)
        m.status, m.left_at = LEFT, now
        self._touch(m, True)
        return MemberDecision(True, "ok", f"{peer_id} left stage {m.stage}", m.stage)

    def expire(self, now: float) -> list[Member]:
        """Expire silent members; forget departed ones past retention. Returns the newly expired."""
        out = []
        for m in list(self.members.values()):
            if m.status == LIVE and now - m.last_seen > self.settings.expiry_s and now >= self.grace_until:
                self._count(m, -1)
                m.status, m.left_at = EXPIRED, now
                self._touch(m, True)
                out.append(m)
            elif m.status in (LEFT, EXPIRED) and now - m.left_at > self.settings.departed_retention_s:
                del self.members[m.peer_id]
                self._recent.pop(m.peer_id, None)
                self.dirty.discard(m.peer_id)
                self.removed.add(m.peer_id)
        return out

    def ban(self, peer_id: str, now: float) -> bool:
        """Mark a member banned; returns whether it was live."""
        m = self.members.get(peer_id)
        if m is None:
            return False
        was_live = m.status == LIVE
        self._count(m, -1)
        m.status, m.left_at = BANNED, now
        self._touch(m, True)
        return was_live

    def rebalance(self, now: float) -> Move | None:
        """Propose and apply at most one move (training members past their cooldown only)."""
        cooldown = self.settings.move_cooldown_s
        move = propose_move(
            (
                (m.peer_id, m.stage, m.throughput, m.state is NodeState.TRAINING and now - m.moved_at >= cooldown)
                for m in self.live()
            ),
            self.shares,
            min_quality=self.settings.rebalance_quality,
        )
        if move is not None:
            m = self.members[move.peer_id]
            self._count(m, -1)
            m.stage, m.moved_at, m.state, m.move_reason = move.dst, now, NodeState.SYNCING, move.reason
            m.step, m.param_hash = -1, ""  # its hashes were of the old stage
            self._recent.pop(m.peer_id, None)
            self._count(m, 1)
            self._touch(m, True)
        return move

    def restore(self, members: Iterable[Member], now: float) -> None:
        """Load the persisted members after a restart; live ones get a fresh term (:meth:`restore_grace`).

        Nothing counts as changed afterwards: the store already holds exactly this.
        """
        self.members = {m.peer_id: m for m in members}
        self._recount()
        self.first_version = first_version(now)
        self.view = SwarmView(self.num_stages, self.first_version, [_entry(m) for m in self.live()])
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


def _visible(a: NodeState, b: NodeState) -> bool:
    """Whether a change from state ``a`` to ``b`` is one other nodes must see (not training ↔ averaging)."""
    return a != b and not (a in SERVING_STATES and b in SERVING_STATES)


def _entry(m: Member) -> cm.MemberView:
    """``m`` as other nodes see it: enough to route to it and average with it."""
    return cm.MemberView(
        peer_id=m.peer_id, stage=m.stage, addrs=list(m.addrs), state=m.state, throughput=float(m.throughput), queue_len=m.queue_len
    )
