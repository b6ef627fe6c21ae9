"""The fault-tolerant all-reduce of one stage's replicas, as a sans-IO state machine: :class:`CollectiveRound`.

One round sums (``op="sum"``) or weight-averages (``op="weighted_mean"``) one flat float32 vector per
replica with a reduce-scatter and an all-gather, and finishes even when replicas die at any point of it;
a replica that lies can make it fail, never make two honest replicas finish with different results (the
argument: :mod:`protolearn.protocol.collective`). The machine never does IO: events (:meth:`~CollectiveRound.start`,
:meth:`~CollectiveRound.receive`, :meth:`~CollectiveRound.delivered`, :meth:`~CollectiveRound.peer_failed`,
:meth:`~CollectiveRound.poll`) take ``now`` and return actions (:mod:`.actions`) for the adapter to carry
out. It signs and checks signatures through the ``sign`` and ``verify`` it is given
(:mod:`protolearn.protocol.statements`).

How it works
------------
* Part ownership (:mod:`.ownership`): the vector is cut into ``N`` contiguous parts
  (``N`` participants, sorted by peer id). Part ``j`` has a **chain** of reducers ``peers[j], peers[j+1],
  ...`` (cyclic); its **owner** is the first one this replica does not hold to be out, so the next peer
  in sorted order is the backup, then the one after.
* Scatter: every *contributor* (weight > 0) sends its slice of part ``j`` to the owner of ``j``; when it
  comes to hold that owner out, it resends the slice to the new owner (it still holds its vector).
* An owner reduces part ``j`` over a contributor set ``S`` once it holds the slice of every contributor
  it does not hold out. It adds ``w_p * x_p`` in sorted peer order with separate, correctly rounded
  multiply and add (or applies the run's robust rule, :mod:`.robust`, built the same
  way), so **the value of part j over S is a pure function of S**: any replica that reduces it gets the
  same bytes. It **signs** (round, ``j``, ``S``, SHA-256 of the part's bytes) and
  sends the part with its signature to every participant. A receiver keeps a part only if its bytes
  hash to the signed hash and the signature is the named signer's, and a part over a set that has
  ``peers[j]`` in only if ``peers[j]`` signed it (nobody else ever holds its slice of its own part).
* A signed part of ``j`` over ``S`` **counts** here (:mod:`.part_ledger`) once (a) its signer is no later in ``j``'s chain
  than this replica's owner of ``j`` (every peer before the signer is out here) and (b) every
  contributor that ``S`` leaves out is out here. Until then it is held, not used. Two counting parts of
  ``(j, S)`` with different hashes fail the round; if one signer signed both, the two statements are
  the :class:`~protolearn.protocol.statements.SignedStatement` in :class:`~.actions.Failed`.
* Each replica keeps ``C`` = the intersection of the sets of every part that counts (initially all
  contributors). An owner whose part was reduced over more than ``C`` reduces it again over ``C`` (it
  keeps the raw slices; if a member of ``C`` is missing and out, over less, shrinking ``C``). A replica
  commits once it holds a counting part over exactly ``C`` for every ``j``; :class:`~.actions.Done` reports ``C``
  as ``contributors`` and the rest as ``excluded`` (the node redoes their tickets, so I1 holds).
* **Successor first.** An owner sends a reduced part to its successor in the chain first and to the
  others only after the successor has it. So if any survivor holds a part from an owner that then died,
  the backup holds it too, and the backup sends that same signed part on (instead of a new one) when it
  takes over.
* Who is out (:mod:`.liveness`). A peer is **held out** (for ownership and for the
  contributor set) once this replica finds it dead or stuck, or once more than ``max_liars`` distinct
  peers claim it dead; it is **dead** only on this replica's own evidence that it is unreachable (a
  broken stream, a refused or unanswered probe, silence past a deadline scaled to the measured
  bandwidth) or on its own word (it left the round). Every message carries its sender's list of peers
  it holds out, but that list is a claim: the receiver probes the peers it names, and a dead one
  refuses the probe. A claim that names the receiver itself fails its round only once more than
  ``max_liars`` distinct peers make it; a peer that committed without it says so in its signed fin,
  and that fin fails the round at once, with the fin as evidence of whose word ended it. What each replica waits on, and on whom, is :mod:`.waits`.
* Termination (:mod:`.fins`): after committing, a replica signs a **fin** (``C`` and the result hash: SHA-256 over the
  parts' hashes) and sends it to every peer, then keeps serving (as owner or backup) until it holds a
  fin from every peer that is not dead; only then is it finished. A fin from a peer that is not dead
  whose ``C`` or result hash differs from ours, or a second, different fin from one peer, turns the
  round into :class:`~.actions.Failed`. (The adapter answers a late probe of a finished round with its fin, or
  with "left" if the round failed there, so nobody waits out a deadline on a replica that is done.)
* With ``cross_check=True`` each part's checker also recomputes its owner's part and vetoes a wrong one
  (:mod:`.cross_check`).
* With a slice ``codec``, contributions come projected and an owner projects its reduced part before
  signing it (:meth:`~.spec.RoundSpec.reduce`); why all of the above still holds: :mod:`protolearn.protocol.sync_compression`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from protolearn.protocol.collective.actions import Action, Done, Failed, Probe, Rejected, Send
from protolearn.protocol.collective.admission import refusal
from protolearn.protocol.collective.cross_check import CrossCheck, Veto
from protolearn.protocol.collective.fins import Fin, FinBook
from protolearn.protocol.collective.liveness import DEFAULT_FACTOR, DEFAULT_FLOOR_S, Bandwidth, FailureDetector, Suspicion
from protolearn.protocol.collective.ownership import Broadcast, Op, checker, owner, successor
from protolearn.protocol.collective.part_ledger import PartLedger, SignedPart
from protolearn.protocol.collective.robust import Aggregation
from protolearn.protocol.collective.scatter import Scatter
from protolearn.protocol.collective.spec import RoundSpec
from protolearn.protocol.collective.waits import Waits
from protolearn.protocol.statements import SignedStatement, Sign, Verify, part_hash, result_hash, veto_digest
from protolearn.protocol.sync_compression.slice_codec import SliceCodec

# Hard cap on one round; the adaptive per-wait deadlines (:mod:`.waits`) normally end a round long before.
DEFAULT_TIMEOUT_S = 60.0

# Rewrites a part this replica reduced (part index, data) before it signs it: injected from outside
# to test that the reducer cross-check catches a wrong part; None in real use.
PartFilter = Callable[[int, torch.Tensor], torch.Tensor]


@dataclass
class CollectiveRound:
    """One all-reduce among ``weights``' peers; ``me`` is this replica.

    ``weights`` maps every participant's peer id to its weight (its ticket count; 0 = contributes nothing
    but still reduces). All participants must use the same ``round_id``, ``weights``, ``numel`` and ``op``.
    ``sign(data)`` is this replica's signature of ``data``; ``verify(peer, data, signature)`` checks a
    peer's. ``max_liars``: how many lying participants a claim must outnumber to count (see the package docstring).
    ``aggregation``: how a part combines its contributors (:mod:`.robust`; the mean by default).
    ``cross_check``: contributors also send (signed) slices to each part's checker, which recomputes the
    owner's part and vetoes the round if it differs (:mod:`.cross_check`). ``part_filter``: applied to
    the parts this replica reduces before it signs them (injected by integrity tests; None in real use). All participants must use
    the same ``aggregation``, ``cross_check`` and ``codec`` (the slice compression, None: raw float32; all
    are bound into every statement).
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
    max_liars: int = 1
    aggregation: Aggregation = field(default_factory=Aggregation)
    cross_check: bool = False
    sign: Sign = field(kw_only=True, repr=False)
    verify: Verify = field(kw_only=True, repr=False)
    part_filter: PartFilter | None = field(default=None, kw_only=True, repr=False)
    codec: SliceCodec | None = field(default=None, kw_only=True)
    peers: list[str] = field(init=False)
    bounds: list[tuple[int, int]] = field(init=False)
    suspects: set[str] = field(init=False, default_factory=set)

    def __post_init__(self) -> None:
        self._spec = spec = RoundSpec(self.round_id, self.me, self.weights, self.numel, self.op, self.aggregation, self.cross_check,
                                      self.sign, self.verify, self.codec)
        if self.max_liars < 0:
            raise ValueError(f"max_liars must be at least 0, got {self.max_liars}")
        self.peers, self.bounds, self._round_digest, self._all = spec.peers, spec.bounds, spec.digest, spec.contributors
        self._C = self._all  # the intersection of every counting part's set seen so far
        self._now = 0.0
        self._started_at: float | None = None
        self._owner_seen: dict[int, str] = {}
        self._slices: dict[int, dict[str, torch.Tensor]] = {}  # parts I (may) reduce or check: sender -> slice
        self._cross = CrossCheck(spec, self._slices)
        self._scatter = Scatter(spec, self._cross, self._slices, self.suspects)
        self._veto: Fin | None = None
        self._vetoed_statement = b""
        self._ledger = PartLedger(self.round_id, self.peers, self._all, self._round_digest, self.verify, self.cross_check)
        self._broadcasts: dict[tuple[int, frozenset[str]], Broadcast] = {}
        self._detector = FailureDetector(self.floor_s, self.factor, self.bandwidth)
        self._suspicion = Suspicion(self.max_liars, self.suspects)
        # Out by this replica's own evidence that they are unreachable (a broken stream, a refused or unanswered
        # probe, silence past a deadline) or by their own word (they left): the only peers whose fin is not needed.
        self._dead: set[str] = set()
        # Peers whose (unsigned) suspects named this replica.
        self._doubters: set[str] = set()
        self._fins = FinBook(spec)
        self._waits = Waits(spec, self._detector, self._ledger, self._fins, self._slices, self.suspects, self._dead)
        self._committed: Done | None = None
        # The rate sample of a committed round: bytes received after the start, over the time to the last of them (not
        # to the commit, which may have waited on a silent peer's deadline; parts that came early took no round time).
        self._bytes_in = 0
        self._last_in = 0.0
        self._finished: Done | Failed | None = None

    def _received(self, data: torch.Tensor) -> None:
        if self._started_at is not None:
            self._bytes_in += 4 * data.numel()
            self._last_in = self._now

    # -- views -----------------------------------------------------------------------------------
    @property
    def finished(self) -> Done | Failed | None:
        return self._finished

    @property
    def committed(self) -> Done | None:
        """The result once this replica holds it (it may still be serving others before finishing)."""
        return self._committed

    def held_fins(self) -> dict[str, tuple[frozenset[str], bytes, bytes]]:
        """Every fin this replica holds, its own committed one included: signer → (members, result hash,
        signature). A finished participant serves them with its result (:mod:`.result_proof`)."""
        out = {p: (f.members, f.digest, f.signature) for p, f in self._fins.received.items()}
        if self._committed is not None:
            out[self.me] = (frozenset(self._C), self._committed.digest, self._committed.signature)
        return out

    def contributors(self) -> list[str]:
        """Peers whose vector is (so far) part of the result, in the fixed reduction order."""
        return sorted(self._C)

    def owner(self, part: int) -> str:
        """The first peer of ``part``'s chain this replica does not hold out (never None: not itself)."""
        return owner(self.peers, part, self.suspects, self.me)

    def checker(self, part: int) -> str | None:
        """The peer that cross-checks ``part``'s owner here: the next one in its chain (None: nobody)."""
        return checker(self.peers, part, self.suspects, self.me)

    @property
    def veto(self) -> tuple[tuple[str, ...], bytes, bytes, bytes] | None:
        """The vetoing fin this replica signed (members, result hash, signature, vetoed statement), if it
        vetoed: the adapter answers late probes with it, since a veto must never read as "left"."""
        v = self._veto
        return None if v is None else (tuple(sorted(v.members)), v.digest, v.signature, self._vetoed_statement)

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
        detected = self._detector.next_deadline(self._waits.current(self._C, self.wait_s()))
        give_up = self._started_at + self.timeout_s
        return give_up if detected is None else min(give_up, detected)

    def missing(self) -> list[str]:
        """Peers this replica is waiting on right now."""
        return self._waits.missing(self._C)

    # -- events ----------------------------------------------------------------------------------
    def start(self, vector: torch.Tensor, now: float) -> list[Action]:
        """Contribute ``vector`` (flat float32 of ``numel``; with a ``codec``, its contributions); returns the scatter sends."""
        if self._started_at is not None:
            raise RuntimeError(f"round {self.round_id} was already started")
        if vector.dtype != torch.float32 or vector.dim() != 1 or vector.numel() != self.numel:
            raise ValueError(f"expected a flat float32 vector of {self.numel}, got {vector.dtype} {list(vector.shape)}")
        self._started_at = self._now = now
        self._scatter.vector = vector
        return self._advance()

    def receive(
        self, peer: str, phase: str, part: int, data: torch.Tensor | None, *, contributors: list[str] | tuple[str, ...] = (),
        suspects: list[str] | tuple[str, ...] = (), signer: str = "", digest: bytes = b"", signature: bytes = b"",
        inputs: bytes = b"", vetoed: bytes = b"", data_digest: bytes | None = None, now: float | None = None,
    ) -> list[Action]:
        """Take one message from ``peer``; parts that arrive before :meth:`start` are kept.

        ``data_digest``: the SHA-256 of ``data`` if the caller already computed it (the adapter does, in a
        worker thread); otherwise the round computes it.
        """
        if now is not None:
            self._now = max(self._now, now)
        if self._finished is not None:
            return [] if phase in ("fin", "probe") else [Rejected(peer, f"round {self.round_id} is already finished")]
        reason = refusal(self._spec, self.suspects, self._slices, peer, phase, part, data, contributors, suspects)
        if reason:
            return [Rejected(peer, reason)]
        if self.me in suspects:
            # An unsigned claim: it fails this round only once more than max_liars distinct peers make it (so
            # one liar cannot push an honest replica out); a peer that did hold this replica out says so in
            # its signed fin, below.
            self._doubters.add(peer)
            if len(self._doubters) > self.max_liars:
                who = sorted(self._doubters)
                return self._fail(who, f"{len(who)} peers ({', '.join(who)}) hold this replica out of round {self.round_id}; "
                                       "resync from a replica")
        members = frozenset(contributors)
        if phase == "gather":
            assert data is not None
            reason = self._ledger.check(part, members, part_hash(data) if data_digest is None else data_digest, signer, digest, signature, inputs)
        elif phase == "scatter" and self.cross_check:
            assert data is not None
            reason = self._cross.check_slice(peer, part, part_hash(data) if data_digest is None else data_digest, signer, digest, signature)
        elif phase == "fin":
            reason = self._fins.check(peer, members, digest, signature, vetoed)
        if reason:
            return [Rejected(peer, reason)]
        if phase == "fin" and vetoed:
            # It signed a fin no result matches: it will never commit, so neither can this round here.
            return self._fail([peer], f"{peer} vetoed a part of round {self.round_id} that its reducer got wrong",
                              (self._fins.evidence(peer, Fin(members, digest, signature)),))
        if phase == "fin" and self.weights[self.me] > 0 and self.me not in members and peer not in self._dead:
            # It signed that it committed without this contributor (which never leaves itself out): no result
            # here can match it. Its signed fin names the cause of this failure.
            return self._fail([peer], f"{peer} signed that it committed round {self.round_id} without this replica; "
                                      "resync from a replica", (self._fins.evidence(peer, Fin(members, digest, signature)),))
        # Claims about this replica itself were weighed above (doubters): it never probes, or holds out, itself.
        now_out, to_probe = self._suspicion.claimed(peer, [x for x in suspects if x != self.me])
        actions: list[Action] = [Probe(p) for p in to_probe]
        self._detector.alive(peer, self._now)
        if phase == "fin":
            fin = Fin(members, digest, signature)
            old = self._fins.keep(peer, fin)
            if old is not None:
                return actions + self._fail([peer], f"{peer} sent two different fins in round {self.round_id}",
                                            (self._fins.evidence(peer, old), self._fins.evidence(peer, fin)))
        elif phase == "scatter":
            assert data is not None
            self._slices.setdefault(part, {})[peer] = data
            if self.cross_check:
                self._cross.keep(part, peer, digest, signature)
            self._received(data)
        elif phase == "gather":
            assert data is not None
            self._received(data)
            conflict = self._ledger.add(part, members, SignedPart(data, digest, signer, signature, inputs))
            if conflict is not None:
                return actions + self._fail(*conflict)
        # phase == "probe": its claims are news (a part this replica must now take over, say)
        return actions + self._advance()

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
        """A stream to ``peer`` broke, it did not answer a probe, or it said it left: it is out from now on."""
        self._now = max(self._now, now)
        if peer == self.me or peer not in self.weights or self._finished is not None or peer in self._dead:
            return []
        self._dead.add(peer)
        self._suspicion.observed(peer)
        return self._advance()

    def peer_alive(self, peer: str, now: float) -> None:
        """``peer`` answered a probe: a slow peer that answers is not held out until ``STUCK_FACTOR`` deadlines."""
        self._now = max(self._now, now)
        self._detector.alive(peer, now)

    def poll(self, now: float) -> list[Action]:
        """Probe peers we wait on, hold out those past their deadline, and give up after ``timeout_s``."""
        self._now = max(self._now, now)
        if self._finished is not None or self._started_at is None:
            return []
        if now - self._started_at >= self.timeout_s:
            missing = self.missing()
            return self._fail(missing, f"round {self.round_id} timed out after {self.timeout_s:g} s waiting for {missing}")
        due = self._detector.due(now, self._waits.current(self._C, self.wait_s()))
        actions: list[Action] = [Probe(p) for p in due.probes]
        if due.suspects:
            for p in due.suspects:
                self._suspicion.observed(p)
            self._dead |= due.silent
            actions += self._advance()
        return actions

    # -- internals -------------------------------------------------------------------------------
    def _review(self) -> tuple[bool, list[Action]]:
        """Cross-check every part over C that counts here and that this replica checks (as its owner's
        successor, or as the owner relaying a dead owner's part); (all checked, veto actions)."""
        if not self.cross_check or self._committed is not None:
            return True, []
        parts = [(j, p) for j in range(len(self.peers)) if self.me in (self.owner(j), self.checker(j))
                 and (p := self._ledger.counted(j, self._C)) is not None]
        checked, veto = self._cross.review(parts, self._C, self._dead)
        return checked, [] if veto is None else self._vetoed(veto)

    def _vetoed(self, veto: Veto) -> list[Action]:
        """Refuse a wrong part for good: sign a fin no honest result matches, send it to all, and fail here."""
        members, p = self._C, veto.refused
        statement = self._ledger.statement(veto.part, members, p.digest, p.inputs)
        self._veto = self._fins.signed(members, veto_digest(statement))
        self._vetoed_statement = statement
        tag = tuple(sorted(members))
        sends: list[Action] = [Send(q, "fin", 0, None, tag, self.me, self._veto.digest, self._veto.signature, vetoed=statement)
                               for q in self.peers if q != self.me]
        self._finished = Failed([p.signer], veto.reason, (self._ledger.evidence(veto.part, members, p),),
                                () if veto.fault is None else (veto.fault,))
        return [*sends, self._finished]

    def _settle(self) -> list[Action]:
        """Let the parts that now count count (:mod:`.part_ledger`): shrink C, fail on a conflict, free the rest."""
        meet, conflict = self._ledger.settle(self.suspects, self.owner)
        if conflict is not None:
            return self._fail(*conflict)
        if self._committed is None:
            self._C &= meet
        self._ledger.prune(self._C)
        return []

    def _reduce_mine(self, mine: list[int]) -> bool:
        """Reduce each of my parts that has no counting part over C yet; True if any was reduced."""
        reduced = False
        for j in mine:
            if self._ledger.counted(j, self._C) is not None:
                continue
            held = self._slices.get(j, {})
            if any(c not in held and c not in self.suspects for c in self._C):
                continue
            # A backup never sums the first owner's own slice of its part (a checker may hold it): receivers
            # count such a set only when the first owner signed it.
            members = frozenset(c for c in self._C if c in held and (c != self.peers[j] or c == self.me))
            data = self._spec.reduce(held, members, j)
            if self.part_filter is not None:
                a, b = self.bounds[j]
                data = self.part_filter(j, data).detach().to(torch.float32).contiguous().reshape(-1)[: b - a]
                if self.codec is not None:  # a filtered part still travels in the round's encoding
                    data = self.codec.reduced(data)
            digest = part_hash(data)
            inputs = self._cross.inputs(j, members)
            signature = self.sign(self._ledger.statement(j, members, digest, inputs))
            self._ledger.add(j, members, SignedPart(data, digest, self.me, signature, inputs))
            reduced = True
        return reduced

    def _fail(self, missing: list[str], reason: str, evidence: tuple[SignedStatement, ...] = ()) -> list[Action]:
        self._finished = Failed(missing, reason, evidence)
        return [self._finished]

    def _advance(self) -> list[Action]:
        if self._started_at is None or self._finished is not None:
            return []
        n, me = len(self.peers), self.me
        # Sender: my slice of every part must be at that part's current owner (and checker).
        actions: list[Action] = [*self._scatter.due()] if self.weights[me] > 0 else []
        # A part whose owner died: tell the backup at once (a probe carries our claims, and it probes the
        # owner in turn), since it may have finished and no longer wait for anything.
        for j in range(n):
            o = self.owner(j)
            if self._owner_seen.get(j, o) != o and o != me:
                actions.append(Probe(o))
            self._owner_seen[j] = o
        # Owner: reduce my parts over C (shrinking C when a dead contributor's slice never came).
        mine = [j for j in range(n) if self.owner(j) == me]
        while True:
            failed = self._settle()
            if failed:
                return actions + failed
            if self._committed is not None or not self._reduce_mine(mine):
                break
        # Only the part over the current C goes out: a stale one would be replaced anyway. (An owner stays
        # the owner: suspicions only grow and a replica never suspects itself.)
        for j in mine:
            if self._ledger.counted(j, self._C) is not None:
                actions += self._broadcast(j, self._C)
        checked, vetoed = self._review()
        if vetoed:
            return actions + vetoed
        counted = [self._ledger.counted(j, self._C) for j in range(n)]
        parts = [p for p in counted if p is not None]
        if self._committed is None and len(parts) == n and checked:
            if self.op == "weighted_mean" and not self._C:
                return actions + self._fail(sorted(self._all), f"round {self.round_id}: no contribution survived")
            fin = self._fins.signed(self._C, result_hash([p.digest for p in parts]))
            self._committed = Done(torch.cat([p.data for p in parts]), sorted(self._C), sorted(self._all - self._C),
                                   "all parts gathered" if self._C == self._all else "dead peers' contributions left out",
                                   fin.digest, fin.signature)
            # Also a round that left peers out: had only clean rounds been samples, a link slower than the
            # estimate would outlive every deadline, no round would be clean, and the estimate would never fall.
            self.bandwidth.observe(self._bytes_in, self._last_in - self._started_at)
            # Suspected peers get a fin too: one wrongly held out sees itself left out of our signed fin and
            # fails its round rather than committing a different set (a dead one just fails the send).
            tag = tuple(sorted(self._C))
            actions += [Send(p, "fin", 0, None, tag, me, fin.digest, fin.signature) for p in self.peers if p != me]
        self._waits.track(self._C, self._committed is not None, self._now)
        if self._committed is not None:
            # A dead replica's fin does not matter (it may hold a part nobody else got); any other's must match,
            # also one that is out here only because it is stuck or others claim so: it may be alive and done.
            own = Fin(self._C, self._committed.digest, self._committed.signature)
            bad = self._fins.disagreeing(own, self._dead)
            if bad:
                evidence = (self._fins.evidence(me, own), *(self._fins.evidence(p, self._fins.received[p]) for p in bad))
                return actions + self._fail(bad, f"round {self.round_id}: replicas {bad} committed a different contributor "
                                                 "set or result", evidence)
            if self._fins.all_in(me, self._dead):
                self._finished = self._committed
                actions.append(self._committed)
        return actions

    def _broadcast(self, part: int, members: frozenset[str]) -> list[Action]:
        b = self._broadcasts.setdefault((part, members), Broadcast())
        p = self._ledger.counted(part, members)
        assert p is not None
        tag = tuple(sorted(members))
        succ = successor(self.peers, part, self.me, self.suspects)
        return [Send(q, "gather", part, p.data, tag, p.signer, p.digest, p.signature, p.inputs)
                for q in b.next_peers(succ, self.live_peers())]
