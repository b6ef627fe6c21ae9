"""What a stage signs about the tensors it sends, and the evidence that convicts a stage that computed wrong.

Every activation and gradient a stage sends carries its sender's Ed25519 signature over a **boundary
statement**: (run hash, step, ticket, direction, the sender's stage, the digest of its inputs, the
digest of the frame it sends). The inputs are what the output is a function of, given the stage's
weights after ``step`` - 1 optimizer steps (the weights every replica of the stage holds for that
step, bit for bit):

- forward from stage 0: nothing (the tokens follow from the run, step and ticket);
- forward from stage s ≥ 1: the activation frame it received;
- backward from the last stage: the activation frame it received (the targets follow from the run);
- backward from a middle stage: the activation frame it received and the gradient frame it received.

A **spot check** sends the same inputs to other replicas of the stage, which recompute and sign the
same kind of statement over their own output. Relative L2 distances between the decoded outputs
then decide: within :func:`tolerance` (the codec's own error plus the run's ``check_tolerance``,
which covers nondeterministic kernels, plus the allowance for the precisions the run admits,
``protolearn/precision.py``) they agree. Three signed statements over the same inputs, two of which agree with each other and not with the third, convict the third: the coordinator checks
the signatures, the common inputs, and the distances itself (:func:`verify_evidence`), so no peer's
word is taken on its own. A signed frame that holds NaN or Inf convicts its signer alone.

In a run that admits a precision below float32 (``protolearn/precision.py``), each recomputation is made in
float32 and again in that precision, and the second is signed over a **low statement** (its own domain tag
and the precision's name, so it passes for no output): the distance between the two, its *spread*, widens
that check's tolerance by :func:`~protolearn.precision.spread_allowance`. Evidence in such a run must hold
every witness's low output, so that an accuser cannot drop them to tighten the check.

The statement is fixed, length-prefixed bytes with a domain tag (as in ``acks.py`` and
``statements.py``): a signature over it can pass for nothing else.
"""

from __future__ import annotations

import hashlib
import math
import struct
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Annotated, ClassVar, Literal

from pydantic import Field

from protolearn.codec_spec import CodecSpecError, parse_codec_spec
from protolearn.precision import allowance, lower_precision, spread_allowance
from protolearn.protocol.bounds import PeerId, Signature, StageIndex, Step, Ticket
from protolearn.protocol.errors import ProtocolError
from protolearn.protocol.frames import TensorFrame, TensorLimits
from protolearn.protocol.wire import Message

if TYPE_CHECKING:  # torch loads only where tensors are compared: the coordinator starts without it
    import torch

    from protolearn.subspace import Subspace

_STATEMENT = b"protolearn/pipeline/boundary/1\x00"
_LOW_STATEMENT = b"protolearn/pipeline/boundary-low/1\x00"
DIGEST_BYTES = 32
# At most two input frames (a middle stage's backward: its activation and the gradient it received).
MAX_INPUTS = 2
# A spot check's witnesses (drawn by the coordinator): evidence holds the accused's output and at most this many more.
MAX_WITNESSES = 8
Direction = Literal["fwd", "bwd"]

# Relative L2 error each codec adds on its own (measured on boundary tensors, with room to spare):
# fp16/bf16 round every value, int8 rounds each row to 1/254 of its largest value, and topk keeps a
# few percent of the values (with error feedback), so a topk check only catches gross faults.
# subspace adds its inner codec's error (on the coefficients) and float rounding of the basis change.
CODEC_TOLERANCE = {"none": 0.0, "fp16": 2e-3, "bf16": 1.6e-2, "int8": 5e-2, "topk": 1.5}
_SUBSPACE_ROUNDING = 1e-5


def frame_digest(frame: TensorFrame) -> bytes:
    """SHA-256 over a frame's codec, dtype, shape and payload: what a statement names."""
    h = hashlib.sha256()
    for text in (frame.codec, frame.dtype):
        raw = text.encode()
        h.update(struct.pack(">H", len(raw)) + raw)
    h.update(struct.pack(">H", len(frame.shape)) + b"".join(struct.pack(">Q", d) for d in frame.shape))
    for blob in (frame.data, frame.aux):
        h.update(struct.pack(">Q", len(blob)))
        h.update(blob)
    return h.digest()


def inputs_digest(frames: Sequence[TensorFrame]) -> bytes:
    """The inputs' part of a statement: the digests of the input frames, in order (empty on stage 0)."""
    return b"".join(frame_digest(f) for f in frames)


def boundary_statement(run_hash: str, step: int, ticket: int, direction: str, stage: int, inputs: bytes, output: bytes) -> bytes:
    """The bytes a replica of ``stage`` signs for its ``output`` digest on microbatch (step, ticket)."""
    raw_run, raw_dir = run_hash.encode(), direction.encode()
    return b"".join([
        _STATEMENT,
        struct.pack(">H", len(raw_run)), raw_run,
        struct.pack(">QIH", step, ticket, stage),
        struct.pack(">H", len(raw_dir)), raw_dir,
        struct.pack(">H", len(inputs)), inputs,
        struct.pack(">H", len(output)), output,
    ])


def low_statement(
    run_hash: str, step: int, ticket: int, direction: str, stage: int, inputs: bytes, output: bytes, precision: str,
) -> bytes:
    """The bytes a recomputing replica signs for its ``output`` digest computed in the lower ``precision``."""
    raw = precision.encode()
    body = boundary_statement(run_hash, step, ticket, direction, stage, inputs, output)[len(_STATEMENT):]
    return b"".join([_LOW_STATEMENT, struct.pack(">H", len(raw)), raw, body])


def tolerance(codec: str, check_tolerance: float, precisions: tuple[str, ...] = ("fp32",)) -> float:
    """The relative L2 distance within which two outputs of the same inputs agree, in a run admitting
    ``precisions`` (protolearn/precision.py: one run-wide allowance for the loosest pair)."""
    return _codec_tolerance(codec) + check_tolerance + allowance(precisions)


def _codec_tolerance(codec: str) -> float:
    try:
        spec = parse_codec_spec(codec, field="codec")
    except CodecSpecError:
        return CODEC_TOLERANCE["topk"]
    if spec.name == "subspace":
        return CODEC_TOLERANCE[spec.inner or "fp16"] + _SUBSPACE_ROUNDING
    return CODEC_TOLERANCE.get(spec.name, CODEC_TOLERANCE["topk"])


def distance(a: torch.Tensor, b: torch.Tensor) -> float:
    """Relative L2 distance between ``a`` and ``b``: ||a - b|| / max(||a||, ||b||)."""
    a, b = a.double(), b.double()
    scale = max(float(a.norm()), float(b.norm()), 1e-12)
    return float((a - b).norm()) / scale


# -- evidence ----------------------------------------------------------------------------------------


class SignedOutput(Message):
    """One replica's output for the checked inputs, and its signature over the boundary statement."""

    KIND: ClassVar[str] = "integrity.signed_output"
    signer: PeerId
    signature: Signature
    codec: Annotated[str, Field(max_length=64)]
    dtype: Annotated[str, Field(max_length=16)]
    shape: Annotated[list[Annotated[int, Field(ge=0, lt=2**31)]], Field(max_length=8)]
    data: bytes
    aux: bytes = b""
    # A recomputation's output in the run's lower precision (same codec, dtype and shape; none in a float32-only
    # run, nor on the accused's own output), and its signature over the low statement.
    low: bytes = b""
    low_signature: Signature = b""

    @classmethod
    def of(
        cls, signer: str, signature: bytes, frame: TensorFrame, low: TensorFrame | None = None, low_signature: bytes = b"",
    ) -> SignedOutput:
        return cls(
            signer=signer, signature=signature, codec=frame.codec, dtype=frame.dtype, shape=list(frame.shape), data=frame.data,
            aux=frame.aux, low=b"" if low is None else low.data, low_signature=low_signature,
        )

    def frame(self) -> TensorFrame:
        return TensorFrame(codec=self.codec, dtype=self.dtype, shape=list(self.shape), data=self.data, aux=self.aux)

    def low_frame(self) -> TensorFrame:
        return TensorFrame(codec=self.codec, dtype=self.dtype, shape=list(self.shape), data=self.low)


class OutputEvidence(Message):
    """Outputs of one stage's replicas for the same (step, ticket, direction, inputs): the accused's and its
    witnesses', which all agree with each other and not with the accused. One output alone is evidence when its
    frame holds NaN or Inf."""

    KIND: ClassVar[str] = "integrity.evidence"
    accused: PeerId
    step: Step
    ticket: Ticket
    direction: Direction
    stage: StageIndex
    inputs: Annotated[bytes, Field(max_length=MAX_INPUTS * DIGEST_BYTES)]
    outputs: Annotated[list[SignedOutput], Field(min_length=1, max_length=1 + MAX_WITNESSES)]


def verify_evidence(
    ev: OutputEvidence, *, run_hash: str, codec: str, check_tolerance: float, shape: Sequence[int],
    verify: Callable[[str, bytes, bytes], None], limits: TensorLimits, subspace: Subspace | None = None,
    precisions: tuple[str, ...] = ("fp32",),
) -> str:
    """Check ``ev`` completely; return the reason to convict ``ev.accused``, or raise ProtocolError.

    ``verify(peer, data, signature)`` raises on a bad signature; ``shape`` is the boundary tensor's;
    ``subspace`` is the run's (needed to decode ``subspace`` frames); ``precisions`` the ones it admits.
    The caller checks who the signers are (live replicas of ``ev.stage``).
    """
    import torch

    from protolearn.protocol.codecs import CodecContext, decode

    signers = [o.signer for o in ev.outputs]
    if len(set(signers)) != len(signers):
        raise ProtocolError(ev.accused, "evidence names one signer twice")
    if ev.accused not in signers:
        raise ProtocolError(ev.accused, "evidence holds no output of the accused")
    if len(ev.inputs) % DIGEST_BYTES:
        raise ProtocolError(ev.accused, "evidence inputs are not whole digests")
    low = lower_precision(precisions)
    tensors: dict[str, torch.Tensor] = {}
    spreads: list[float] = []
    for o in ev.outputs:
        frame = o.frame()
        statement = boundary_statement(run_hash, ev.step, ev.ticket, ev.direction, ev.stage, ev.inputs, frame_digest(frame))
        verify(o.signer, statement, o.signature)
        if o.signer == ev.accused:
            # The accused's frame is in the run's codec; an honest recomputation is sent raw.
            context = CodecContext(subspace, ev.direction)
            tensors[o.signer] = decode(frame, peer=o.signer, shape=shape, dtype=torch.float32, limits=limits, context=context, require_finite=False)
        else:
            tensors[o.signer] = decode(frame, peer=o.signer, shape=shape, dtype=torch.float32, limits=limits, require_finite=True)
            if low is not None:
                if not o.low:
                    raise ProtocolError(ev.accused, f"{o.signer}'s recomputation lacks its {low} output, which a run admitting {low} needs")
                lf = o.low_frame()
                verify(o.signer, low_statement(run_hash, ev.step, ev.ticket, ev.direction, ev.stage, ev.inputs, frame_digest(lf), low), o.low_signature)
                lt = decode(lf, peer=o.signer, shape=shape, dtype=torch.float32, limits=limits, require_finite=True)
                spreads.append(distance(tensors[o.signer], lt))
    accused = tensors[ev.accused]
    if not bool(torch.isfinite(accused).all()):
        bad = int((~torch.isfinite(accused)).sum())
        return f"it signed a {ev.direction} tensor of step {ev.step} with {bad} NaN/Inf values"
    others = [p for p in signers if p != ev.accused]
    if len(others) < 2:
        raise ProtocolError(ev.accused, "a mismatch needs two other replicas' outputs to convict")
    base = tolerance(codec, check_tolerance, precisions)
    for i, p in enumerate(others):
        for q in others[i + 1:]:
            if distance(tensors[p], tensors[q]) > base:
                raise ProtocolError(ev.accused, "the other replicas disagree with each other: no majority")
    tol = base + spread_allowance(spreads)  # this input's own sensitivity to the lower precision
    far = [distance(accused, tensors[p]) for p in others]
    if min(far) <= tol:
        raise ProtocolError(ev.accused, f"the accused's output is within {tol:.3g} of another replica's: no fault")
    worst = min(far)
    how = f"{worst:.3g}" if math.isfinite(worst) else "inf"
    return (
        f"spot check: its {ev.direction} output for step {ev.step} ticket {ev.ticket} is {how} (relative L2) away "
        f"from {len(others)} other replicas' recomputation of the same signed inputs (tolerance {tol:.3g})"
    )
