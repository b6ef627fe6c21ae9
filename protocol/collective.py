"""The fault-tolerant all-reduce among the replicas of one stage, as a sans-IO state machine.

One :class:`CollectiveRound` sums (``op="sum"``) or weight-averages (``op="weighted_mean"``) one flat
float32 vector per replica with a reduce-scatter and an all-gather, and finishes even when replicas
die at any point of it. The machine never does IO: events (:meth:`~CollectiveRound.start`,
:meth:`~CollectiveRound.receive`, :meth:`~CollectiveRound.delivered`, :meth:`~CollectiveRound.peer_failed`,
:meth:`~CollectiveRound.poll`) take ``now`` and return actions (:class:`Send`, :class:`Probe`,
:class:`Rejected`, and finally one :class:`Done` or :class:`Failed`) for the adapter to carry out.

How it works
------------
* Part ownership (:mod:`protolearn.protocol.ownership`): the vector is cut into ``N`` contiguous parts
  (``N`` participants, sorted by peer id). Part ``j`` has a **chain** of reducers ``peers[j], peers[j+1],
  ...`` (cyclic); its **owner** is the first one this replica does not suspect dead, so the next peer in
  sorted order is the backup, then the one after.
* Scatter: every *contributor* (weight > 0) sends its slice of part ``j`` to the owner of ``j``; when it
  comes to suspect that owner, it resends the slice to the new owner (it still holds its vector).
* An owner reduces part ``j`` over a contributor set ``S`` once it holds the slice of every contributor
  it does not suspect. It adds ``w_p * x_p`` in sorted peer order with separate, correctly rounded
  multiply and add, so **the value of part j over S is a pure function of S**: any replica that
  reduces it gets the same bytes. It sends the reduced part, tagged with ``S``, to every participant.
* Each replica keeps ``C`` = the intersection of the sets of every reduced part it has seen (initially
  all contributors). An owner whose part was reduced over more than ``C`` reduces it again over ``C``
  (it keeps the raw slices; if a member of ``C`` is missing and dead, over less, shrinking ``C``). A
  replica commits once it holds every part reduced over exactly ``C``; :class:`Done` reports ``C`` as
  ``contributors`` and the rest as ``excluded`` (the node redoes their tickets, so I1 holds).
* **Successor first.** An owner sends a reduced part to its successor in the chain first and to the
  others only after the successor has it. So if any survivor holds a part from an owner that then died,
  the backup holds it too, and the backup sends that same part on (instead of a new one) when it takes over.
* Failure detection (:mod:`protolearn.protocol.liveness`): a failed stream or a refused probe marks a
  peer suspected at once; a peer waited on is probed, and suspected past a deadline scaled to the
  measured bandwidth. Suspicions ride on every message, so one replica's detection reaches the others.
* Termination: after committing, a replica sends ``fin`` (with its ``C``) to every peer and keeps
  serving (as owner or backup) until each peer it does not suspect has sent its ``fin``; only then is
  it finished. A live peer's ``fin`` whose ``C`` differs from ours turns the round into :class:`Failed`.

Why survivors agree (crash-stop peers; a peer is suspected only once it is dead)
----------------------------------------------------------------------------------
A live contributor's slices reach every part's current owner (it resends on every owner change, and
owners wait for every contributor they do not suspect), so ``C`` only ever loses dead peers. Values are
functions of sets, so survivors can only differ by committing different sets. Take one dead peer X.
Suppose a survivor commits ``C`` containing X; then for every part it holds a reduction that includes X.
A reduction without X can only come (a) from an owner that lacks X's slice, or (b) from re-reducing
after seeing a reduction without X, which needs (a) first. For a part other than X's own, the owner
is its live primary, and it produced a reduction with X, so it holds X's slice: no (a). For X's own
part, a survivor's reduction with X came from X itself, and successor-first means the backup got it
before anyone else; taking over, the backup finds that part over its ``C`` and sends it on instead of
reducing without X: no (a). So no reduction without X ever appears, and every survivor converges on
the same ``C``; if no survivor can commit with X, all converge on ``C`` without X. Two deaths in one
round are handled the same way unless a part's owner and its successor both die after the owner sent
its reduction on; the ``fin`` check then turns most disagreements into :class:`Failed`, and the node's
parameter-hash comparison after the step is the last line. A live peer wrongly suspected (silent for
longer than the deadline, or not delivering for ``STUCK_FACTOR`` deadlines) breaks the assumption;
probing before suspecting and bandwidth-scaled deadlines make that unlikely, and a wrongly suspected
peer that hears of it (every message and every ``fin`` carries the sender's suspects) fails its round.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Annotated, ClassVar, Literal

import torch
from protolearn.protocol.liveness import (
    DEFAULT_FACTOR,
    DEFAULT_FLOOR_S,
    EMA_ALPHA,
    INITIAL_BYTES_PER_S,
    STUCK_FACTOR,
    Bandwidth,
    FailureDetector,
    Wait,
)
from protolearn.protocol.ownership import Broadcast, Op, owner, part_bounds, reduce_part, successor
from protolearn.protocol.pipeline import MAX_STAGES, PeerId, Step
from protolearn.protocol.wire import Message
from pydantic import Field

# The liveness names stay importable from here: the adapter and the tests know the collective only.
__all__ = [
    "DEFAULT_FACTOR", "DEFAULT_FLOOR_S", "DEFAULT_TIMEOUT_S", "EMA_ALPHA", "INITIAL_BYTES_PER_S", "MAX_PARTICIPANTS",
    "STUCK_FACTOR", "Action", "Bandwidth", "CollectiveRound", "Done", "Failed", "PartHeader", "Probe",
    "Rejected", "Send",
]

# A round's parts travel on the protocol named protocol/pipeline.py's COLLECTIVE, next to the rest of that
# exchange (ResultRequest, Ack, Refuse). It is not defined here: this module imports pipeline, so a name
# kept here and re-exported there would be an import cycle.
# Hard cap on one round; the adaptive per-wait deadlines below normally end a round long before.
DEFAULT_TIMEOUT_S = 60.0
# Upper bound on participants of one round; a stage with more replicas is a misconfiguration.
MAX_PARTICIPANTS = 1024

Phase = Literal["scatter", "gather", "fin"]


class PartHeader(Message):
    """Precedes a part (scatter/gather: a raw float32 tensor follows) or is alone (fin, probe).

    ``contributors``: for gather, whose vectors the part sums; for fin, the sender's committed set.
    ``suspects``: peers the sender believes dead (gossip, so one replica's detection reaches all).
    """

    KIND: ClassVar[str] = "collective.part"
    round: Step
    stage: Annotated[int, Field(ge=0, lt=MAX_STAGES)]
    phase: Literal["scatter", "gather", "fin", "probe"]
    part: Annotated[int, Field(ge=0, lt=MAX_PARTICIPANTS)]
    contributors: list[PeerId] = Field(default_factory=list, max_length=MAX_PARTICIPANTS)
    suspects: list[PeerId] = Field(default_factory=list, max_length=MAX_PARTICIPANTS)


@dataclass(frozen=True)
class Send:
    """Deliver ``data`` (part ``part`` of ``phase``; None for fin) to ``peer``; report back with
    :meth:`CollectiveRound.delivered` or :meth:`CollectiveRound.peer_failed`."""

    peer: str
    phase: Phase
    part: int
    data: torch.Tensor | None
    contributors: tuple[str, ...] = ()


@dataclass(frozen=True)
class Probe:
    """Check that ``peer`` is alive (open a stream, get an answer); report failure with ``peer_failed``."""

    peer: str


@dataclass(frozen=True)
class Rejected:
    """An incoming part was refused; the adapter logs it with the peer and the reason."""

    peer: str
    reason: str


@dataclass(frozen=True)
class Done:
    """The round finished: ``result`` is bit-identical on every survivor and sums exactly ``contributors``."""

    result: torch.Tensor
    contributors: list[str] = field(default_factory=list)
    excluded: list[str] = field(default_factory=list)
    reason: str = "all parts gathered"


@dataclass(frozen=True)
class Failed:
    """The round cannot finish: ``missing`` peers did not deliver, or the replicas disagreed."""

    missing: list[str]
    reason: str


Action = Send | Probe | Rejected | Done | Failed


@dataclass
class CollectiveRound:
    """One all-reduce among ``weights``' peers; ``me`` is this replica.

    ``weights`` maps every participant's peer id to its weight (its ticket count; 0 = contributes nothing
    but still reduces). All participants must use the same ``round_id``, ``weights``, ``numel`` and ``op``.
    """

    round_id: int
    me: str
    weights: dict[str, float]
    numel: int
    op: Op = "sum"
    timeout_s: float = DEFAULT_TIMEOUT_S
    bandwidth: Bandwidth = field(default_factory=Bandwidth)
    floor_s: float = DEFAULT_FLOOR_S
    factor: float = DEFAULT_FACTOR
    peers: list[str] = field(init=False)
    bounds: list[tuple[int, int]] = field(init=False)
    suspects: set[str] = field(init=False, default_factory=set)

    def __post_init__(self) -> None:
        if self.me not in self.weights:
            raise ValueError(f"this replica {self.me} is not a participant of round {self.round_id}")
        if len(self.weights) > MAX_PARTICIPANTS:
            raise ValueError(f"{len(self.weights)} participants exceed the limit of {MAX_PARTICIPANTS}")
        if any(not w >= 0 for w in self.weights.values()):
            raise ValueError(f"weights must be non-negative, got {self.weights}")
        if self.op == "weighted_mean" and sum(self.weights.values()) <= 0:
            raise ValueError("a weighted mean needs at least one participant with a positive weight")
        self.peers = sorted(self.weights)
        self.bounds = part_bounds(self.numel, len(self.peers))
        self._all = frozenset(p for p in self.peers if self.weights[p] > 0)
        self._C = self._all  # the intersection of every reduced part's set seen so far
        self._now = 0.0
        self._started_at: float | None = None
        self._local: torch.Tensor | None = None
        self._owner_seen: dict[int, str] = {}
        self._sent_to: dict[int, str] = {}  # part -> owner that has my slice of it
        self._slices: dict[int, dict[str, torch.Tensor]] = {}  # parts I (may) reduce: sender -> slice
        self._versions: dict[int, dict[frozenset[str], torch.Tensor]] = {}
        self._broadcasts: dict[tuple[int, frozenset[str]], Broadcast] = {}
        self._detector = FailureDetector(self.floor_s, self.factor, self.bandwidth)
        self._fins: dict[str, frozenset[str]] = {}
        self._committed: Done | None = None
        self._committed_at = 0.0
        self._bytes_in = 0
        self._finished: Done | Failed | None = None

    # -- views -----------------------------------------------------------------------------------
    @property
    def finished(self) -> Done | Failed | None:
        return self._finished

    @property
    def committed(self) -> Done | None:
        """The result once this replica holds it (it may still be serving others before finishing)."""
        return self._committed

    def contributors(self) -> list[str]:
        """Peers whose vector is (so far) part of the result, in the fixed reduction order."""
        return sorted(self._C)

    def owner(self, part: int) -> str:
        """The first peer of ``part``'s chain this replica does not suspect (never None: not itself)."""
        return owner(self.peers, part, self.suspects, self.me)

    def live_peers(self) -> list[str]:
        return [p for p in self.peers if p != self.me and p not in self.suspects]

    def wait_s(self) -> float:
        """How long to wait for one phase's parts: all N-1 incoming parts at the measured rate."""
        n = len(self.peers)
        return self._detector.deadline_s(4 * (self.numel // n + 1) * max(1, n - 1))

    def next_deadline(self) -> float | None:
        """When :meth:`poll` next has something to do (a probe or a deadline), or None."""
        if self._finished is not None or self._started_at is None:
            return None
        detected = self._detector.next_deadline(self._waits())
        give_up = self._started_at + self.timeout_s
        return give_up if detected is None else min(give_up, detected)

    # -- events ----------------------------------------------------------------------------------
    def start(self, vector: torch.Tensor, now: float) -> list[Action]:
        """Contribute ``vector`` (flat float32 of ``numel``); returns the scatter sends."""
        if self._started_at is not None:
            raise RuntimeError(f"round {self.round_id} was already started")
        if vector.dtype != torch.float32 or vector.dim() != 1 or vector.numel() != self.numel:
            raise ValueError(f"expected a flat float32 vector of {self.numel}, got {vector.dtype} {list(vector.shape)}")
        self._started_at = self._now = now
        self._local = vector
        return self._advance()

    def receive(
        self,
        peer: str,
        phase: str,
        part: int,
        data: torch.Tensor | None,
        *,
        contributors: list[str] | tuple[str, ...] = (),
        suspects: list[str] | tuple[str, ...] = (),
        now: float | None = None,
    ) -> list[Action]:
        """Take one message from ``peer``; parts that arrive before :meth:`start` are kept."""
        if now is not None:
            self._now = max(self._now, now)
        if self._finished is not None:
            return [] if phase in ("fin", "probe") else [Rejected(peer, f"round {self.round_id} is already finished")]
        reason = self._check(peer, phase, part, data, contributors, suspects)
        if reason:
            return [Rejected(peer, reason)]
        if self.me in suspects:
            return self._fail([peer], f"{peer} believes this replica died in round {self.round_id}; resync from a replica")
        self.suspects.update(suspects)
        self._detector.alive(peer, self._now)
        if phase == "fin":
            self._fins[peer] = frozenset(contributors)
        elif phase == "probe":
            pass  # its suspects are news: a part this replica must now take over, say
        elif phase == "scatter":
            assert data is not None
            self._slices.setdefault(part, {})[peer] = data
            self._bytes_in += 4 * data.numel()
        else:
            assert data is not None
            members = frozenset(contributors)
            self._versions.setdefault(part, {}).setdefault(members, data)
            self._bytes_in += 4 * data.numel()
            self._C &= members
        return self._advance()

    def delivered(self, send: Send, now: float) -> list[Action]:
        """``send`` reached its peer (acknowledged); an owner's successor-first broadcast goes on."""
        self._now = max(self._now, now)
        self._detector.alive(send.peer, now)
        if send.phase != "gather":
            return []
        b = self._broadcasts.get((send.part, frozenset(send.contributors)))
        if b is not None:
            b.delivered(send.peer)
        return self._advance()

    def peer_failed(self, peer: str, reason: str, now: float) -> list[Action]:
        """A stream to ``peer`` broke, or it did not answer a probe: suspect it from now on."""
        self._now = max(self._now, now)
        if peer == self.me or peer not in self.weights or peer in self.suspects or self._finished is not None:
            return []
        self.suspects.add(peer)
        return self._advance()

    def peer_alive(self, peer: str, now: float) -> None:
        """``peer`` answered a probe: a slow peer that answers is not suspected until ``STUCK_FACTOR`` deadlines."""
        self._now = max(self._now, now)
        self._detector.alive(peer, now)

    def poll(self, now: float) -> list[Action]:
        """Probe peers we wait on, suspect those past their deadline, and give up after ``timeout_s``."""
        self._now = max(self._now, now)
        if self._finished is not None or self._started_at is None:
            return []
        if now - self._started_at >= self.timeout_s:
            missing = self.missing()
            return self._fail(missing, f"round {self.round_id} timed out after {self.timeout_s:g} s waiting for {missing}")
        probes, dead = self._detector.due(now, self._waits())
        actions: list[Action] = [Probe(p) for p in probes]
        if dead:
            self.suspects.update(dead)
            actions += self._advance()
        return actions

    def missing(self) -> list[str]:
        """Peers this replica is waiting on right now."""
        return sorted({p for key in self._detector.wait_keys() for p in self._waited_peers(key)})

    # -- internals -------------------------------------------------------------------------------
    def _check(self, peer: str, phase: str, part: int, data: torch.Tensor | None, contributors, suspects) -> str:
        if peer not in self.weights:
            return f"peer is not a participant of round {self.round_id}"
        if peer == self.me:
            return "a replica cannot send parts to itself"
        if not all(s in self.weights for s in suspects):
            return "suspects name a peer that is not a participant"
        if phase == "probe":
            return ""
        if phase == "fin":
            return "" if set(contributors) <= self._all else "fin names a contributor that is not one"
        if phase not in ("scatter", "gather"):
            return f"unknown phase {phase[:32]!r}"
        if not 0 <= part < len(self.peers):
            return f"part {part} is out of range 0..{len(self.peers) - 1}"
        if phase == "scatter":
            if self.weights[peer] <= 0:
                return "a participant with weight 0 must not contribute"
            if self._owner_with(part, set(suspects)) != self.me:
                return f"scatter of part {part} sent to a replica that does not reduce it"
            if peer in self._slices.get(part, {}):
                return f"duplicate scatter of part {part}"
        else:
            members = set(contributors)
            if len(members) != len(contributors) or not members <= self._all:
                return "gather names a contributor set that is not a subset of the round's contributors"
            if len(self._versions.get(part, {})) > len(self.peers):
                return f"too many versions of part {part}"
        a, b = self.bounds[part]
        if data is None or data.dtype != torch.float32 or data.dim() != 1 or data.numel() != b - a:
            got = "nothing" if data is None else f"{data.dtype} {list(data.shape)}"
            return f"part {part} must be float32 of {b - a} elements, got {got}"
        # amax/amin propagate NaN and carry ±Inf, and cost a fraction of a full isfinite pass.
        if data.numel() and not bool(torch.isfinite(data.amax()) & torch.isfinite(data.amin())):
            return f"part {part} contains NaN or Inf"
        return ""

    def _owner_with(self, part: int, extra: set[str]) -> str:
        # The sender's suspects count too, but never against this replica itself.
        return owner(self.peers, part, self.suspects | (extra - {self.me}), self.me)

    def _limit(self, key: tuple) -> float:
        # An owner waits one phase for slices; a participant waits for an owner that may itself be waiting.
        return self.wait_s() * (1 if key[0] == "own" else 2)

    def _waits(self) -> dict[tuple, Wait]:
        return {key: Wait(self._waited_peers(key), self._limit(key)) for key in self._detector.wait_keys()}

    def _waited_peers(self, key: tuple) -> list[str]:
        if key[0] == "own":
            held = self._slices.get(key[1], {})
            return sorted(c for c in self._C if c not in held and c not in self.suspects)
        return [key[-1]] if key[-1] not in self.suspects else []

    def _fail(self, missing: list[str], reason: str) -> list[Action]:
        self._finished = Failed(missing, reason)
        return [self._finished]

    def _advance(self) -> list[Action]:
        if self._started_at is None or self._finished is not None:
            return []
        actions: list[Action] = []
        n, me, local = len(self.peers), self.me, self._local
        assert local is not None
        # Sender: my slice of every part must be at that part's current owner.
        if self.weights[me] > 0:
            for j, (a, b) in enumerate(self.bounds):
                o = self.owner(j)
                if self._sent_to.get(j) != o:
                    self._sent_to[j] = o
                    if o == me:
                        self._slices.setdefault(j, {})[me] = local[a:b]
                    else:
                        actions.append(Send(o, "scatter", j, local[a:b]))
        # A part whose owner died: tell the backup at once (a probe carries our suspects), since it may
        # have finished and no longer wait for anything. Contributors' resent slices tell it too.
        for j in range(n):
            o = self.owner(j)
            if self._owner_seen.get(j, o) != o and o != me:
                actions.append(Probe(o))
            self._owner_seen[j] = o
        # Owner: reduce my parts over C (shrinking C when a dead contributor's slice never came).
        mine = [j for j in range(n) if self.owner(j) == me]
        changed = True
        while changed:
            changed = False
            for j in mine:
                if self._C in self._versions.get(j, {}):
                    continue
                held = self._slices.get(j, {})
                if any(c not in held and c not in self.suspects for c in self._C):
                    continue
                members = frozenset(c for c in self._C if c in held)
                a, b = self.bounds[j]
                self._versions.setdefault(j, {})[members] = reduce_part(held, members, self.weights, self.op, b - a)
                if members != self._C:
                    self._C, changed = members, True
        # Only the part over the current C goes out: a stale one would be replaced anyway. (An owner stays
        # the owner: suspicions only grow and a replica never suspects itself.)
        for j in mine:
            if self._C in self._versions.get(j, {}):
                actions += self._broadcast(j, self._C)
        if self._committed is None and all(self._C in self._versions.get(j, {}) for j in range(n)):
            result = torch.cat([self._versions[j][self._C] for j in range(n)])
            if self.op == "weighted_mean" and not self._C:
                return actions + self._fail(sorted(self._all), f"round {self.round_id}: no contribution survived")
            self._committed = Done(result, sorted(self._C), sorted(self._all - self._C),
                                   "all parts gathered" if self._C == self._all else "dead peers' contributions left out")
            self._committed_at = self._now
            if not self.suspects:
                self.bandwidth.observe(self._bytes_in, self._now - self._started_at)
            # Suspected peers get a fin too: one wrongly suspected sees itself in our suspects and fails
            # its round rather than committing a different set (a dead one just fails the send).
            actions += [Send(p, "fin", 0, None, tuple(sorted(self._C))) for p in self.peers if p != me]
        self._track_waits()
        if self._committed is not None:
            # A dead replica's committed set does not matter (it may hold a part nobody else got).
            bad = sorted(p for p, c in self._fins.items() if c != self._C and p not in self.suspects)
            if bad:
                return actions + self._fail(bad, f"round {self.round_id}: replicas {bad} committed a different contributor set")
            if all(p in self._fins for p in self.live_peers()):
                self._finished = self._committed
                actions.append(self._committed)
        return actions

    def _broadcast(self, part: int, members: frozenset[str]) -> list[Action]:
        b = self._broadcasts.setdefault((part, members), Broadcast())
        data = self._versions[part][members]
        tag = tuple(sorted(members))
        succ = successor(self.peers, part, self.me, self.suspects)
        return [Send(p, "gather", part, data, tag) for p in b.next_peers(succ, self.live_peers())]

    def _track_waits(self) -> None:
        """Tell the detector what this replica waits on now (a deadline counts from a wait's start)."""
        waits = set()
        for j in range(len(self.peers)):
            if self._C in self._versions.get(j, {}):
                continue
            o = self.owner(j)
            waits.add(("own", j) if o == self.me else ("gather", j, o))
        if self._committed is not None:
            waits.update(("fin", p) for p in self.live_peers() if p not in self._fins)
        self._detector.track((k for k in waits if self._waited_peers(k) or k[0] != "own"), self._now)
