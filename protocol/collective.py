"""The fault-tolerant all-reduce among the replicas of one stage, as a sans-IO state machine.

One :class:`CollectiveRound` sums (``op="sum"``) or weight-averages (``op="weighted_mean"``) one flat
float32 vector per replica with a reduce-scatter and an all-gather, and finishes even when replicas
die at any point of it; a replica that lies can make it fail, never make two honest replicas finish
with different results. The machine never does IO: events (:meth:`~CollectiveRound.start`,
:meth:`~CollectiveRound.receive`, :meth:`~CollectiveRound.delivered`, :meth:`~CollectiveRound.peer_failed`,
:meth:`~CollectiveRound.poll`) take ``now`` and return actions (:class:`Send`, :class:`Probe`,
:class:`Rejected`, and finally one :class:`Done` or :class:`Failed`) for the adapter to carry out. It
signs and checks signatures through the ``sign`` and ``verify`` it is given (:mod:`.statements`).

How it works
------------
* Part ownership (:mod:`protolearn.protocol.ownership`): the vector is cut into ``N`` contiguous parts
  (``N`` participants, sorted by peer id). Part ``j`` has a **chain** of reducers ``peers[j], peers[j+1],
  ...`` (cyclic); its **owner** is the first one this replica does not hold to be out, so the next peer
  in sorted order is the backup, then the one after.
* Scatter: every *contributor* (weight > 0) sends its slice of part ``j`` to the owner of ``j``; when it
  comes to hold that owner out, it resends the slice to the new owner (it still holds its vector).
* An owner reduces part ``j`` over a contributor set ``S`` once it holds the slice of every contributor
  it does not hold out. It adds ``w_p * x_p`` in sorted peer order with separate, correctly rounded
  multiply and add (or applies the run's robust rule, :mod:`protolearn.protocol.robust`, built the same
  way), so **the value of part j over S is a pure function of S**: any replica that reduces it gets the
  same bytes. It **signs** (round, ``j``, ``S``, SHA-256 of the part's bytes) and
  sends the part with its signature to every participant. A receiver keeps a part only if its bytes
  hash to the signed hash and the signature is the named signer's, and a part over a set that has
  ``peers[j]`` in only if ``peers[j]`` signed it (nobody else ever holds its slice of its own part).
* A signed part of ``j`` over ``S`` **counts** here (:mod:`protolearn.protocol.part_ledger`) once (a) its signer is no later in ``j``'s chain
  than this replica's owner of ``j`` (every peer before the signer is out here) and (b) every
  contributor that ``S`` leaves out is out here. Until then it is held, not used. Two counting parts of
  ``(j, S)`` with different hashes fail the round; if one signer signed both, the two statements are
  the :class:`~.statements.SignedStatement` in :class:`Failed`.
* Each replica keeps ``C`` = the intersection of the sets of every part that counts (initially all
  contributors). An owner whose part was reduced over more than ``C`` reduces it again over ``C`` (it
  keeps the raw slices; if a member of ``C`` is missing and out, over less, shrinking ``C``). A replica
  commits once it holds a counting part over exactly ``C`` for every ``j``; :class:`Done` reports ``C``
  as ``contributors`` and the rest as ``excluded`` (the node redoes their tickets, so I1 holds).
* **Successor first.** An owner sends a reduced part to its successor in the chain first and to the
  others only after the successor has it. So if any survivor holds a part from an owner that then died,
  the backup holds it too, and the backup sends that same signed part on (instead of a new one) when it
  takes over.
* Who is out (:mod:`protolearn.protocol.liveness`). A peer is **held out** (for ownership and for the
  contributor set) once this replica finds it dead or stuck, or once more than ``max_liars`` distinct
  peers claim it dead; it is **dead** only on this replica's own evidence that it is unreachable (a
  broken stream, a refused or unanswered probe, silence past a deadline scaled to the measured
  bandwidth) or on its own word (it left the round). Every message carries its sender's list of peers
  it holds out, but that list is a claim: the receiver probes the peers it names, and a dead one
  refuses the probe.
* Termination: after committing, a replica signs a **fin** (``C`` and the result hash: SHA-256 over the
  parts' hashes) and sends it to every peer, then keeps serving (as owner or backup) until it holds a
  fin from every peer that is not dead; only then is it finished. A fin from a peer that is not dead
  whose ``C`` or result hash differs from ours, or a second, different fin from one peer, turns the
  round into :class:`Failed`. (The adapter answers a late probe of a finished round with its fin, or
  with "left" if the round failed there, so nobody waits out a deadline on a replica that is done.)

Reducer cross-check (``cross_check=True``)
------------------------------------------
* Every contributor signs its slice of each part (:func:`~.statements.slice_statement`) and sends it to
  the part's owner **and** to the owner's successor in the chain, the part's **checker** (re-sending to
  both whenever either changes). Receivers keep a slice only with its sender's signature over its hash.
* An owner's part statement also binds the digest of the hashes of the slices it reduced
  (:func:`~.statements.inputs_digest`). A backup taking over never sums the first owner's own slice (it
  may hold it now), so the rule that only ``peers[j]`` signs a set with ``peers[j]`` in still holds.
* Before committing, the checker of ``j`` (and an owner relaying a dead owner's part) recomputes every
  counting part over ``C`` that another peer signed, from the slices it holds (the same pure function).
  It commits only once each such part checked out, or its missing slices are from dead contributors.
* A mismatch is a **veto**: the checker signs a fin whose result hash is
  :func:`~.statements.veto_digest` of the refused statement (no committed result has it), sends it with
  that statement to every peer, and fails with :attr:`Failed.reducer_faults`: the reducer's signed
  statement and every contributor's signed slice (:mod:`.reducer_check`), which a third party checks
  without trusting the checker. If the reducer's inputs digest is not that of the slices the checker
  holds, the checker cannot tell the reducer from an equivocating contributor: it vetoes without a proof.
* A replica that receives a veto whose hash matches the statement it carries fails at once. An honest
  checker is never dead to an honest replica (T; the adapter answers a late probe of a vetoed round with
  the veto, never with "left"), and its only fin is the veto, so **no honest replica finishes Done with
  a part its honest checker refused**: the round fails, is redone, and the evidence goes to the
  coordinator. A lying checker can veto an honest part (a liar can always fail a round) but its
  evidence does not verify. Owner and checker lying together still go unnoticed; that is the residual
  the statistical monitors and robust aggregation are for.
* Cost: scatter bytes double (each slice goes to two replicas), about 1.5x a round's bytes in all, plus a
  SHA-256 of the vector and one signature per part at each contributor and one extra reduction per part at
  each checker.

Why survivors agree (crash-stop peers)
--------------------------------------
A live contributor's slices reach every part's current owner (it resends on every owner change, and
owners wait for every contributor they do not hold out), so ``C`` only ever loses dead peers. Values are
functions of sets, so survivors can only differ by committing different sets. Take one dead peer X.
Suppose a survivor commits ``C`` containing X; then for every part it holds a reduction that includes X.
A reduction without X can only come (a) from an owner that lacks X's slice, or (b) from re-reducing
after seeing a reduction without X, which needs (a) first. For a part other than X's own, the owner
is its live primary, and it produced a reduction with X, so it holds X's slice: no (a). For X's own
part, a survivor's reduction with X came from X itself, and successor-first means the backup got it
before anyone else; taking over, the backup finds that part over its ``C`` and sends it on instead of
reducing without X: no (a). So no reduction without X ever appears, and every survivor converges on
the same ``C``; if no survivor can commit with X, all converge on ``C`` without X, and finish. Two
deaths in one round converge the same way unless a part's owner and its successor both die after the
owner sent its reduction on; a live peer held out because it is slow leaves the others to wait for its
fin. Either way the argument below, which assumes less, still rules out disagreement: such a round
fails or finishes, identically.

Why honest survivors never diverge (Byzantine peers)
----------------------------------------------------
Model: any number of the ``n`` participants may lie. A liar may send anything to anyone at any time
(forged or equivocating parts and fins, false claims, wrong contributor sets, slices that differ per
receiver) and may collude with other liars, but cannot sign for another peer (Ed25519) nor stop honest
peers' messages. Honest peers may crash. Assumption **T**, a timing assumption the crash argument
makes too: an honest replica never finds a live honest replica *unreachable* (it answers probes
before their deadline, its streams do not break). T is about reachability only: an honest replica
that looks stuck, because it waits on a liar, is held out but is never dead.

*Claim: two honest replicas that both finish Done hold the same contributor set and bit-identical
results.* A replica finishes Done only holding, from every peer that is not dead to it, a signed fin
with its own ``C`` and result hash. Take honest A and B, both Done. An honest B never says it left a
round it finishes Done, so by T, B is not dead to A, and A holds B's fin; an honest B signs one fin, for
what it committed, so B's ``C`` and result hash equal A's. Equal result hashes mean equal part hashes,
hence equal parts in order (SHA-256 is collision resistant): the results are equal bit for bit. This
rests on the all-to-all fin check alone, not on any part, claim or count of liars: it holds for any
number of liars among ``n``, under T.

What the checks on parts and claims add (liveness and accountability, with at most ``f = max_liars``
liars), and what a liar can still do:

* A liar can make a round fail, never make honest replicas diverge: an equivocating part or fin, a
  fin that differs from the honest one, a claim sent to an honest replica that it is dead, a part or a
  fin it never sends (the round then waits for its fin until the round's deadline). :class:`Failed`
  is never applied: the node redoes the step, and the commit barrier keeps every replica of the
  stage from applying it. A peer that signs two stories leaves the two statements in
  :attr:`Failed.evidence`, checkable by a third party.
* It cannot make an honest replica count a part signed by a peer that is not the part's owner in its
  eyes (a), a part whose bytes or signature do not match, a sum with a part's first owner in that the
  first owner did not sign, nor drop a live honest contributor by tagging a smaller set (b) or by
  claiming it dead (more than ``f`` claimants are needed; fewer only make the receiver probe). Such
  parts are held and never used.
* As a part's owner (or as the backup of a dead one) it can sign a wrong value and send that same value
  to everyone, with a fin to match: without the cross-check, honest replicas then agree on a wrong part.
  The backup cannot tell, because it holds none of the part's slices (scatter goes to the owner only;
  the cross-check above sends them to the backup too, for 50% more bytes per round, and still fails when
  owner and backup collude). What the backup does check: the owner's hash and signature, that the part's set leaves out
  only peers the backup itself holds out, and, since it gets the part first and relays exactly that
  signed part if the owner dies, that nobody commits another version without the fins showing it. The
  wrong part stays signed, so attributable; its plausibility is the integrity layer's job (statistical
  monitors, robust aggregation).
* If T breaks (a live honest replica unreachable past its deadlines), two honest replicas can each find
  the other dead and commit different results; the node's parameter-hash check after the step is then
  the last line, as for crashes.
"""

from __future__ import annotations

from collections.abc import Callable
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
    Suspicion,
    Wait,
)
from protolearn.protocol.ownership import Broadcast, Op, owner, part_bounds, successor
from protolearn.protocol.part_ledger import MAX_VERSIONS_PER_SIGNER, PartLedger, SignedPart
from protolearn.protocol.bounds import MAX_PARTICIPANTS, MAX_PEER_ID, PeerId, StageIndex, Step
from protolearn.protocol.reducer_check import ReducerFault, make_fault
from protolearn.protocol.robust import Aggregation, robust_reduce
from protolearn.protocol.statements import (
    HASH_BYTES,
    SIGNATURE_BYTES,
    SignedStatement,
    Sign,
    Verify,
    fin_statement,
    inputs_digest,
    is_part_statement,
    members_mask,
    op_tag,
    part_hash,
    result_hash,
    round_digest,
    slice_statement,
    veto_digest,
)
from protolearn.protocol.wire import Message
from pydantic import Field

# The liveness names stay importable from here: the adapter and the tests know the collective only.
__all__ = [
    "DEFAULT_FACTOR", "DEFAULT_FLOOR_S", "DEFAULT_TIMEOUT_S", "EMA_ALPHA", "INITIAL_BYTES_PER_S", "MAX_PARTICIPANTS",
    "MAX_VERSIONS_PER_SIGNER", "STUCK_FACTOR", "Action", "Aggregation", "Bandwidth", "CollectiveRound", "Done", "SignedStatement",
    "Failed", "PartHeader", "Probe", "ReducerFault", "Rejected", "PartFilter", "Send",
]

# A round's parts travel on the protocol named protocol/pipeline.py's COLLECTIVE, next to the rest of that
# exchange (ResultRequest, Ack, Refuse). It is not defined here: this module imports pipeline, so a name
# kept here and re-exported there would be an import cycle.
# Hard cap on one round; the adaptive per-wait deadlines below normally end a round long before.
DEFAULT_TIMEOUT_S = 60.0
# A part statement: domain, round digest, part and mask length, mask, inputs digest, hash.
MAX_STATEMENT_BYTES = 64 + HASH_BYTES + 6 + MAX_PARTICIPANTS // 8 + 2 * HASH_BYTES

Phase = Literal["scatter", "gather", "fin"]
# Rewrites a part this replica reduced (part index, data) before it signs it: injected from outside
# to test that the reducer cross-check catches a wrong part; None in real use.
PartFilter = Callable[[int, torch.Tensor], torch.Tensor]


class PartHeader(Message):
    """Precedes a part (scatter/gather: a raw float32 tensor follows) or is alone (fin, probe).

    ``contributors``: for gather, whose vectors the part sums; for fin, the sender's committed set.
    ``suspects``: peers the sender holds to be out (a claim: it makes the receiver probe them).
    ``signer``, ``digest``, ``signature``: for gather, the reducer, the part's SHA-256 and the reducer's
    signature of it (:func:`~.statements.part_statement`; the sender may relay another's part); for fin,
    the sender, its result hash and its signature (:func:`~.statements.fin_statement`); for scatter in a
    cross-checked round, the contributor, its slice's SHA-256 and its signature (:func:`~.statements.slice_statement`).
    ``inputs``: for gather in a cross-checked round, the digest of the slices the reducer reduced.
    ``vetoed``: for a vetoing fin, the part statement it refuses (its hash is the fin's result hash).
    """

    KIND: ClassVar[str] = "collective.part"
    round: Step
    stage: StageIndex
    phase: Literal["scatter", "gather", "fin", "probe"]
    part: Annotated[int, Field(ge=0, lt=MAX_PARTICIPANTS)]
    contributors: list[PeerId] = Field(default_factory=list, max_length=MAX_PARTICIPANTS)
    suspects: list[PeerId] = Field(default_factory=list, max_length=MAX_PARTICIPANTS)
    signer: Annotated[str, Field(max_length=MAX_PEER_ID)] = ""
    digest: Annotated[bytes, Field(max_length=HASH_BYTES)] = b""
    signature: Annotated[bytes, Field(max_length=SIGNATURE_BYTES)] = b""
    inputs: Annotated[bytes, Field(max_length=HASH_BYTES)] = b""
    vetoed: Annotated[bytes, Field(max_length=MAX_STATEMENT_BYTES)] = b""


@dataclass(frozen=True)
class Send:
    """Deliver ``data`` (part ``part`` of ``phase``; None for fin) to ``peer``; report back with
    :meth:`CollectiveRound.delivered` or :meth:`CollectiveRound.peer_failed`. A gather or fin carries
    its ``signer``, ``digest`` and ``signature`` (see :class:`PartHeader`)."""

    peer: str
    phase: Phase
    part: int
    data: torch.Tensor | None
    contributors: tuple[str, ...] = ()
    signer: str = ""
    digest: bytes = b""
    signature: bytes = b""
    inputs: bytes = b""
    vetoed: bytes = b""


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
    """The round finished: ``result`` is bit-identical on every honest survivor and sums exactly
    ``contributors``. ``digest`` is its result hash and ``signature`` this replica's signed fin of it."""

    result: torch.Tensor
    contributors: list[str] = field(default_factory=list)
    excluded: list[str] = field(default_factory=list)
    reason: str = "all parts gathered"
    digest: bytes = b""
    signature: bytes = b""


@dataclass(frozen=True)
class Failed:
    """The round cannot finish: ``missing`` peers did not deliver, or the replicas disagreed. When a peer
    signed two different stories, ``evidence`` holds both statements (checkable by a third party). When
    this replica vetoed a part its reducer got wrong, ``reducer_faults`` proves it
    (:func:`~.reducer_check.verify_reducer_fault`)."""

    missing: list[str]
    reason: str
    evidence: tuple[SignedStatement, ...] = ()
    reducer_faults: tuple[ReducerFault, ...] = ()


Action = Send | Probe | Rejected | Done | Failed


@dataclass(frozen=True)
class _Fin:
    members: frozenset[str]
    digest: bytes
    signature: bytes


@dataclass
class CollectiveRound:
    """One all-reduce among ``weights``' peers; ``me`` is this replica.

    ``weights`` maps every participant's peer id to its weight (its ticket count; 0 = contributes nothing
    but still reduces). All participants must use the same ``round_id``, ``weights``, ``numel`` and ``op``.
    ``sign(data)`` is this replica's signature of ``data``; ``verify(peer, data, signature)`` checks a
    peer's. ``max_liars``: how many lying participants a claim must outnumber to count (see the docstring).
    ``aggregation``: how a part combines its contributors (:mod:`.robust`; the mean by default).
    ``cross_check``: contributors also send (signed) slices to each part's checker, which recomputes the
    owner's part and vetoes the round if it differs (see "Reducer cross-check"). ``part_filter``: applied to
    the parts this replica reduces before it signs them (injected by integrity tests; None in real use). All participants must use
    the same ``aggregation`` and ``cross_check`` (both are bound into every statement).
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
        if self.max_liars < 0:
            raise ValueError(f"max_liars must be at least 0, got {self.max_liars}")
        self.peers = sorted(self.weights)
        self.bounds = part_bounds(self.numel, len(self.peers))
        self._op_tag = op_tag(self.op, self.aggregation.tag, self.cross_check)
        self._round_digest = round_digest(self.round_id, self.weights, self.numel, self._op_tag)
        self._all = frozenset(p for p in self.peers if self.weights[p] > 0)
        self._C = self._all  # the intersection of every counting part's set seen so far
        self._now = 0.0
        self._started_at: float | None = None
        self._local: torch.Tensor | None = None
        self._owner_seen: dict[int, str] = {}
        self._sent_to: dict[int, set[str]] = {}  # part -> reducers (owner, checker) that have my slice of it
        self._slices: dict[int, dict[str, torch.Tensor]] = {}  # parts I (may) reduce or check: sender -> slice
        # Cross-check: each held slice's hash and its contributor's signature (mine too), and the parts checked.
        self._proofs: dict[int, dict[str, tuple[bytes, bytes]]] = {}
        self._checked: set[tuple[int, bytes, bytes]] = set()
        self._veto: _Fin | None = None
        self._vetoed_statement = b""
        self._ledger = PartLedger(self.round_id, self.peers, self._all, self._round_digest, self.verify, self.cross_check)
        self._broadcasts: dict[tuple[int, frozenset[str]], Broadcast] = {}
        self._detector = FailureDetector(self.floor_s, self.factor, self.bandwidth)
        self._suspicion = Suspicion(self.max_liars, self.suspects)
        # Out by this replica's own evidence that they are unreachable (a broken stream, a refused or unanswered
        # probe, silence past a deadline) or by their own word (they left): the only peers whose fin is not needed.
        self._dead: set[str] = set()
        self._fins: dict[str, _Fin] = {}
        self._committed: Done | None = None
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
        """The first peer of ``part``'s chain this replica does not hold out (never None: not itself)."""
        return owner(self.peers, part, self.suspects, self.me)

    def checker(self, part: int) -> str | None:
        """The peer that cross-checks ``part``'s owner here: the next one in its chain (None: nobody)."""
        return successor(self.peers, part, self.owner(part), self.suspects)

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
        signer: str = "",
        digest: bytes = b"",
        signature: bytes = b"",
        inputs: bytes = b"",
        vetoed: bytes = b"",
        data_digest: bytes | None = None,
        now: float | None = None,
    ) -> list[Action]:
        """Take one message from ``peer``; parts that arrive before :meth:`start` are kept.

        ``data_digest``: the SHA-256 of ``data`` if the caller already computed it (the adapter does, in a
        worker thread); otherwise the round computes it.
        """
        if now is not None:
            self._now = max(self._now, now)
        if self._finished is not None:
            return [] if phase in ("fin", "probe") else [Rejected(peer, f"round {self.round_id} is already finished")]
        reason = self._check(peer, phase, part, data, contributors, suspects)
        if reason:
            return [Rejected(peer, reason)]
        if self.me in suspects:
            return self._fail([peer], f"{peer} believes this replica died in round {self.round_id}; resync from a replica")
        if phase == "gather":
            assert data is not None
            if data_digest is None:
                data_digest = part_hash(data)
            reason = self._ledger.check(part, frozenset(contributors), data_digest, signer, digest, signature, inputs)
            if reason:
                return [Rejected(peer, reason)]
        elif phase == "scatter" and self.cross_check:
            assert data is not None
            if data_digest is None:
                data_digest = part_hash(data)
            reason = self._check_slice(peer, part, data_digest, signer, digest, signature)
            if reason:
                return [Rejected(peer, reason)]
        elif phase == "fin":
            reason = self._check_fin(peer, frozenset(contributors), digest, signature)
            if not reason and vetoed and (veto_digest(vetoed) != digest or not is_part_statement(vetoed, self._round_digest)):
                reason = "a vetoing fin's hash must be the veto digest of a part statement of this round"
            if reason:
                return [Rejected(peer, reason)]
            if vetoed:
                # It signed a fin no result matches: it will never commit, so neither can this round here.
                fin = _Fin(frozenset(contributors), digest, signature)
                return self._fail([peer], f"{peer} vetoed a part of round {self.round_id} that its reducer got wrong",
                                  (self._fin_evidence(peer, fin),))
        now_out, to_probe = self._suspicion.claimed(peer, suspects)
        actions: list[Action] = [Probe(p) for p in to_probe]
        self._detector.alive(peer, self._now)
        if phase == "fin":
            fin = _Fin(frozenset(contributors), digest, signature)
            old = self._fins.setdefault(peer, fin)
            if old != fin:
                return actions + self._fail([peer], f"{peer} sent two different fins in round {self.round_id}",
                                            (self._fin_evidence(peer, old), self._fin_evidence(peer, fin)))
        elif phase == "scatter":
            assert data is not None
            self._slices.setdefault(part, {})[peer] = data
            if self.cross_check:
                self._proofs.setdefault(part, {})[peer] = (digest, signature)
            self._bytes_in += 4 * data.numel()
        elif phase == "gather":
            assert data is not None
            self._bytes_in += 4 * data.numel()
            conflict = self._ledger.add(part, frozenset(contributors), SignedPart(data, digest, signer, signature, inputs))
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
        due = self._detector.due(now, self._waits())
        actions: list[Action] = [Probe(p) for p in due.probes]
        if due.suspects:
            for p in due.suspects:
                self._suspicion.observed(p)
            self._dead |= due.silent
            actions += self._advance()
        return actions

    def missing(self) -> list[str]:
        """Peers this replica is waiting on right now."""
        return sorted({p for key in self._detector.wait_keys() for p in self._waited_peers(key)})

    # -- checks ----------------------------------------------------------------------------------
    def _check(self, peer: str, phase: str, part: int, data: torch.Tensor | None, contributors, suspects) -> str:
        if peer not in self.weights:
            return f"peer is not a participant of round {self.round_id}"
        if peer == self.me:
            return "a replica cannot send parts to itself"
        if not all(s in self.weights for s in suspects):
            return "suspects name a peer that is not a participant"
        if phase == "probe":
            return ""
        members = set(contributors)
        if len(members) != len(contributors) or not members <= self._all:
            return f"{phase} names a contributor set that is not a subset of the round's contributors"
        if phase == "fin":
            return ""
        if phase not in ("scatter", "gather"):
            return f"unknown phase {phase[:32]!r}"
        if not 0 <= part < len(self.peers):
            return f"part {part} is out of range 0..{len(self.peers) - 1}"
        if phase == "scatter":
            if self.weights[peer] <= 0:
                return "a participant with weight 0 must not contribute"
            if self._owner_with(part, set(suspects)) != self.me and not (self.cross_check and self._checker_with(part, set(suspects)) == self.me):
                return f"scatter of part {part} sent to a replica that does not reduce it"
            if peer in self._slices.get(part, {}):
                return f"duplicate scatter of part {part}"
        a, b = self.bounds[part]
        if data is None or data.dtype != torch.float32 or data.dim() != 1 or data.numel() != b - a:
            got = "nothing" if data is None else f"{data.dtype} {list(data.shape)}"
            return f"part {part} must be float32 of {b - a} elements, got {got}"
        # amax/amin propagate NaN and carry ±Inf, and cost a fraction of a full isfinite pass.
        if data.numel() and not bool(torch.isfinite(data.amax()) & torch.isfinite(data.amin())):
            return f"part {part} contains NaN or Inf"
        return ""

    def _check_fin(self, peer: str, members: frozenset[str], digest: bytes, signature: bytes) -> str:
        if len(digest) != HASH_BYTES or len(signature) != SIGNATURE_BYTES:
            return f"fin must carry a {HASH_BYTES}-byte result hash and a {SIGNATURE_BYTES}-byte signature"
        if not self.verify(peer, fin_statement(self._round_digest, self._mask(members), digest), signature):
            return "fin's signature does not verify as the sender's"
        return ""

    def _mask(self, members: frozenset[str] | set[str] | tuple[str, ...] | list[str]) -> bytes:
        return members_mask(self.peers, members)

    def _fin_evidence(self, peer: str, fin: _Fin) -> SignedStatement:
        return SignedStatement(peer, fin_statement(self._round_digest, self._mask(fin.members), fin.digest), fin.signature,
                        f"fin of round {self.round_id}")

    def _owner_with(self, part: int, extra: set[str]) -> str:
        # The sender's claims count here (it only decides where a slice may be kept), never against me.
        return owner(self.peers, part, self.suspects | (extra - {self.me}), self.me)

    def _checker_with(self, part: int, extra: set[str]) -> str | None:
        out = self.suspects | (extra - {self.me})
        return successor(self.peers, part, owner(self.peers, part, out, self.me), out)

    def _check_slice(self, peer: str, part: int, data_digest: bytes, signer: str, digest: bytes, signature: bytes) -> str:
        if signer != peer or len(digest) != HASH_BYTES or len(signature) != SIGNATURE_BYTES:
            return f"scatter of part {part} must carry its sender's {HASH_BYTES}-byte hash and {SIGNATURE_BYTES}-byte signature"
        if data_digest != digest:
            return f"scatter of part {part}: the bytes do not hash to the signed hash"
        if not self.verify(peer, slice_statement(self._round_digest, part, digest), signature):
            return f"scatter of part {part}: the signature does not verify as the sender's"
        return ""

    def _reduce(self, held: dict[str, torch.Tensor], members: frozenset[str], part: int) -> torch.Tensor:
        a, b = self.bounds[part]
        return robust_reduce(held, members, self.weights, self.op, b - a, self.aggregation)

    def _inputs(self, part: int, members: frozenset[str]) -> bytes:
        if not self.cross_check:
            return b""
        proofs = self._proofs.get(part, {})
        return inputs_digest([proofs[p][0] for p in sorted(members)])

    def _slice_targets(self, part: int) -> list[str]:
        o = self.owner(part)
        c = self.checker(part) if self.cross_check else None
        return [o] if c is None or c == o else [o, c]

    def _my_slice(self, part: int) -> tuple[torch.Tensor, bytes, bytes]:
        assert self._local is not None
        a, b = self.bounds[part]
        data = self._local[a:b]
        if not self.cross_check:
            return data, b"", b""
        mine = self._proofs.setdefault(part, {})
        if self.me not in mine:
            digest = part_hash(data)
            mine[self.me] = (digest, self.sign(slice_statement(self._round_digest, part, digest)))
        return data, *mine[self.me]

    def _cross_check(self) -> tuple[bool, list[Action]]:
        """Check every part over C that counts here and that this replica checks (as its owner's successor,
        or as the owner relaying a dead owner's part) against the slices held; (all checked, veto actions).
        A part whose slices are missing from a dead contributor cannot be checked and is taken as it is."""
        if not self.cross_check or self._committed is not None:
            return True, []
        complete = True
        for j in range(len(self.peers)):
            if self.me not in (self.owner(j), self.checker(j)):
                continue
            p = self._ledger.counted(j, self._C)
            if p is None or p.signer == self.me or (j, p.digest, p.inputs) in self._checked:
                continue
            held = self._slices.get(j, {})
            missing = [c for c in self._C if c not in held]
            if missing:
                if all(c in self._dead for c in missing):
                    self._checked.add((j, p.digest, p.inputs))
                else:
                    complete = False
                continue
            if self._inputs(j, self._C) != p.inputs:
                return False, self._vetoed(j, p, None, f"{p.signer} signed part {j} as the reduction of other slices than its "
                                                       "contributors sent this replica (the reducer or a contributor lied)")
            if part_hash(self._reduce(held, self._C, j)) != p.digest:
                fault = make_fault(self.round_id, self.weights, self.numel, self.op, j, sorted(self._C), p.signer, p.inputs,
                                   p.digest, p.signature, [(c, held[c], self._proofs[j][c][1]) for c in sorted(self._C)])
                return False, self._vetoed(j, p, fault, f"{p.signer} signed part {j} of round {self.round_id} with bytes that are "
                                                        "not the reduction of the slices it signed for")
            self._checked.add((j, p.digest, p.inputs))
        return complete, []

    def _vetoed(self, part: int, p: SignedPart, fault: ReducerFault | None, reason: str) -> list[Action]:
        """Refuse a wrong part for good: sign a fin no honest result matches, send it to all, and fail here."""
        members = self._C
        statement = self._ledger.statement(part, members, p.digest, p.inputs)
        digest = veto_digest(statement)
        self._veto = _Fin(members, digest, self.sign(fin_statement(self._round_digest, self._mask(members), digest)))
        self._vetoed_statement = statement
        tag = tuple(sorted(members))
        sends: list[Action] = [Send(q, "fin", 0, None, tag, self.me, digest, self._veto.signature, vetoed=statement)
                               for q in self.peers if q != self.me]
        self._finished = Failed([p.signer], reason, (self._ledger.evidence(part, members, p),), () if fault is None else (fault,))
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
            data = self._reduce(held, members, j)
            if self.part_filter is not None:
                a, b = self.bounds[j]
                data = self.part_filter(j, data).detach().to(torch.float32).contiguous().reshape(-1)[: b - a]
            digest = part_hash(data)
            inputs = self._inputs(j, members)
            signature = self.sign(self._ledger.statement(j, members, digest, inputs))
            self._ledger.add(j, members, SignedPart(data, digest, self.me, signature, inputs))
            reduced = True
        return reduced

    # -- internals -------------------------------------------------------------------------------
    def _limit(self, key: tuple) -> float:
        # An owner waits one phase for slices; a participant waits for an owner that may itself be waiting.
        return self.wait_s() * (1 if key[0] == "own" else 2)

    def _waits(self) -> dict[tuple, Wait]:
        # A fin is waited for until it comes or its sender is dead; a stuck sender is out already.
        return {key: Wait(self._waited_peers(key), self._limit(key), key[0] == "fin" and key[1] in self.suspects)
                for key in self._detector.wait_keys()}

    def _waited_peers(self, key: tuple) -> list[str]:
        if key[0] == "own":
            held = self._slices.get(key[1], {})
            return sorted(c for c in self._C if c not in held and c not in self.suspects)
        if key[0] == "fin":
            return [key[1]] if key[1] not in self._dead else []
        return [key[-1]] if key[-1] not in self.suspects else []

    def _fail(self, missing: list[str], reason: str, evidence: tuple[SignedStatement, ...] = ()) -> list[Action]:
        self._finished = Failed(missing, reason, evidence)
        return [self._finished]

    def _advance(self) -> list[Action]:
        if self._started_at is None or self._finished is not None:
            return []
        actions: list[Action] = []
        n, me, local = len(self.peers), self.me, self._local
        assert local is not None
        # Sender: my slice of every part must be at that part's current owner.
        if self.weights[me] > 0:
            for j in range(n):
                have = self._sent_to.setdefault(j, set())
                for o in self._slice_targets(j):
                    if o in have:
                        continue
                    have.add(o)
                    data, digest, signature = self._my_slice(j)
                    if o == me:
                        self._slices.setdefault(j, {})[me] = data
                    else:
                        actions.append(Send(o, "scatter", j, data, (), me if digest else "", digest, signature))
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
        checked, vetoed = self._cross_check()
        if vetoed:
            return actions + vetoed
        counted = [self._ledger.counted(j, self._C) for j in range(n)]
        parts = [p for p in counted if p is not None]
        if self._committed is None and len(parts) == n and checked:
            if self.op == "weighted_mean" and not self._C:
                return actions + self._fail(sorted(self._all), f"round {self.round_id}: no contribution survived")
            digest = result_hash([p.digest for p in parts])
            signature = self.sign(fin_statement(self._round_digest, self._mask(self._C), digest))
            self._committed = Done(torch.cat([p.data for p in parts]), sorted(self._C), sorted(self._all - self._C),
                                   "all parts gathered" if self._C == self._all else "dead peers' contributions left out",
                                   digest, signature)
            if not self.suspects:
                self.bandwidth.observe(self._bytes_in, self._now - self._started_at)
            # Suspected peers get a fin too: one wrongly held out sees itself in our suspects and fails
            # its round rather than committing a different set (a dead one just fails the send).
            fin = tuple(sorted(self._C))
            actions += [Send(p, "fin", 0, None, fin, me, digest, signature) for p in self.peers if p != me]
        self._track_waits()
        if self._committed is not None:
            # A dead replica's fin does not matter (it may hold a part nobody else got); any other's must match,
            # also one that is out here only because it is stuck or others claim so: it may be alive and done.
            mine_fin = (self._C, self._committed.digest)
            bad = sorted(p for p, f in self._fins.items() if (f.members, f.digest) != mine_fin and p not in self._dead)
            if bad:
                own = _Fin(self._C, self._committed.digest, self._committed.signature)
                evidence = (self._fin_evidence(me, own), *(self._fin_evidence(p, self._fins[p]) for p in bad))
                return actions + self._fail(bad, f"round {self.round_id}: replicas {bad} committed a different contributor "
                                                 "set or result", evidence)
            if all(p in self._fins or p in self._dead for p in self.peers if p != me):
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

    def _track_waits(self) -> None:
        """Tell the detector what this replica waits on now (a deadline counts from a wait's start)."""
        waits = set()
        for j in range(len(self.peers)):
            if self._ledger.counted(j, self._C) is not None:
                continue
            o = self.owner(j)
            waits.add(("own", j) if o == self.me else ("gather", j, o))
        if self._committed is not None:
            waits.update(("fin", p) for p in self.peers if p != self.me and p not in self._dead and p not in self._fins)
        elif self.cross_check:  # a part to check waits for the slices it was reduced from
            for j in range(len(self.peers)):
                p = self._ledger.counted(j, self._C)
                if p is not None and p.signer != self.me and self.me in (self.owner(j), self.checker(j)):
                    held = self._slices.get(j, {})
                    waits.update(("check", j, c) for c in self._C if c not in held and c != self.me)
        self._detector.track((k for k in waits if self._waited_peers(k) or k[0] != "own"), self._now)
