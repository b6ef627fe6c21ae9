"""The checked side of spot checks: a replica shows what it received and recomputes what it sent.

A receiver that spot-checks sender A of stage s (:mod:`protolearn.node.integrity`) needs the inputs A
computed from, and replicas of s that recompute A's output from them. :class:`CheckServer` serves both:

- ``show``: the frame this replica received of a microbatch (its ``input`` activation, or the ``grad``
  it backpropagated), only to the peer it sent its output of that microbatch to (the ticket record,
  :mod:`protolearn.node.core.tickets`, says who that was);
- ``check``: its own output for the inputs sent with the request, computed with its weights for the
  checked step in float32 and signed (in a run admitting a lower precision, computed again in that one
  and signed over the low statement too: ``protolearn/precision.py``), only for a member of the stage before or after (the checked output's
  receiver), at most MAX_SERVED_PER_PEER_STEP per peer and step, and only at its weights for that step
  (else it refuses rather than recompute with the wrong ones). The result passes through the node's
  outbound filter (:mod:`protolearn.node.outbound`) like everything it sends.

Every request is checked (stage, direction, number of inputs, step, budget) before any input frame is read.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import trio
from protolearn.node.core.tickets import Tickets
from protolearn.node.outbound import PASS_THROUGH, Outbound
from protolearn.precision import lower_precision
from protolearn.protocol.boundary import boundary_statement, frame_digest, inputs_digest, low_statement
from protolearn.protocol.codecs import CodecContext, decode, make_encoder
from protolearn.protocol.errors import ProtocolError
from protolearn.protocol.pipeline import CHECK, SHOW, Ack, CheckRequest, CheckResult, Refuse, ShowRequest
from protolearn.protocol.tensors import TensorLimits
from protolearn.protocol.transport import FramedStream, Host
from protolearn.stages.config import RunConfig
from protolearn.stages.corpus import Corpus
from protolearn.stages.sampling import microbatch

# Recomputations this node does for one peer in one step (a check costs a forward or a backward).
MAX_SERVED_PER_PEER_STEP = 64


class CheckServer:
    """Serves ``show`` and ``check`` for one built stage replica (see the module docstring)."""

    def __init__(
        self, host: Host, run: RunConfig, worker, corpus: Corpus | None, compute: trio.CapacityLimiter, *,
        tickets: Tickets, stage_of: Callable[[str], int | None], outbound: Outbound = PASS_THROUGH,
    ) -> None:
        self.host = host
        self.run = run
        self.worker = worker
        self.stage = worker.stage
        self.corpus = corpus
        self.compute = compute
        self.tickets = tickets
        self.stage_of = stage_of
        self.outbound = outbound
        self.run_hash = run.run_hash()
        self.low = lower_precision(tuple(run.integrity.precisions))
        b = run.batch
        self.shape = [b.microbatch_size, b.seq_len, run.model.d_model]  # (mb, T, D)
        n = b.microbatch_size * b.seq_len * run.model.d_model
        self.limits = TensorLimits(max_elements=n, max_bytes=8 * n + 4096)
        self._raw = make_encoder("none")
        # (peer, step) → checks served to that peer in that step
        self._served: dict[tuple[str, int], int] = {}
        self.num_served = 0

    def register(self) -> None:
        self.host.serve_stream(SHOW, self._on_show, max_inbound=32, max_inbound_per_peer=8)
        self.host.serve_stream(CHECK, self._on_check, max_inbound=16, max_inbound_per_peer=4)

    def prune(self, applied: int) -> None:
        """Forget the checks served in steps before ``applied`` (no more can be served for them)."""
        self._served = {k: v for k, v in self._served.items() if k[1] >= applied}

    async def _on_show(self, peer: str, s: FramedStream) -> None:
        req = await s.receive(ShowRequest)
        key = (req.step, req.ticket)
        # Only the peer this node sent its output of that microbatch to may see the input.
        direction = "fwd" if req.what == "input" else "bwd"
        frame = self.tickets.frame(key, req.what)
        if self.tickets.sent_to(key, direction) != peer or frame is None:
            await s.send(Refuse(code="unknown", reason=f"this node sent you no {direction} output of (step {req.step}, ticket {req.ticket})"))
            return
        await s.send(Ack())
        await s.send_tensor(frame)

    async def _on_check(self, peer: str, s: FramedStream) -> None:
        req = await s.receive(CheckRequest)
        why = self._check_refusal(peer, req)  # before any input frame is read
        if why:
            await s.send(Refuse(code="invalid", reason=why))
            return
        frames = [await s.receive_tensor(limits=self.limits) for _ in range(req.inputs)]
        try:
            # Input frames are in the run's codec; a subspace frame's direction follows from its layout.
            context = CodecContext(self.worker.module.subspace)
            tensors = [decode(f, peer=peer, shape=self.shape, dtype=torch.float32, limits=self.limits, context=context) for f in frames]
            if req.direction == "fwd" and self.stage == 0:
                assert self.corpus is not None
                tensors = [microbatch(self.run, self.corpus, req.step, req.ticket)[0]]
            targets = None
            if req.direction == "bwd" and self.worker.last:
                assert self.corpus is not None
                targets = microbatch(self.run, self.corpus, req.step, req.ticket)[1]
            outs = await trio.to_thread.run_sync(self._recompute, req.step, req.direction, tensors, targets, limiter=self.compute)
        except (ValueError, ProtocolError) as err:
            await s.send(Refuse(code="stale", reason=str(err)[:400]))
            return
        frames_out = [self._raw.encode(self.outbound.tensor(out, req.step, req.ticket, req.direction, check=True))[0] for out in outs]
        self.num_served += 1
        inputs = inputs_digest(frames)
        signature = self.host.sign(boundary_statement(self.run_hash, req.step, req.ticket, req.direction, self.stage, inputs, frame_digest(frames_out[0])))
        low_signature = b""
        if self.low is not None:
            low_signature = self.host.sign(
                low_statement(self.run_hash, req.step, req.ticket, req.direction, self.stage, inputs, frame_digest(frames_out[1]), self.low))
        await s.send(CheckResult(signature=signature, low_signature=low_signature))
        for frame in frames_out:
            await s.send_tensor(frame)

    def _recompute(self, step: int, direction: str, tensors: list[torch.Tensor], targets: torch.Tensor | None) -> list[torch.Tensor]:
        """The float32 recomputation, and the lower precision's when the run admits one (in a worker thread)."""
        outs = [self.worker.recompute(step, direction, tensors, targets, bf16=False)]
        if self.low is not None:
            outs.append(self.worker.recompute(step, direction, tensors, targets, bf16=True))
        return outs

    def _check_refusal(self, peer: str, req: CheckRequest) -> str:
        if req.stage != self.stage:
            return f"this replica serves stage {self.stage}, not {req.stage}"
        want_inputs = 0 if req.direction == "fwd" and self.stage == 0 else (1 if req.direction == "fwd" or self.worker.last else 2)
        if req.inputs != want_inputs:
            return f"a {req.direction} check of stage {self.stage} takes {want_inputs} input tensors, not {req.inputs}"
        asker = self.stage_of(peer)
        want = self.stage + 1 if req.direction == "fwd" else self.stage - 1
        if asker != want:
            return f"a {req.direction} check of stage {self.stage} is for a member of stage {want}"
        if req.step != self.worker.applied:
            return f"this replica's weights are for step {self.worker.applied}, not {req.step}"
        n = self._served.get((peer, req.step), 0)
        if n >= MAX_SERVED_PER_PEER_STEP:
            return f"{n} checks served to this peer in step {req.step} already"
        self._served[(peer, req.step)] = n + 1
        return ""
