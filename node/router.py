"""Pipeline routing: microbatches flow forward through one replica per stage and their gradients flow back.

Forward: stage 0 builds a ticket's tokens, runs its blocks and sends the boundary activation (in the
run's codec) to a next-stage peer that the routing core picks (:mod:`protolearn.node.core.routing`). Each stage
appends itself to the route and does the same; the last stage rebuilds the targets from (step, ticket),
computes the loss and backward (scaled by 1/B), and sends the input gradient to the previous stage on
the route. Backward: each stage backprops its held graph, which accumulates its parameter gradients,
and passes the gradient on; stage 0 reports the ticket complete with its route and loss. The last stage
signs an acknowledgement of (run, step, ticket, route, loss) (``protocol/acks.py``) that rides back on
every gradient unchanged; stage 0 hands it to the coordinator, which refuses a completion without it.

IO and compute are split: a stream handler reads the whole message and tensor, decodes and validates
it (expected shape, finite values), asks :class:`~protolearn.node.core.accounting.Accounting` whether to
process, hold or refuse it, answers at once, and only then is compute queued in the node's nursery on
the single compute thread. So the network keeps being read while torch runs (yamux resets a stream
whose reader pauses 5 s), and a sender learns quickly whether it must try another peer.

What the router knows of each microbatch (the attempt held and its route, the frames in and out, who got
each output, the hand-overs awaiting a gradient) is the ticket record's (:mod:`protolearn.node.core.tickets`),
which integrity and stage 0's driver read too. Every tensor it sends passes through the node's outbound
filter first (:mod:`protolearn.node.outbound`), which also says whether it withholds a step's work.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import torch
import trio
from protolearn.codec_spec import CodecSpecError, parse_codec_spec
from protolearn.node.core.accounting import Accounting
from protolearn.node.core.routing import RouteCore
from protolearn.node.integrity import Integrity, Received
from protolearn.node.outbound import PASS_THROUGH, Outbound
from protolearn.node.step_timing import StepTimer, timed_transfer
from protolearn.node.worker import StageWorker
from protolearn.protocol.acks import ack_statement
from protolearn.protocol.codecs import CodecContext, Encoder, decode, make_encoder, token_ids
from protolearn.protocol.errors import ProtocolError
from protolearn.protocol.frames import TensorFrame
from protolearn.protocol.pipeline import (
    ACTIVATION,
    GRADIENT,
    Ack,
    Activation,
    Gradient,
    Refuse,
)
from protolearn.protocol.tensors import TensorLimits
from protolearn.protocol.transport import FramedStream, Host
from protolearn.stages.config import RunConfig
from protolearn.stages.corpus import Corpus
from protolearn.stages.errors import MicrobatchStateError
from protolearn.stages.sampling import microbatch

log = logging.getLogger("protolearn.node")

# How many different next-stage peers a forward hop tries before the microbatch is dropped.
MAX_FORWARD_TRIES = 4
RETRY_PAUSE_S = 0.2
# Activation (and, apart, gradient) streams this node opens to one peer at once. A receiver admits
# 2 x its max_in_flight + 2 of each from one peer (at least 4) and temporarily bans a peer that keeps
# going over; a node with tickets restarted while its next stage was down once opened dozens at once
# to the replica that came back, was banned by it for 300 s, and then expelled for completing nothing.
SENDS_PER_PEER = 4
# Past this many (peer, protocol) limiters, the idle ones are dropped (a busy one is kept: it is in use).
MAX_SEND_LIMITERS = 256

# (step, ticket, route, loss, the last stage's signed ack of them or None in a one-stage run, the lease nonce it signs)
Complete = Callable[[int, int, list[str], float, bytes | None, bytes], Awaitable[None]]


@dataclass
class RouterStats:
    """Counters the progress line and the heartbeat read."""

    microbatches: int = 0
    tokens: int = 0
    refused: int = 0
    dropped: int = 0
    last_loss: float | None = None
    # When this replica started (the node's clock), for tokens/s.
    started: float = 0.0
    # Wall-clock time of the first microbatch this replica processed (the join-to-productive measure).
    first_at: float | None = None


class Router:
    """Moves microbatches of one stage replica through the pipeline. See the module docstring."""

    def __init__(
        self,
        host: Host,
        run: RunConfig,
        worker: StageWorker,
        corpus: Corpus | None,
        accounting: Accounting,
        compute: trio.CapacityLimiter,
        *,
        routes: RouteCore,
        on_complete: Complete,
        send_timeout_s: float,
        integrity: Integrity | None = None,
        outbound: Outbound = PASS_THROUGH,
        on_peer_down: Callable[[str], None] | None = None,
        clock: Callable[[], float] = trio.current_time,
        timing: StepTimer | None = None,
    ) -> None:
        """``routes``: the routing decisions and the per-ticket record they rest on (node/core/routing.py).
        ``on_complete``: stage 0's driver, told of each ticket whose gradient came home. ``integrity``:
        signs what this replica sends and checks what it receives (node/integrity.py; None: neither).
        ``outbound``: the filter every tensor sent passes through (node/outbound.py). ``on_peer_down``:
        told of each next-stage peer a forward send to failed (stage 0 then restarts the tickets it
        handed that peer, without waiting for the membership)."""
        self.host = host
        self.timing = timing  # counts the sends and receives below as boundary transfer (node/step_timing.py)
        self.run = run
        self.worker = worker
        self.stage = worker.stage
        self.num_stages = worker.module.plan.num_stages
        self.corpus = corpus
        self.accounting = accounting
        self.compute = compute
        self.on_complete = on_complete
        self.send_timeout_s = send_timeout_s
        self.clock = clock
        self.routes = routes
        self.tickets = routes.tickets
        self.integrity = integrity
        self.outbound = outbound
        self.on_peer_down = on_peer_down
        self.stats = RouterStats(started=clock())
        self.codec = run.codec_spec
        self.run_hash = run.run_hash()
        self._encoders: dict[tuple[str, str], Encoder] = {}
        # The subspace codec sends the token ids with each activation; a stage keeps them in the ticket's
        # record to send them on with its own output.
        self.subspace = worker.module.subspace
        b = run.batch
        self.hidden_shape = [b.microbatch_size, b.seq_len, run.model.d_model]  # (mb, T, D)
        n = b.microbatch_size * b.seq_len * run.model.d_model
        self._limits = TensorLimits(max_elements=n, max_bytes=8 * n + 4096)
        self._nursery: trio.Nursery | None = None
        self.queue_len = 0
        # Records of steps before this one are forgotten (see _forget_applied).
        self._forgotten_before = 0
        # Each ticket's lease nonce, as stage 0 got it from the coordinator (protocol/acks.py), passed on to the last stage.
        self._nonces: dict[tuple[int, int], bytes] = {}
        # (peer, protocol) → the streams this node may still open to it now (SENDS_PER_PEER).
        self._sends: dict[tuple[str, str], trio.CapacityLimiter] = {}

    # -- wiring ----------------------------------------------------------------------------------
    async def serve(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Own the nursery that runs compute for received work; serve until cancelled."""
        async with trio.open_nursery() as nursery:
            self._nursery = nursery
            # One neighbour may have up to twice this node's microbatches in flight at once (the accounting
            # refuses more anyway); the transport's default per-peer cap would be too low for a large max_in_flight.
            limit, per_peer = 4 * self.accounting.max_in_flight + 4, 2 * self.accounting.max_in_flight + 2
            self.host.serve_stream(ACTIVATION, self._on_activation, max_inbound=limit, max_inbound_per_peer=per_peer)
            self.host.serve_stream(GRADIENT, self._on_gradient, max_inbound=limit, max_inbound_per_peer=per_peer)
            if self.integrity is not None:
                self.integrity.register(nursery)
            task_status.started()
            await trio.sleep_forever()

    def release(self, payloads: list) -> None:
        """Start the work that was held until the previous step was applied."""
        assert self._nursery is not None
        self._forget_applied()
        for p in payloads:
            self._nursery.start_soon(self._forward_received, *p)

    def _forget_applied(self) -> None:
        """Forget the ticket records (frames included) and served checks of the steps this replica has
        applied. Called as work arrives, so records of step t go with the first work after t is applied,
        whether or not any work was held for the next step: they never pile up step after step."""
        applied = self.accounting.applied
        if applied != self._forgotten_before:
            self._forgotten_before = applied
            self.tickets.prune(applied)
            self._nonces = {k: v for k, v in self._nonces.items() if k[0] >= applied}
            if self.integrity is not None:
                self.integrity.prune(applied)

    def _encoder(self, peer: str, direction: str) -> Encoder:
        key = (peer, direction)
        enc = self._encoders.get(key)
        if enc is None:
            enc = self._encoders[key] = make_encoder(self.codec)
        return enc

    def context(self, direction: str, tokens: torch.Tensor | None = None) -> CodecContext:
        """What the run's codec needs to encode or decode a tensor crossing this stage's boundaries."""
        return CodecContext.for_run(self.subspace, self.run.subspace.period, direction, tokens)

    async def _run(self, fn, *args):
        self.queue_len += 1
        try:
            return await trio.to_thread.run_sync(fn, *args, limiter=self.compute)
        finally:
            self.queue_len -= 1

    async def _read_tensor(self, peer: str, s: FramedStream, direction: str) -> tuple[TensorFrame, torch.Tensor]:
        """The frame as received and its decoded tensor (which may hold NaN or Inf: see :meth:`_received`)."""
        frame = await s.receive_tensor(limits=self._limits)
        try:
            got = parse_codec_spec(frame.codec, field="frame codec")
        except CodecSpecError as err:
            raise ProtocolError(peer, str(err)) from None
        if got.name != self.codec.name:
            raise ProtocolError(peer, f"tensor in codec {frame.codec[:32]!r}, but this run uses {self.run.codec!r}")
        return frame, decode(
            frame, peer=peer, shape=self.hidden_shape, dtype=torch.float32, limits=self._limits, context=self.context(direction), require_finite=False,
        )

    async def _received(self, peer: str, s: FramedStream, direction: str, msg: Activation | Gradient, frame: TensorFrame, t: torch.Tensor) -> Received | None:
        """Check the sender's signature and finiteness; None (after refusing) when the tensor is unusable."""
        stage = self.stage - 1 if direction == "fwd" else self.stage + 1
        got = Received(peer, stage, direction, msg.step, msg.ticket, msg.inputs, frame, msg.signature, t)
        if self.integrity is not None:
            try:
                self.integrity.check_signature(peer, stage, direction, msg.step, msg.ticket, msg.inputs, frame, msg.signature)
            except ProtocolError as err:
                await self._refuse(s, peer, "invalid", err.reason)
                return None
        if not bool(torch.isfinite(t).all()):
            if self.integrity is not None:
                self.integrity.nonfinite(got)
            await self._refuse(s, peer, "invalid", "tensor contains NaN or Inf")
            return None
        return got

    # -- stage 0: starting a ticket --------------------------------------------------------------
    async def start_ticket(self, step: int, ticket: int, nonce: bytes = b"") -> bool:
        """Run ticket (step, ticket), leased with ``nonce``, through stage 0 and send it on. False if it could not be sent."""
        assert self.worker.first and self.corpus is not None
        self._forget_applied()
        decision = self.accounting.admit_forward(step, ticket)
        if decision.action != "process":
            log.warning("ticket not started step=%d ticket=%d reason=%s", step, ticket, decision.reason)
            return False
        inputs, targets = microbatch(self.run, self.corpus, step, ticket)
        route = [self.host.peer_id]
        self.tickets.hold((step, ticket), route)
        self._nonces[(step, ticket)] = nonce
        if self.codec.name == "subspace":
            self.tickets.keep_tokens((step, ticket), inputs)
        if self.worker.last:  # a one-stage run: the whole model is here
            loss, _ = await self._run(self.worker.forward_backward_last, (step, ticket), inputs, targets)
            self._count(loss)
            self.accounting.backward_done(step, ticket)
            await self.on_complete(step, ticket, route, loss, None, b"")
            return True
        hidden = await self._run(self.worker.forward, (step, ticket), inputs)
        return await self._send_forward(step, ticket, route, hidden)

    def _slots(self, peer: str, protocol: str) -> trio.CapacityLimiter:
        """The limiter of ``protocol`` streams to ``peer`` (idle ones go once there are many peers)."""
        key = (peer, protocol)
        got = self._sends.get(key)
        if got is None:
            if len(self._sends) >= MAX_SEND_LIMITERS:
                self._sends = {k: v for k, v in self._sends.items() if v.borrowed_tokens}
            got = self._sends[key] = trio.CapacityLimiter(SENDS_PER_PEER)
        return got

    # -- forward ---------------------------------------------------------------------------------
    @timed_transfer
    async def _on_activation(self, peer: str, s: FramedStream) -> None:
        msg = await s.receive(Activation)
        frame, hidden = await self._read_tensor(peer, s, "fwd")
        self._forget_applied()
        if self.outbound.withholds(msg.step):
            await s.send(Ack(queue_len=0))
            return
        if len(msg.route) != self.stage or msg.route[-1] != peer:
            await self._refuse(s, peer, "invalid", f"route of {len(msg.route)} hops ending at {msg.route[-1][:16]} does not lead to stage {self.stage} from this sender")
            return
        got = await self._received(peer, s, "fwd", msg, frame, hidden)
        if got is None:
            return
        decision = self.accounting.admit_forward(msg.step, msg.ticket, (msg.step, msg.ticket, list(msg.route), hidden))
        if decision.action == "refuse":
            await self._refuse(s, peer, decision.code, decision.reason)
            return
        await s.send(Ack(queue_len=self.queue_len))
        if self.codec.name == "subspace" and not self.worker.last:
            assert self.subspace is not None
            self.tickets.keep_tokens((msg.step, msg.ticket), token_ids(frame, peer=peer, subspace=self.subspace))
        self.tickets.received((msg.step, msg.ticket), "input", frame)
        if self.integrity is not None:
            self.integrity.observe(got)
        self._nonces[(msg.step, msg.ticket)] = msg.nonce  # the latest attempt's, which its ack must name
        if decision.action == "process":
            assert self._nursery is not None
            self._nursery.start_soon(self._forward_received, msg.step, msg.ticket, list(msg.route), hidden)

    async def _refuse(self, s: FramedStream, peer: str, code: str, reason: str) -> None:
        self.stats.refused += 1
        self.host.log_refusal(peer, f"stage {self.stage}", code, reason)
        await s.send(Refuse(code=code[:32], reason=reason[:500]))

    async def _forward_received(self, step: int, ticket: int, route: list[str], hidden: torch.Tensor) -> None:
        key = (step, ticket)
        route = route + [self.host.peer_id]
        self.tickets.hold(key, route)
        if self.worker.last:
            assert self.corpus is not None
            _, targets = microbatch(self.run, self.corpus, step, ticket)
            loss, grad = await self._run(self.worker.forward_backward_last, key, hidden, targets)
            self._count(loss)
            self.accounting.backward_done(step, ticket)
            nonce = self._nonces.get(key, b"")
            ack = self.host.sign(ack_statement(self.run_hash, step, ticket, route, loss, nonce))
            await self._send_backward(step, ticket, route, loss, grad, ack, nonce)
            return
        out = await self._run(self.worker.forward, key, hidden)
        await self._send_forward(step, ticket, route, out)

    @timed_transfer
    async def _send_forward(self, step: int, ticket: int, route: list[str], hidden: torch.Tensor) -> bool:
        key = (step, ticket)
        tried: set[str] = set()
        deadline = self.clock() + self.send_timeout_s
        inputs = self.integrity.my_inputs("fwd", step, ticket) if self.integrity is not None else b""
        hidden = self.outbound.tensor(hidden, step, ticket, "fwd")
        while self.clock() < deadline and len(tried) < MAX_FORWARD_TRIES:
            choice = self.routes.choose(tried, self.clock(), step)
            if choice.peer is None:
                await trio.sleep(RETRY_PAUSE_S)  # the next stage may be joining; the view refreshes
                continue
            peer = choice.peer
            tried.add(peer)
            frame, _ = self._encoder(peer, "fwd").encode(hidden, context=self.context("fwd", self.tickets.tokens(key)))
            self.tickets.sent(key, "fwd", peer, frame)
            signature = self.integrity.sign(step, ticket, "fwd", inputs, frame) if self.integrity is not None else b""
            t0 = self.clock()
            self.routes.sending(peer)
            try:
                async with self._slots(peer, ACTIVATION), self.host.open_stream(peer, ACTIVATION) as s:
                    nonce = self._nonces.get(key, b"")
                    await s.send(Activation(step=step, ticket=ticket, route=route, inputs=inputs, signature=signature, nonce=nonce))
                    await s.send_tensor(frame)
                    reply = await s.receive((Ack, Refuse))
            except ProtocolError as err:
                self.routes.failed(peer, self.clock())
                log.warning("forward failed peer=%s step=%d ticket=%d reason=%s", peer, step, ticket, err.reason)
                if self.on_peer_down is not None:
                    self.on_peer_down(peer)
                if tried >= set(self.routes.next_peers):
                    await trio.sleep(RETRY_PAUSE_S)  # every next-stage peer failed: pace the retries of the same ones
                continue
            if isinstance(reply, Refuse):
                self.routes.refused(peer, reply.code, self.clock())
                log.info("forward refused peer=%s step=%d ticket=%d reason=%s", peer, step, ticket, reply.reason)
                if reply.code == "busy":
                    tried.discard(peer)
                    await trio.sleep(RETRY_PAUSE_S)
                continue
            self.routes.accepted(key, peer, service_s=self.clock() - t0, queue_len=reply.queue_len, now=self.clock())
            return True
        self.stats.dropped += 1
        log.warning("microbatch dropped step=%d ticket=%d: no next-stage peer took it (tried %s)", step, ticket, sorted(tried))
        await self._run(self.worker.discard, key)
        self.accounting.dropped(step, ticket)
        return False

    # -- backward --------------------------------------------------------------------------------
    @timed_transfer
    async def _on_gradient(self, peer: str, s: FramedStream) -> None:
        msg = await s.receive(Gradient)
        frame, grad = await self._read_tensor(peer, s, "bwd")
        self._forget_applied()
        if self.outbound.withholds(msg.step):
            await s.send(Ack(queue_len=0))
            return
        route = list(msg.route)
        if len(route) <= self.stage + 1 or route[self.stage] != self.host.peer_id or route[self.stage + 1] != peer:
            await self._refuse(s, peer, "invalid", f"gradient route does not pass through this replica at stage {self.stage} from this sender")
            return
        key = (msg.step, msg.ticket)
        admission = self.accounting.admit_backward(msg.step, msg.ticket)
        decision = self.routes.admit_gradient(key, route[: self.stage + 1], admission)
        # From here on the accounting counts this gradient as being applied: every way out that does not
        # start its backward must say it is moot, or the held attempt's own gradient would be refused as
        # "already being applied" and the ticket would never complete.
        started = False
        try:
            if decision.action != "process":
                await self._refuse(s, peer, decision.code, decision.reason)
                return
            got = await self._received(peer, s, "bwd", msg, frame, grad)
            if got is None:
                return
            await s.send(Ack(queue_len=self.queue_len))
            self.routes.returned(key, self.clock())
            self.tickets.received(key, "grad", frame)
            if self.integrity is not None:
                self.integrity.observe(got)
            assert self._nursery is not None
            self._nursery.start_soon(self._backward_received, msg.step, msg.ticket, route, msg.loss, grad, msg.ack, msg.nonce)
            started = True
        finally:
            if admission.action == "process" and not started:
                self.accounting.gradient_moot(msg.step, msg.ticket)

    async def _backward_received(
        self, step: int, ticket: int, route: list[str], loss: float, grad: torch.Tensor, ack: bytes | None, nonce: bytes,
    ) -> None:
        key = (step, ticket)
        try:
            grad_in = await self._run(self.worker.backward, key, grad)
        except MicrobatchStateError as err:
            # A redo raced this gradient: its graph was replaced and consumed, or dropped by a failed send.
            # The attempt that holds the graph now carries the ticket; this gradient is moot.
            log.info("stale gradient dropped step=%d ticket=%d reason=%s", step, ticket, err)
            self.accounting.gradient_moot(step, ticket)
            return
        self.accounting.backward_done(step, ticket)
        self._count(loss)
        if self.worker.first:
            await self.on_complete(step, ticket, route, loss, ack, nonce)
            return
        await self._send_backward(step, ticket, route, loss, grad_in, ack, nonce)

    @timed_transfer
    async def _send_backward(
        self, step: int, ticket: int, route: list[str], loss: float, grad: torch.Tensor | None, ack: bytes | None, nonce: bytes,
    ) -> None:
        assert grad is not None
        peer = route[self.stage - 1]
        grad = self.outbound.tensor(grad, step, ticket, "bwd")
        frame, _ = self._encoder(peer, "bwd").encode(grad, context=self.context("bwd"))
        inputs = self.integrity.my_inputs("bwd", step, ticket) if self.integrity is not None else b""
        self.tickets.sent((step, ticket), "bwd", peer, frame)
        signature = self.integrity.sign(step, ticket, "bwd", inputs, frame) if self.integrity is not None else b""
        deadline = self.clock() + self.send_timeout_s
        while True:
            try:
                async with self._slots(peer, GRADIENT), self.host.open_stream(peer, GRADIENT) as s:
                    await s.send(Gradient(step=step, ticket=ticket, route=route, loss=loss, ack=ack, nonce=nonce, inputs=inputs, signature=signature))
                    await s.send_tensor(frame)
                    reply = await s.receive((Ack, Refuse))
                if isinstance(reply, Refuse):
                    log.warning("gradient refused peer=%s step=%d ticket=%d reason=%s", peer, step, ticket, reply.reason)
                return
            except ProtocolError as err:
                # Only this peer holds the microbatch's graph, so there is no one else to send it to.
                if self.clock() + RETRY_PAUSE_S >= deadline:
                    self.stats.dropped += 1
                    log.warning("gradient lost peer=%s step=%d ticket=%d reason=%s", peer, step, ticket, err.reason)
                    return
                await trio.sleep(RETRY_PAUSE_S)

    def _count(self, loss: float) -> None:
        if self.stats.first_at is None:
            self.stats.first_at = time.time()
        self.stats.microbatches += 1
        self.stats.tokens += self.run.batch.microbatch_size * self.run.batch.seq_len
        self.stats.last_loss = loss

