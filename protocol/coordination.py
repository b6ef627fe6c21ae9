"""Messages between nodes (and `swarm status`) and the coordinator.

Every request kind is a :class:`~protolearn.protocol.wire.Message` with a ``coord.`` kind, sent as one
request/response of the protocol named :data:`COORDINATOR`. The coordinator carries no tensors, so every field is small
and bounded here: a peer cannot make the coordinator allocate without bound (I4).

Request → reply:

- :class:`ReachabilityRequest` → :class:`ReachabilityReply`: can the internet reach a node about to join? The
  coordinator dials it back from a second host, on a fresh connection, at the node's own observed IP only
  (``coordinator/core/reachability.py``), and offers relays to a private node.
- :class:`Join` → :class:`JoinReply`: the run config (TOML) and its hash, the assigned stage, the view and bans.
- :class:`Heartbeat` → :class:`HeartbeatReply` (also on a :data:`BEATS` stream): the node's state in, the current step, bans, the
  (possibly changed) stage assignment, the replicas per stage and the membership view out. The view
  holds a bounded number of members of each stage and is sent only when it changed since the view
  version the node holds: as a snapshot that replaces its list, or, when the node asks with
  ``view_delta``, as the changed members of its own and the neighbouring stages plus the peers to
  drop (``removed``). See ``coordinator/core/view.py``.
- :class:`Lease` → :class:`LeaseReply`, :class:`Release` → :class:`ReleaseReply`: tickets of the
  open step, in small blocks (stage-0 nodes only).
- :class:`Complete` → :class:`CompleteReply`: a ticket's backward pass reached stage 0, with the last
  stage's signed acknowledgement of the route and loss (``bad_ack``/``bad_loss`` refusals otherwise).
- :class:`WaitStep` → :class:`StepInfo`: a long poll that answers as soon as step ``t`` closes (or at the
  timeout), with its frozen accounting: stage → peer → tickets, and the mean loss. With
  ``until="committed"`` it answers once the step commits or reopens instead.
- :class:`Averaged` → :class:`StepInfo`: a participant of stage ``s`` finished averaging the step's
  revision with every contribution in, and names the result's hash. The step *commits* once a strict
  majority of every stage's live replicas reported the same hash and every live replica reported; only
  then does any replica apply it (the commit barrier, I1). A replica whose hash is not the majority's is
  refused with ``result_mismatch`` and resyncs (see ``coordinator/core/commit.py``).
- :class:`Redo` → :class:`RedoReply`: un-complete tickets whose route broke (fault tolerance, I1).
- :class:`OuterReady` → :class:`OuterDecision` (DiLoCo mode): a long poll for a stage's outer round: who
  averages pseudo-gradients with what weight, who follows, who is left out (``coordinator/core/outer_rounds.py``).
- :class:`CorpusCheck` → :class:`CorpusCheckReply`: a node that reads the training data (stage 0 or the
  last stage) checks its corpus fingerprint against the swarm's; the first one sets it.
- :class:`Report` → :class:`ReportReply`: a fault report about a peer, with optional signed evidence.
- :class:`WitnessDraw` → :class:`WitnessDrawReply`: the replicas a spot check must ask to recompute an output
  (drawn by the coordinator, ``coordinator/core/witnesses.py``); :class:`IntegrityReport` → :class:`ReportReply`.
- :class:`Leave` → :class:`LeaveReply`.
- :class:`StatusRequest` → :class:`~protolearn.protocol.status_schema.Status`: the swarm view (its
  schema: ``protocol/status_schema.py``; built by ``coordinator/core/status.py``).
"""

from __future__ import annotations

from typing import Annotated, ClassVar, Literal

from protolearn.precision import Precision
from protolearn.protocol.boundary import MAX_WITNESSES, Direction, OutputEvidence
from protolearn.protocol.bounds import MAX_HASH, MAX_PARTICIPANTS, MAX_STAGES, Hash, InFlight, MemoryGB, Nonce, PeerId, Session, Signature, StageIndex, Step, Ticket
from protolearn.protocol.reducer_check import ReducerFault
from protolearn.protocol.rounds import MAX_OUTER_ATTEMPTS
from protolearn.protocol.states import NodeState
from protolearn.protocol.wire import Message, Record
from protolearn.step_limits import MAX_TICKETS_PER_STEP
from pydantic import Field

# The protocol's name, defined here only; the transport's protocol_id() makes it /protolearn/coordinator/1.0.0.
COORDINATOR = "coordinator"
# Heartbeats also go on one long-lived stream per member (a Heartbeat in, its HeartbeatReply or an ErrorReply
# out, for as long as both keep it open): a request on a new stream costs about 4x the CPU of one on an open
# stream, at both ends (docs/BENCHMARKS.md, "Coordinator over the network").
BEATS = "coordinator-beats"

# Bounds on every variable-size field (peer IDs and stage indices: protocol/bounds.py). Multiaddrs are
# short. A member's addresses travel in every view reply, so they are few and short: 4 of 256 characters
# keep a view entry under ~1.2 KiB. A full /ip4/…/tcp/…/p2p/<peer id> is ~90 characters; a relayed
# node's circuit address (relay address + /p2p-circuit/p2p/<its id>) is ~170.
MAX_ADDR = 256
MAX_ADDRS = 4
MAX_TEXT = 512
MAX_TICKETS_PER_REQUEST = 1024
MAX_EVIDENCE_BYTES = 64 * 1024
# The run config a JoinReply or Members reply carries (a run TOML is a few KiB).
MAX_RUN_TOML = 256 * 1024
# A heartbeat carries the parameter hashes after the node's last HASH_HISTORY applied steps, so a joiner can
# check a donor's snapshot that is a few steps behind the donor (which trains on while the joiner downloads).
HASH_HISTORY = 8
# (replica, step, hash) entries a StageHashes reply lists: 256 replicas' latest, or fewer replicas' histories.
MAX_STAGE_HASHES = 256 * HASH_HISTORY
# A long poll never holds a stream longer than this.
MAX_WAIT_S = 30.0
# The largest reply the coordinator sends: the transport's default frame cap
# (protocol/transport HostConfig.max_message_bytes), which is what a node reads at most.
MAX_REPLY_BYTES = 16 * 1024 * 1024

NODE_STATES: tuple[str, ...] = tuple(s.value for s in NodeState)
# On the wire a state is its string value; the schema turns it into the enum (and refuses any other).
State = Annotated[NodeState, Field(strict=False)]
# The longest heartbeat interval a coordinator may ask for (a node beats at least this often).
MAX_HEARTBEAT_INTERVAL_S = 600.0

Addr = Annotated[str, Field(min_length=1, max_length=MAX_ADDR)]
Text = Annotated[str, Field(max_length=MAX_TEXT)]
Rate = Annotated[float, Field(ge=0.0, le=1e15, allow_inf_nan=False)]
RunToml = Annotated[str, Field(max_length=MAX_RUN_TOML)]
# The coordinator's verdict on whether a node can be dialled from the internet (coordinator/core/reachability.py).
Reachability = Literal["public", "private", "unknown"]
# How a node's stage peers reach it now: "" until it says.
NodePath = Literal["", "direct", "relayed", "hole-punched"]
# Where the finished run's model is (see HeartbeatReply.final).
FinalState = Literal["", "collecting", "saved"]
# Relay addresses a ReachabilityReply offers: the coordinator's own (with --relay) and a few public members'.
MAX_RELAYS = 4


class MemberView(Record):
    """One live member as other nodes need to see it: enough to route to it and average with it."""

    peer_id: PeerId
    stage: int
    addrs: list[Addr]
    state: State
    throughput: float
    queue_len: int


class ReachabilityRequest(Message):
    """Can the internet dial this node? ``addrs`` are its own listen addresses: the coordinator takes only
    their TCP ports from them and dials those at the IP it sees the request come from, never elsewhere."""

    KIND: ClassVar[str] = "coord.reachability_request"
    addrs: list[Addr] = Field(max_length=MAX_ADDRS)


class ReachabilityReply(Message):
    KIND: ClassVar[str] = "coord.reachability_reply"
    # public: a dial-back reached it; private: every dial failed; unknown: nothing could be dialled.
    verdict: Reachability
    reason: Text
    # The (ip, port) the coordinator sees the node's connection come from (0: unknown). A port other than
    # the node's own local port means its NAT rewrites ports, and hole punching is not worth trying.
    observed_ip: Annotated[str, Field(max_length=64)] = ""
    observed_port: Annotated[int, Field(ge=0, le=65535)] = 0
    # The addresses the dial-back reached: the node advertises these first.
    reachable: list[Addr] = Field(default_factory=list, max_length=MAX_ADDRS)
    # Relays a private node may reserve a slot on, in order of preference.
    relays: list[Addr] = Field(default_factory=list, max_length=MAX_RELAYS)


class Join(Message):
    KIND: ClassVar[str] = "coord.join"
    addrs: list[Addr] = Field(max_length=MAX_ADDRS)
    device: Annotated[str, Field(max_length=64)] = "cpu"
    # The memory its stage may use and the microbatches it lets in at once (0: not said): the coordinator
    # places it only in a stage whose footprint (stages/footprint.py) fits.
    memory_gb: MemoryGB = 0.0
    max_in_flight: InFlight = 0
    # What it computes in (protolearn/precision.py): a claim, refused unless the run admits it.
    precision: Precision = "fp32"
    # Measured throughput in layer-tokens per second (stage independent: the node has no stage yet).
    throughput: Rate = 0.0
    name: Annotated[str, Field(max_length=64)] = ""
    # What the node believes of its own reachability: shown in its log only; the coordinator keeps its own verdict.
    reachability: Reachability = "unknown"
    # The node offers to relay for private nodes (the coordinator offers it only once its verdict is public).
    relay: bool = False
    # This process's session, and the one its data dir's previous process used (its lock says that one ended).
    session: Session = ""
    previous_session: Session = ""


class JoinReply(Message):
    KIND: ClassVar[str] = "coord.join_reply"
    REPEATED_RECORDS: ClassVar[tuple[str, ...]] = ("members",)
    stage: int
    run_toml: RunToml
    run_hash: str
    # The first step not yet committed: the stage state a joining node needs is the one before it.
    step: int
    rejoined: bool
    reason: str
    heartbeat_interval_s: float
    expiry_s: float
    lease_s: float
    bans: list[str]
    view_version: int
    # Every stage's members, bounded: see coordinator/core/view.py.
    members: list[MemberView]


class RecentHash(Record):
    step: Step
    hash: Hash


class PeerCheck(Record):
    """What a node's integrity checks found of one peer whose outputs it receives (node/integrity.py)."""

    peer_id: PeerId
    # The boundary monitor's score: 0 looks like its stage's other replicas, >= 1 is a suspect.
    score: Annotated[float, Field(ge=0.0, le=1e6, allow_inf_nan=False)]
    state: Literal["probation", "trusted", "failed"]
    passed: Annotated[int, Field(ge=0, lt=2**31)]
    failed: Annotated[int, Field(ge=0, lt=2**31)]


MAX_PEER_CHECKS = 64


class Heartbeat(Message):
    KIND: ClassVar[str] = "coord.heartbeat"
    state: State
    throughput: Rate = 0.0
    queue_len: Annotated[int, Field(ge=0, lt=2**31)] = 0
    # The last step this node applied (-1: none yet) and the hash of its stage's parameters after it.
    step: Annotated[int, Field(ge=-1, lt=2**62)] = -1
    param_hash: Hash = ""
    loss: Annotated[float | None, Field(allow_inf_nan=False)] = None
    # The membership view version the node holds; the reply omits the view when it is current.
    view_version: int = -1
    # The stage the node serves now: it lags the assigned stage while the node finishes a step before moving.
    stage: Annotated[int, Field(ge=-1, lt=MAX_STAGES)] = -1
    # The node merges view deltas: send what changed since view_version (members, removed), not a snapshot.
    view_delta: bool = False
    # The parameter hashes after its last few applied steps (``step`` included), oldest first.
    recent: list[RecentHash] = Field(default_factory=list, max_length=HASH_HISTORY)
    # Its integrity checks of the peers it receives tensors from (the most recently seen first).
    checks: list[PeerCheck] = Field(default_factory=list, max_length=MAX_PEER_CHECKS)
    # How its stage peers reach it now ("": not said).
    path: NodePath = ""
    # The addresses peers should dial it at now, when they changed since it joined (a node behind a NAT
    # whose relay went away reserved on another); empty: unchanged.
    addrs: list[Addr] = Field(default_factory=list, max_length=MAX_ADDRS)
    session: Session = ""  # the session it joined with: another process's heartbeats are refused
    # DiLoCo: the last inner step it applied (-1: none, or not in DiLoCo mode); ``step``/``param_hash`` and
    # ``recent`` then name its state after the last outer syncs, the only states its stage's replicas share.
    inner_step: Annotated[int, Field(ge=-1, lt=2**62)] = -1


class HeartbeatReply(Message):
    KIND: ClassVar[str] = "coord.heartbeat_reply"
    REPEATED_RECORDS: ClassVar[tuple[str, ...]] = ("members",)
    stage: int
    # The step the stages are at: the first one not yet committed (a joining node's state is after the one before).
    step: int
    last_closed: int
    bans: list[str]
    view_version: int
    view_changed: bool
    # With view_changed: a snapshot (every stage, bounded) that replaces the node's list, or, when
    # view_delta, its neighbourhood's members that changed (to add or replace) after dropping ``removed``.
    members: list[MemberView]
    reason: str
    view_delta: bool = False
    # Peers that stopped being live members anywhere, or left the node's neighbourhood (delta only).
    removed: list[str] = Field(default_factory=list)
    # Per stage, the replicas serving it now (training or averaging): which stages have none, also
    # for a node whose (delta) view holds only its neighbourhood.
    stage_replicas: list[int] = Field(default_factory=list)
    # The finished run's model: "collecting" while the coordinator fetches it from the replicas (a member
    # that finished the run stays and serves its stage until then), "saved" once it holds it, "" otherwise.
    final: FinalState = ""
    # The interval to beat at from now on: it grows with the swarm (coordinator/core/pacing.py); 0: unchanged.
    heartbeat_interval_s: Annotated[float, Field(ge=0, le=MAX_HEARTBEAT_INTERVAL_S, allow_inf_nan=False)] = 0.0


class Lease(Message):
    KIND: ClassVar[str] = "coord.lease"
    max_tickets: Annotated[int, Field(ge=1, le=MAX_TICKETS_PER_REQUEST)] = 1
    # With no ticket free, the coordinator may hold the request this long for one to free (a lease that ends or
    # runs out, a departure, a redo) and answer then; it answers empty at once when the step closes. 0: answer now.
    wait_s: Annotated[float, Field(ge=0.0, le=MAX_WAIT_S, allow_inf_nan=False)] = 0.0
    # The open step's tickets the node is working on: the reply names any others the coordinator has it holding.
    holding: list[Ticket] = Field(default_factory=list, max_length=MAX_TICKETS_PER_STEP)


class LeaseReply(Message):
    KIND: ClassVar[str] = "coord.lease_reply"
    step: int
    indices: list[int]
    lease_s: float
    reason: str
    # One per index: the lease's nonce (protocol/acks.py), which the activation carries to the last stage and
    # its ack signs, so that an ack from an earlier lease of the ticket cannot complete this one.
    nonces: list[Nonce] = Field(default_factory=list, max_length=MAX_TICKETS_PER_REQUEST)
    # Stage-1 replicas that sit out the rest of this step (coordinator/core/round_faults.py): route none of
    # its tickets through them while others serve the stage.
    avoid: list[PeerId] = Field(default_factory=list, max_length=MAX_PARTICIPANTS)
    # Stage-1 replicas that stage-0 replicas reported for lost microbatches and that carried no ticket to
    # completion since (coordinator/core/verdicts.py): route fewer tickets through them (a report lowers a
    # share, never bans alone).
    suspects: list[PeerId] = Field(default_factory=list, max_length=MAX_PARTICIPANTS)
    # The open step's tickets the requester holds (their leases running) that it did not list in ``Lease.holding``,
    # with their nonces: a node that never read the reply that leased them (it gave that request up as the step
    # changed) starts them now. Before, it was told "already holds its share; finish those first" until the
    # coordinator struck it for sitting on them, 10 s later.
    held: list[Ticket] = Field(default_factory=list, max_length=MAX_TICKETS_PER_STEP)
    held_nonces: list[Nonce] = Field(default_factory=list, max_length=MAX_TICKETS_PER_STEP)
    # How long the coordinator held the request for a ticket to free (``Lease.wait_s``): an empty reply after a
    # wait may be asked again at once; one without (no slot to wait in) is asked again after a back-off.
    waited_s: Annotated[float, Field(ge=0.0, le=MAX_WAIT_S, allow_inf_nan=False)] = 0.0


class Release(Message):
    KIND: ClassVar[str] = "coord.release"
    step: Step
    indices: list[Ticket] = Field(max_length=MAX_TICKETS_PER_STEP)


class ReleaseReply(Message):
    KIND: ClassVar[str] = "coord.release_reply"
    released: list[int]


class Complete(Message):
    KIND: ClassVar[str] = "coord.complete"
    step: Step
    index: Ticket
    # The peer that processed this ticket in each stage, stage 0 first.
    route: list[PeerId] = Field(min_length=1, max_length=MAX_STAGES)
    loss: Annotated[float, Field(allow_inf_nan=False)]
    # The last stage's signature of protocol/acks.py's ack_statement over (run, step, index, route, loss, and
    # the lease's nonce): its word that it computed this loss on this route, for this lease. Needed when the run
    # has more than one stage.
    ack: Signature | None = None
    # The lease nonce that ack signs (the one the ticket's lease reply gave).
    nonce: Nonce = b""


class CompleteReply(Message):
    KIND: ClassVar[str] = "coord.complete_reply"
    step: int
    index: int
    step_closed: bool
    remaining: int


class WaitStep(Message):
    KIND: ClassVar[str] = "coord.wait_step"
    step: Step
    # Answer only once the step has been closed at least this many times (it reopens after a redo).
    min_revision: Annotated[int, Field(ge=1, lt=2**31)] = 1
    timeout_s: Annotated[float, Field(gt=0.0, le=MAX_WAIT_S)] = 10.0
    # "committed": wait past the close, until the step at ``min_revision`` commits, or reopens, or closes again.
    until: Literal["closed", "committed"] = "closed"


class Averaged(Message):
    """The sender's stage averaged ``step`` at ``revision`` with every participant's contribution in."""

    KIND: ClassVar[str] = "coord.averaged"
    step: Step
    revision: Annotated[int, Field(ge=1, lt=2**31)]
    # The hex SHA-256 of the averaged update the sender holds (the collective's result hash). The step
    # commits only when a strict majority of each stage's live replicas report the same one.
    result_hash: Hash = ""


class OuterReady(Message):
    """DiLoCo: the sender applied inner step ``round * H - 1`` of its stage and is ready for outer round
    ``round`` (1-based; ``attempt`` > 1 after the round's collective failed). A long poll: the reply comes
    once the round is decided, or after ``timeout_s`` as ``pending`` (coordinator/core/outer_rounds.py)."""

    KIND: ClassVar[str] = "coord.outer_ready"
    stage: StageIndex
    round: Annotated[int, Field(ge=1, lt=2**40)]
    attempt: Annotated[int, Field(ge=1, le=MAX_OUTER_ATTEMPTS)] = 1
    # The hash of its parameters after the last outer sync ("" before the first): the stage's majority must hold it.
    anchor_hash: Hash = ""
    # The first inner step its parameters cover since it last took the stage's state (a claim that can only
    # lower its own weight), and the tokens it counted itself (shown, never used: the records decide).
    since_step: Step = 0
    tokens: Annotated[int, Field(ge=0, lt=2**62)] = 0
    timeout_s: Annotated[float, Field(gt=0.0, le=MAX_WAIT_S)] = 10.0


class OuterWeight(Record):
    peer_id: PeerId
    weight: Annotated[float, Field(ge=0.0, allow_inf_nan=False)]


class OuterDecision(Message):
    """The answer to :class:`OuterReady`: ``role`` ``pending`` (ask again), ``participant`` (average with
    ``weights``), ``follower`` (fetch the result from the participants) or ``left_out`` (resync)."""

    KIND: ClassVar[str] = "coord.outer_decision"
    stage: int
    round: int
    attempt: int
    role: Literal["pending", "participant", "follower", "left_out"]
    reason: Text
    weights: list[OuterWeight] = Field(default_factory=list, max_length=MAX_PARTICIPANTS)
    followers: list[PeerId] = Field(default_factory=list, max_length=MAX_PARTICIPANTS)


class PeerTickets(Record):
    peer_id: str
    tickets: list[int]


class StageAccount(Record):
    stage: int
    peers: list[PeerTickets]


class StepInfo(Message):
    KIND: ClassVar[str] = "coord.step_info"
    step: int
    closed: bool
    revision: int
    loss: float | None
    num_tickets: int
    accounting: list[StageAccount]
    open_step: int
    # Every stage averaged this revision in full: replicas may apply it, and it never reopens.
    committed: bool = False


# Why a replica asks for a redo: "" (a ticket's route broke on the open step, or not said); "round_failed" (its
# stage's collective round failed here); "replica_out" (its round finished without replicas that died or fell
# silent: their tickets); "lost_gradients" (it lost the gradients of tickets accounted to it, e.g. it
# restarted); "orphaned" (every participant of its stage is gone, so nobody holds the stage's part of the step).
RedoKind = Literal["", "round_failed", "replica_out", "lost_gradients", "orphaned"]


class Redo(Message):
    KIND: ClassVar[str] = "coord.redo"
    step: Step
    # Up to the whole step: a replica whose round failed asks for all of its stage's tickets (issue 26: 4,476 of a
    # 5,000-ticket step once overran the per-request bound and stopped the simulated 10,000-node swarm).
    indices: list[Ticket] = Field(min_length=1, max_length=MAX_TICKETS_PER_STEP)
    reason: Text = ""
    # The revision of the step's accounting the request is about (0: not said). A redo about an older
    # revision than the step's last closing is stale and refused: it would reopen a step whose newer
    # revision the other replicas are averaging, and the replicas could leapfrog each other forever.
    revision: Annotated[int, Field(ge=0, lt=2**31)] = 0
    # Why, as a code (the coordinator charges the cost by it, never by the reason's prose): see REDO_KINDS.
    kind: RedoKind = ""
    # With ``round_failed``: the participants whose statements or silence ended the round here, as its
    # collective found (its cause). Charged to them only once a strict majority of the stage's participants
    # name them (coordinator/core/round_faults.py); until then the sender's word costs the sender.
    causes: list[PeerId] = Field(default_factory=list, max_length=MAX_PARTICIPANTS)


class RedoReply(Message):
    KIND: ClassVar[str] = "coord.redo_reply"
    step: int
    indices: list[int]
    reopened: bool
    open_step: int


class CorpusCheck(Message):
    """This node's training data, as :attr:`protolearn.stages.corpus.Corpus.fingerprint`."""

    KIND: ClassVar[str] = "coord.corpus_check"
    fingerprint: Annotated[str, Field(min_length=1, max_length=MAX_HASH)]


class CorpusCheckReply(Message):
    KIND: ClassVar[str] = "coord.corpus_check_reply"
    # The swarm's fingerprint (equal to the sender's, or the request was refused).
    fingerprint: str
    first: bool


class StatementEvidence(Record):
    """A statement the *accused* signed with its node key. Two of them that contradict each other
    (:func:`protolearn.protocol.statements.contradiction`) prove that it lied; nothing the reporter
    signs can, since a reporter can sign anything."""

    data: Annotated[bytes, Field(max_length=MAX_EVIDENCE_BYTES)]
    signature: Annotated[bytes, Field(max_length=1024)]


class Report(Message):
    KIND: ClassVar[str] = "coord.report"
    target: PeerId
    reason: Annotated[str, Field(min_length=1, max_length=MAX_TEXT)]
    # A liveness report (reason ``liveness: ...``): how many microbatches in a row the target lost; fewer than
    # protocol/lost_reports.py's REPORT_AFTER_LOST (0: it left holding some) make a notice that never flags or bans.
    lost: Annotated[int, Field(ge=0, lt=2**31)] = 0
    # With ``conflicting``: two statements the target signed that cannot both be honest.
    evidence: StatementEvidence | None = None
    conflicting: StatementEvidence | None = None


class IntegrityReport(Message):
    """A stage's output failed a check (protocol/boundary.py), or a reducer of the reporter's stage signed a
    wrong part: with ``evidence`` or ``reducer_fault`` the coordinator verifies it and convicts; without,
    the report is a claim that flags the target and never bans."""

    KIND: ClassVar[str] = "coord.integrity_report"
    target: PeerId
    reason: Annotated[str, Field(min_length=1, max_length=MAX_TEXT)]
    evidence: OutputEvidence | None = None
    # Or: a collective reducer of the reporter's own stage signed a wrong part (protocol/reducer_check.py).
    reducer_fault: ReducerFault | None = None


class WitnessDraw(Message):
    """A spot check of ``target``'s (step, ticket, direction) output asks who recomputes it: the coordinator
    draws the witnesses from its own records (coordinator/core/witnesses.py), never the reporter."""

    KIND: ClassVar[str] = "coord.witness_draw"
    target: PeerId
    step: Step
    ticket: Ticket
    direction: Direction


class WitnessDrawReply(Message):
    KIND: ClassVar[str] = "coord.witness_draw_reply"
    # In the order to ask them; evidence convicts only with every one of them agreeing against the target.
    witnesses: Annotated[list[PeerId], Field(max_length=MAX_WITNESSES)]


class ReportReply(Message):
    KIND: ClassVar[str] = "coord.report_reply"
    banned: bool
    reason: str


class Leave(Message):
    KIND: ClassVar[str] = "coord.leave"
    reason: Text = ""


class LeaveReply(Message):
    KIND: ClassVar[str] = "coord.leave_reply"
    released: list[int]


class StatusRequest(Message):
    KIND: ClassVar[str] = "coord.status_request"
    # How many closed steps of loss history to include (newest last).
    loss_history: Annotated[int, Field(ge=0, le=10_000)] = 200


class ParamHash(Record):
    peer_id: str
    step: int
    hash: str


class StageHashesRequest(Message):
    """Ask for the parameter hashes one stage's serving replicas reported: what a syncing or checking
    replica needs, without the whole swarm's status (which grows with every node)."""

    KIND: ClassVar[str] = "coord.stage_hashes_request"
    stage: StageIndex


class StageHashes(Message):
    KIND: ClassVar[str] = "coord.stage_hashes"
    stage: int
    # The coordinator's frontier (the first step not yet committed): no replica has applied it (-1: not said).
    step: int = -1
    # At most MAX_STAGE_HASHES serving replicas, sorted by peer ID.
    param_hashes: list[ParamHash] = Field(default_factory=list, max_length=MAX_STAGE_HASHES)


class MembersRequest(Message):
    """Ask for the live membership (with addresses), e.g. to fetch parameters for `swarm export`."""

    KIND: ClassVar[str] = "coord.members_request"


class Members(Message):
    KIND: ClassVar[str] = "coord.members"
    run_toml: RunToml
    run_hash: str
    step: int
    members: list[MemberView]
    # The step of the finished run's model the coordinator holds and serves itself (-1: none).
    final_step: int = -1
