"""Node-to-node messages: activations, gradients, collective parts and state sync.

Each exchange is one libp2p stream of a protocol named below (the transport turns a name into
``/protolearn/<name>/1.0.0``). A message that carries a tensor is followed on the same stream by that
tensor, sent with ``FramedStream.send_tensor`` (a header, payload chunks each under a deadline, a
trailer), so a tensor never has to fit in one message and the receiver checks its header (codec,
dtype, shape, size) before reading a payload byte.

- ``activation``: :class:`Activation` + tensor → :class:`Ack` or :class:`Refuse`.
  The tensor is the boundary hidden state ``(mb, T, D)`` in the run's codec.
- ``gradient``: :class:`Gradient` + tensor → :class:`Ack` or :class:`Refuse`.
  The tensor is the gradient wrt that hidden state, same shape and codec. It travels back along the
  route recorded in the activation; the loss (computed on the last stage) rides along to stage 0.
- ``collective``: :class:`~protolearn.protocol.collective.PartHeader` + tensor (raw float32, never
  lossy: replicas must agree bit for bit) → :class:`Ack` or :class:`Refuse`.
  A replica that the step's accounting leaves out (it processed no ticket), or a participant whose own round
  failed, sends :class:`ResultRequest` instead and gets :class:`ResultServed` (the participants' signed fins
  that prove it, :mod:`protolearn.protocol.collective.result_proof`) + the whole reduced vector.
- ``state``: :class:`StateRequest` → :class:`StateInfo`, then per run of tensors a :class:`StateBundle` + their
  raw bytes as one uint8 tensor, for syncing a stage's parameters and optimizer state from a live replica.
- ``show``: :class:`ShowRequest` → :class:`Ack` + the input frame a stage received for a microbatch
  (exactly as received), or :class:`Refuse`: what a spot check of that stage recomputes from.
- ``check``: :class:`CheckRequest` + its input frames → :class:`CheckResult` + the recomputed output
  (raw float32), or :class:`Refuse`. See ``protocol/boundary.py`` for the statements both sign.

Activations and gradients carry the sender's signature over its boundary statement (``signature``)
and the digest of the inputs it computed them from (``inputs``); a receiver refuses one without.

Bounds on every variable-size field keep a hostile peer from making a node allocate without bound.
"""

from __future__ import annotations

from typing import Annotated, ClassVar, Literal

from pydantic import Field

from protolearn.protocol.bounds import MAX_PARTICIPANTS, MAX_STAGES, Hash, Nonce, PeerId, Signature, StageIndex, Step, Ticket
from protolearn.protocol.wire import Message, Record

# The node-to-node protocol names, each defined only here; the transport's protocol_id() makes
# "/protolearn/<name>/1.0.0" of one. The coordinator's is protocol/coordination.py's COORDINATOR.
ACTIVATION = "activation"
GRADIENT = "gradient"
COLLECTIVE = "collective"
STATE = "state"
SHOW = "show"
CHECK = "check"

MAX_REASON = 512
MAX_STATE_TENSORS = 100_000
# A joining replica downloads its stage's state from at most this many donors at once.
MAX_STATE_PARTS = 16
MAX_NAME = 256
# The tensors one StateBundle names at most (their raw bytes follow as one frame).
MAX_BUNDLE_TENSORS = 4096
MAX_SELF_TEST_BYTES = 4 * 1024 * 1024

Route = Annotated[list[PeerId], Field(min_length=1, max_length=MAX_STAGES)]


class Activation(Message):
    """Microbatch (step, ticket) leaves stage ``len(route) - 1``; ``route`` lists the peer of each stage so far."""

    KIND: ClassVar[str] = "pipe.activation"
    step: Step
    ticket: Ticket
    route: Route
    # The sender's inputs digest and its signature of protocol/boundary.py's boundary statement.
    inputs: Annotated[bytes, Field(max_length=64)] = b""
    signature: Signature = b""
    # The coordinator's nonce of stage 0's lease of the ticket, passed on unchanged; the last stage signs it
    # into its ack (protocol/acks.py).
    nonce: Nonce = b""


class Gradient(Message):
    """The gradient of microbatch (step, ticket) for the stage that sent its activation.

    ``route`` is the full forward route (stage 0 first), so each stage knows where to send it next;
    ``loss`` is the microbatch's loss from the last stage, reported by stage 0 when it completes, and
    ``ack`` the last stage's signature over both (the coordinator checks it).
    """

    KIND: ClassVar[str] = "pipe.gradient"
    step: Step
    ticket: Ticket
    route: Route
    loss: Annotated[float, Field(allow_inf_nan=False)]
    # The last stage's signature of protocol/acks.py's ack_statement(run, step, ticket, route, loss, nonce),
    # and the lease nonce it signs; both ride back unchanged to stage 0, which hands them to the coordinator
    # with the completion.
    ack: Signature | None = None
    nonce: Nonce = b""
    # The sender's inputs digest and its signature of protocol/boundary.py's boundary statement.
    inputs: Annotated[bytes, Field(max_length=64)] = b""
    signature: Signature = b""


class Ack(Message):
    """Accepted. ``queue_len`` is the receiver's backlog, which feeds the sender's balancer."""

    KIND: ClassVar[str] = "pipe.ack"
    queue_len: Annotated[int, Field(ge=0, lt=2**31)] = 0


class Refuse(Message):
    """Not accepted: ``code`` is one of busy, stale, ahead, unknown, duplicate, invalid, stage, state, left
    (a collective round this replica failed, answering a late probe of it)."""

    KIND: ClassVar[str] = "pipe.refuse"
    code: Annotated[str, Field(max_length=32)]
    reason: Annotated[str, Field(max_length=MAX_REASON)]


class ResultRequest(Message):
    """Ask a participant of round ``round`` of ``stage`` for the round's reduced vector."""

    KIND: ClassVar[str] = "pipe.result_request"
    round: Step
    stage: StageIndex


class ServedFin(Record):
    """A participant's signed fin of a round: its contributor set (a bitmask over the sorted participants) and
    result hash."""

    signer: PeerId
    mask: Annotated[bytes, Field(max_length=(MAX_PARTICIPANTS + 7) // 8)]
    digest: Annotated[bytes, Field(max_length=64)]
    signature: Signature


class ResultServed(Message):
    """The round's full result follows (raw float32), with the fins the serving participant holds: the taker
    accepts it only if a strict majority of the participants signed it (protocol/collective/result_proof.py)."""

    KIND: ClassVar[str] = "pipe.result_served"
    fins: list[ServedFin] = Field(default_factory=list, max_length=MAX_PARTICIPANTS)


class StateRequest(Message):
    """Ask a replica of ``stage`` for its parameters and optimizer state, or for share ``part`` of
    ``parts`` of it (the tensors whose index ≡ part mod parts), so a joiner downloads from several."""

    KIND: ClassVar[str] = "pipe.state_request"
    stage: StageIndex
    part: Annotated[int, Field(ge=0, lt=MAX_STATE_PARTS)] = 0
    parts: Annotated[int, Field(ge=1, le=MAX_STATE_PARTS)] = 1
    # The parameters alone (an export): the state's hash is still checked, through the digests of all of it.
    params_only: bool = False


class StateLeaf(Record):
    """One tensor of a state as its hash covers it: its name and digest (stages/stage.py tensor_digest)."""

    name: Annotated[str, Field(min_length=1, max_length=MAX_NAME)]
    digest: Hash


class StateInfo(Message):
    """The snapshot that follows: after ``applied`` optimizer steps, with this parameter hash."""

    KIND: ClassVar[str] = "pipe.state_info"
    stage: int
    applied: Annotated[int, Field(ge=0, lt=2**62)]
    run_hash: Hash
    param_hash: Hash
    num_tensors: Annotated[int, Field(ge=0, le=MAX_STATE_TENSORS)]
    # The donor's output on the run's self-test input with exactly this state, raw float32 (node/worker.py
    # self_test): the joiner computes the same and compares, which catches a broken device before it trains.
    self_test: Annotated[bytes, Field(max_length=MAX_SELF_TEST_BYTES)] = b""
    # (name, digest) of every tensor ``param_hash`` covers, in its order (stages/stage.py state_root): a joiner
    # checks them against that hash, and the hash against its stage's reports, before it takes a tensor, and then
    # each tensor as it arrives, so a lie costs it one message, or one tensor, and names who told it.
    leaves: Annotated[list[StateLeaf], Field(max_length=MAX_STATE_TENSORS)] = []


class StateBundle(Message):
    """Names a run of the snapshot's tensors (``index`` ≡ part mod parts, in order), e.g.
    ``param/blocks.0.attn.wq.weight`` or ``exp_avg/...``. Their raw bytes follow, one after the other, as a single
    uint8 tensor: one frame of many small tensors goes over the bulk lane, where one frame each did not."""

    KIND: ClassVar[str] = "pipe.state_bundle"
    indices: Annotated[list[Annotated[int, Field(ge=0, lt=MAX_STATE_TENSORS)]], Field(min_length=1, max_length=MAX_BUNDLE_TENSORS)]
    names: Annotated[list[Annotated[str, Field(min_length=1, max_length=MAX_NAME)]], Field(min_length=1, max_length=MAX_BUNDLE_TENSORS)]


class ShowRequest(Message):
    """Ask the stage that sent microbatch (step, ticket) for an input it computed it from: ``input`` (the
    activation it received) or ``grad`` (the gradient it received, for a middle stage's backward)."""

    KIND: ClassVar[str] = "pipe.show_request"
    step: Step
    ticket: Ticket
    what: Literal["input", "grad"]


class CheckRequest(Message):
    """Recompute microbatch (step, ticket) of ``stage`` in ``direction`` from the ``inputs`` frames that
    follow (none for stage 0's forward: the tokens follow from the run), with the weights for ``step``."""

    KIND: ClassVar[str] = "pipe.check_request"
    step: Step
    ticket: Ticket
    stage: StageIndex
    direction: Literal["fwd", "bwd"]
    inputs: Annotated[int, Field(ge=0, le=2)]


class CheckResult(Message):
    """The recomputed output follows; ``signature`` is the checker's over its boundary statement."""

    KIND: ClassVar[str] = "pipe.check_result"
    signature: Signature
    # In a run admitting a lower precision, a second frame follows: the output in that precision, signed over
    # the low statement (protocol/boundary.py).
    low_signature: Signature = b""
