"""What the bench's swarm uses in place of a model and of the activation/gradient exchange (:mod:`.swarm`).

The member attacks are about the coordinator and the collective, so the bench's replicas run the node's real
decision core, collective and coordinator link, and only the model is a stand-in:

- :class:`VectorWorker` stands in for :class:`~protolearn.node.worker.StageWorker`: a ticket's gradient is a
  seeded vector of (stage, step, ticket) (:func:`ticket_grad`), so every replica that carries a ticket holds the
  same one, the right update of a step is known in advance (the sum of its B tickets' gradients,
  :func:`step_update`), and applying an update adds it to a flat parameter vector;
- :class:`TicketWork` → :class:`TicketDone` (protocol :data:`PIPELINE`) stands in for a ticket's activation and
  gradient: stage 0 names the ticket, its route and the lease's nonce, and the last stage "computes" it and
  answers with what a real last stage signs, the ack of the route, loss and nonce (``protocol/acks.py``) and,
  when asked, its backward output's boundary statement (``protocol/boundary.py``) over seeded frames of the
  run's boundary shape (:func:`boundary_frames`): a stage-0 replica that receives it holds the signed output
  a spot check's evidence would carry.
"""

from __future__ import annotations

import hashlib
import math
from typing import Annotated, Any, ClassVar

import torch
from pydantic import Field

from protolearn.protocol.bounds import Nonce, PeerId, Signature, Step, Ticket
from protolearn.protocol.frames import TensorFrame
from protolearn.protocol.wire import Message

from abuse_bench.harness import SEED

# The bench's stand-in for the activation and gradient lanes: /protolearn/bench-pipeline/1.0.0.
PIPELINE = "bench-pipeline"


class TicketWork(Message):
    """Stage 0 → the last stage: carry ticket (step, index) along ``route``, leased with ``nonce``."""

    KIND: ClassVar[str] = "bench.ticket_work"
    step: Step
    index: Ticket
    route: list[PeerId] = Field(min_length=2, max_length=2)
    nonce: Nonce
    output: bool = False  # also sign the backward output's boundary statement


class TicketDone(Message):
    """The last stage's answer: the ticket's loss, its signed ack, and the signature of its backward output."""

    KIND: ClassVar[str] = "bench.ticket_done"
    loss: Annotated[float, Field(ge=0.0, le=100.0)]
    ack: Signature
    output_signature: Signature = b""


def ticket_loss(index: int) -> float:
    """A plausible loss (the coordinator refuses implausible ones)."""
    return 3.0 + 0.001 * index


def _generator(*key: int) -> torch.Generator:
    seed = int.from_bytes(hashlib.sha256(repr((SEED, *key)).encode()).digest()[:8], "big")
    return torch.Generator().manual_seed(seed)


def ticket_grad(stage: int, step: int, ticket: int, numel: int) -> torch.Tensor:
    """The gradient of ``stage`` on ticket (step, ticket): what every replica that carries it computes."""
    return torch.randn(numel, generator=_generator(stage, step, ticket))  # (numel,)


def step_update(stage: int, step: int, num_tickets: int, numel: int) -> torch.Tensor:
    """The right update of ``stage`` for ``step``: every ticket's gradient, once (I1)."""
    out = torch.zeros(numel)
    for t in range(num_tickets):
        out += ticket_grad(stage, step, t, numel)
    return out


def boundary_frames(step: int, ticket: int, shape: tuple[int, ...]) -> tuple[TensorFrame, TensorFrame]:
    """The ticket's activation into the last stage and the last stage's backward output, as frames of the run's boundary shape."""
    from protolearn.protocol.tensors import to_frame

    act = torch.randn(shape, generator=_generator(-1, step, ticket))  # (mb, T, D)
    grad = torch.randn(shape, generator=_generator(-2, step, ticket)) * 1e-3  # (mb, T, D)
    return to_frame(act), to_frame(grad)


class VectorWorker:
    """The stage's "model": a flat parameter vector and the per-ticket gradients a replica holds (see the module docstring)."""

    def __init__(self, stage: int, numel: int, num_tickets: int) -> None:
        self.stage = stage
        self.numel = numel
        self.num_tickets = num_tickets
        self.params = torch.zeros(numel)  # (numel,)
        self.applied = 0
        self._grads: dict[tuple[int, int], torch.Tensor] = {}
        # step -> the update applied for it (the last few), which the bench checks against step_update
        self.updates: dict[int, torch.Tensor] = {}

    def compute(self, step: int, ticket: int) -> None:
        self._grads[(step, ticket)] = ticket_grad(self.stage, step, ticket, self.numel)

    def held_tickets(self, step: int) -> list[int]:
        return sorted(t for s, t in self._grads if s == step)

    def flat_grads(self, step: int, tickets: list[int]) -> torch.Tensor:
        missing = [t for t in tickets if (step, t) not in self._grads]
        if missing:
            raise KeyError(f"no gradients of step {step} tickets {missing}")
        out = torch.zeros(self.numel)
        for t in sorted(tickets):
            out += self._grads[(step, t)]
        return out

    def forget(self, step: int) -> None:
        for key in [k for k in self._grads if k[0] <= step]:
            del self._grads[key]

    def apply(self, step: int, flat: torch.Tensor) -> tuple[str, float]:
        self.params += flat
        self.updates[step] = flat.clone()
        for old in [s for s in self.updates if s < step - 8]:
            del self.updates[old]
        return self.step_hash(), float(flat.norm())

    def step_hash(self) -> str:
        return hashlib.sha256(self.params.numpy().tobytes()).hexdigest()

    def install(self, steps: int) -> None:
        """A resync's state: the right updates of the first ``steps`` steps (what a majority of the stage holds)."""
        self.params = torch.zeros(self.numel)
        for s in range(steps):
            self.params += step_update(self.stage, s, self.num_tickets, self.numel)
        self._grads.clear()
        self.applied = steps

    def copy_from(self, donor: Any, steps: int) -> None:
        """A resync's state downloaded from a stage-mate (its bytes: a sum recomputed here would differ from the
        collective's in the last bits, and the replica's later hashes with it)."""
        self.params = donor.params.clone()
        self._grads.clear()
        self.applied = steps

    def update_ok(self, step: int) -> bool:
        """Whether the update applied for ``step`` is that step's every ticket, once."""
        got = self.updates.get(step)
        if got is None:
            return False
        want = step_update(self.stage, step, self.num_tickets, self.numel)
        return bool(torch.allclose(got, want, rtol=1e-4, atol=1e-3 * math.sqrt(self.num_tickets)))
