"""A node's integrity checks of its neighbours: signed boundary tensors, monitors and spot checks.

The trio adapter around ``protocol/boundary.py`` (statements, evidence), ``protocol/monitors.py``
(statistics of what each sender sends) and ``protocol/probation.py`` (how often to spot-check whom).
The :class:`~protolearn.node.router.Router` calls it for every tensor it sends and receives:

- **Sending**, :meth:`Integrity.sign`: the boundary statement over (step, ticket, direction, stage, the
  digest of the inputs this node computed from, the digest of the frame it sends).
- **Receiving**, :meth:`Integrity.check_signature` before the tensor is used (an unsigned or forged
  tensor is refused), then :meth:`Integrity.observe`: the monitor scores the sender, and at the
  policy's rate (1.0 for a newcomer or a monitor suspect) a spot check starts in the background. A
  signed tensor with NaN or Inf is evidence on its own (:meth:`Integrity.nonfinite`).
- **A spot check** of sender A of stage s: its inputs are gathered (stage 0's forward has none; A
  shows the frame it received over ``show``, and this node holds the activation it sent A itself),
  checked against the digest A signed, and sent over ``check`` to another replica B of stage s, which
  recomputes with the weights for the same step and signs its output. If B's output is within
  :func:`~protolearn.protocol.boundary.tolerance` of A's, A passed (a pass accuses nobody, so B is this
  node's random pick). If not, this node asks the coordinator for the check's witnesses
  (``coordinator/core/witnesses.py``; never this node's choice) and asks every one of them: when all of
  them agree with each other and not with A, the evidence goes to the coordinator, which verifies
  everything itself and convicts A. When the drawn witnesses side with A, B is the odd one and is reported
  without evidence (only the checked replica can be convicted: the draw was for it). A mismatch that
  cannot be settled (one witness only, or a witness that does not answer) is reported without evidence
  (a flag).
- **In a run admitting bf16**, each recomputation comes in float32 and in bf16, both signed; a check allows the
  recomputations' spread (:func:`~protolearn.precision.spread_allowance`) on top of the run's tolerance, as
  the coordinator does when it verifies the evidence, so an honest bf16 output of an ill-conditioned input passes.
- **Serving** ``show`` and ``check`` to the neighbours that check this node: :mod:`protolearn.node.check_serving`.

In DiLoCo mode the replicas of a stage hold the same weights only right after an outer sync, so spot checks
are made of the first inner step after each sync only (``checkable``), and a replica recomputes only with
its weights after such a sync (:meth:`StageWorker.recompute`); the monitors watch every tensor, and the
robust aggregation rules act on the pseudo-gradients of the outer rounds.
"""

from __future__ import annotations

import logging
import random
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import torch
import trio

from protolearn.node.check_serving import CheckServer
from protolearn.node.core.tickets import Tickets
from protolearn.node.outbound import PASS_THROUGH, Outbound
from protolearn.precision import lower_precision, spread_allowance
from protolearn.protocol.boundary import (
    OutputEvidence,
    SignedOutput,
    boundary_statement,
    distance,
    frame_digest,
    inputs_digest,
    low_statement,
    tolerance,
)
from protolearn.protocol.codecs import decode
from protolearn.protocol.coordination import MAX_PEER_CHECKS, PeerCheck
from protolearn.protocol.errors import ProtocolError
from protolearn.protocol.frames import TensorFrame
from protolearn.protocol.identity import verify_peer
from protolearn.protocol.monitors import BoundaryMonitor
from protolearn.protocol.pipeline import CHECK, SHOW, Ack, CheckRequest, CheckResult, Refuse, ShowRequest
from protolearn.protocol.probation import SpotCheckPolicy
from protolearn.protocol.reducer_check import ReducerFault
from protolearn.protocol.transport import Host
from protolearn.stages.config import RunConfig
from protolearn.stages.corpus import Corpus

log = logging.getLogger("protolearn.node")

# Spot checks this node runs at once (more are skipped, not queued: a check is a sample).
MAX_CHECKS_IN_FLIGHT = 4

# A claim without evidence about one peer is sent at most this often (evidence goes at once).
CLAIM_INTERVAL_S = 10.0

# (accused, reason, evidence or None, a reducer's fault or None) → whether the coordinator banned the accused.
Report = Callable[[str, str, OutputEvidence | None, ReducerFault | None], Awaitable[bool]]
# (checked peer, step, ticket, direction) → the witnesses the coordinator drew, in the order to ask them.
Witnesses = Callable[[str, int, int, str], Awaitable[list[str]]]


@dataclass
class IntegrityStats:
    checks_passed: int = 0
    checks_failed: int = 0
    checks_inconclusive: int = 0
    evidence_sent: int = 0
    refused_unsigned: int = 0


@dataclass
class Recomputed:
    """A replica's signed recomputation for a spot check: its float32 output, and in a run admitting a lower
    precision its output in that one too, whose distance from the first is the ``spread``."""

    signature: bytes
    frame: TensorFrame
    tensor: torch.Tensor
    low_signature: bytes = b""
    low_frame: TensorFrame | None = None
    spread: float = 0.0

    def signed(self, signer: str) -> SignedOutput:
        return SignedOutput.of(signer, self.signature, self.frame, self.low_frame, self.low_signature)


@dataclass
class Received:
    """A tensor this node received and may spot-check: who sent it, what it signed, and the tensor."""

    peer: str
    stage: int
    direction: str
    step: int
    ticket: int
    inputs: bytes
    frame: TensorFrame
    signature: bytes
    tensor: torch.Tensor


class Integrity:
    """See the module docstring. One per built stage; the router calls it."""

    def __init__(
        self, host: Host, run: RunConfig, worker, corpus: Corpus | None, compute: trio.CapacityLimiter, *,
        tickets: Tickets, replicas: Callable[[int], list[str]], witnesses: Witnesses, stage_of: Callable[[str], int | None], report: Report,
        timeout_s: float, seed: int, outbound: Outbound = PASS_THROUGH, checkable: Callable[[int], bool] | None = None,
    ) -> None:
        """``tickets``: the stage's per-ticket record (node/core/tickets.py), where the router keeps the
        frames this replica received and sent and to whom. ``replicas``/``stage_of``: the membership view
        (who may recompute a check that then passes). ``witnesses``: asks the coordinator for the witnesses
        of a check that did not pass. ``report``: sends an integrity report to the coordinator. ``worker``, ``corpus``, ``compute``
        and ``outbound`` (the filter each result passes through, node/outbound.py) serve the checks that
        neighbours make of this replica (node/check_serving.py). ``checkable(step)``: whether the replicas of a
        stage hold the same weights for ``step``, so that another one can recompute an output of it (DiLoCo mode:
        only the first inner step after each outer sync; None: every step)."""
        self.host = host
        self.run = run
        self.stage = worker.stage
        self.tickets = tickets
        self.replicas = replicas
        self.witnesses = witnesses
        self.stage_of = stage_of
        self.report = report
        self.timeout_s = timeout_s
        self.run_hash = run.run_hash()
        cfg = run.integrity
        self.tolerance = tolerance(run.codec, cfg.check_tolerance, tuple(cfg.precisions))
        self.low = lower_precision(tuple(cfg.precisions))
        self.monitor = BoundaryMonitor(codec=run.codec) if cfg.monitors else None
        self.rng = random.Random(seed)
        self.checks = cfg.spot_check_rate > 0  # 0: no spot checks at all (probation included)
        self.checkable = checkable if checkable is not None else (lambda step: True)
        self.policy = SpotCheckPolicy(rate=cfg.spot_check_rate, half_life=cfg.probation_half_life, rng=self.rng)
        # What this node serves the neighbours that check it.
        self.server = CheckServer(host, run, worker, corpus, compute, tickets=tickets, stage_of=stage_of, outbound=outbound)
        # A boundary tensor's shape (mb, T, D) and the bounds on its frame.
        self.shape, self.limits = self.server.shape, self.server.limits
        self._in_flight = 0
        # Peers with a report in flight, and those the coordinator convicted: one report at a time per
        # peer, and none after the conviction (a peer sending NaN in every tensor is reported once).
        self._reporting: set[str] = set()
        self.convicted: set[str] = set()
        self._claimed_at: dict[str, float] = {}
        # peer → [spot checks passed, failed] and when it last sent this node a tensor (for the heartbeat).
        self.per_peer: dict[str, list[int]] = {}
        self._seen: dict[str, float] = {}
        self.stats = IntegrityStats()
        self._nursery: trio.Nursery | None = None

    def register(self, nursery: trio.Nursery) -> None:
        self._nursery = nursery
        self.server.register()

    def prune(self, applied: int) -> None:
        """Forget the checks served in steps before ``applied`` (no more can be served for them)."""
        self.server.prune(applied)

    # -- what this node signs --------------------------------------------------------------------
    def my_inputs(self, direction: str, step: int, ticket: int) -> bytes:
        """The digest of the inputs this node computed its ``direction`` output of (step, ticket) from."""
        key = (step, ticket)
        if direction == "fwd":
            frame = self.tickets.frame(key, "input")
            return b"" if frame is None else frame_digest(frame)
        parts = [self.tickets.frame(key, "input"), self.tickets.frame(key, "grad")]
        return inputs_digest([f for f in parts if f is not None])

    def sign(self, step: int, ticket: int, direction: str, inputs: bytes, frame: TensorFrame) -> bytes:
        """This replica's boundary statement over its ``direction`` output ``frame`` of (step, ticket)."""
        return self.host.sign(boundary_statement(self.run_hash, step, ticket, direction, self.stage, inputs, frame_digest(frame)))

    # -- what this node receives -----------------------------------------------------------------
    def check_signature(self, peer: str, stage: int, direction: str, step: int, ticket: int, inputs: bytes, frame: TensorFrame, signature: bytes) -> None:
        """Raise ProtocolError unless ``peer`` signed this tensor (and, for a gradient, names as its input
        the activation this node sent it)."""
        if not signature:
            self.stats.refused_unsigned += 1
            raise ProtocolError(peer, "an unsigned tensor; every activation and gradient must carry its sender's signature")
        statement = boundary_statement(self.run_hash, step, ticket, direction, stage, inputs, frame_digest(frame))
        verify_peer(peer, statement, signature)
        if direction == "bwd":
            sent = self.tickets.frame((step, ticket), "fwd")
            if sent is not None and inputs[:32] != frame_digest(sent):
                raise ProtocolError(peer, f"its gradient of (step {step}, ticket {ticket}) names an input this node did not send it")

    def nonfinite(self, got: Received) -> None:
        """A signed tensor with NaN or Inf convicts its sender on its own: send the evidence."""
        ev = OutputEvidence(
            accused=got.peer, step=got.step, ticket=got.ticket, direction=got.direction, stage=got.stage, inputs=got.inputs,
            outputs=[SignedOutput.of(got.peer, got.signature, got.frame)],
        )
        self._spawn(self._send_evidence, got.peer, "it sent a tensor with NaN or Inf", ev)

    def observe(self, got: Received) -> None:
        """Score the sender and maybe start a spot check of this tensor."""
        if got.peer in self.convicted or got.peer in self._reporting:
            return
        self._seen[got.peer] = trio.current_time()
        if len(self._seen) > 4 * MAX_PEER_CHECKS:  # keep the most recent senders only
            for p in sorted(self._seen, key=self._seen.__getitem__)[: len(self._seen) - MAX_PEER_CHECKS]:
                del self._seen[p]
                self.per_peer.pop(p, None)
        suspect = False
        if self.monitor is not None:
            self.monitor.observe(got.peer, got.stage, got.direction, got.tensor)
            suspect = self.monitor.suspect(got.peer)
        if self._nursery is None or not self.checks or not self.checkable(got.step):
            return
        if not self.policy.should_check(got.peer, suspect=suspect):
            return
        if self._in_flight >= MAX_CHECKS_IN_FLIGHT:
            return
        self._spawn(self._spot_check, got)

    def _spawn(self, fn, *args) -> None:
        if self._nursery is not None:
            self._nursery.start_soon(fn, *args)

    # -- running a spot check --------------------------------------------------------------------
    async def _spot_check(self, got: Received) -> None:
        self._in_flight += 1
        try:
            with trio.move_on_after(3 * self.timeout_s):
                await self._run_check(got)
                return
            self.stats.checks_inconclusive += 1
        finally:
            self._in_flight -= 1

    async def _run_check(self, got: Received) -> None:
        inputs = await self._gather_inputs(got)
        if inputs is None:
            self.stats.checks_inconclusive += 1
            return
        others = [p for p in self.replicas(got.stage) if p not in (got.peer, self.host.peer_id)]
        if not others:
            self.stats.checks_inconclusive += 1
            return
        # A pass needs no witness draw: a check that agrees accuses nobody. Only a mismatch asks the coordinator.
        first_peer = self.rng.choice(sorted(others))
        first = await self._ask_check(first_peer, got, inputs)
        if first is not None and distance(got.tensor, first.tensor) <= self._tolerance([first]):
            self._count(got.peer, passed=True)
            return
        drawn = [p for p in await self.witnesses(got.peer, got.step, got.ticket, got.direction) if p not in (got.peer, self.host.peer_id)]
        results: dict[str, Recomputed] = {}
        if first is not None and first_peer in drawn:
            results[first_peer] = first

        async def ask(peer: str) -> None:
            r = await self._ask_check(peer, got, inputs)
            if r is not None:
                results[peer] = r

        async with trio.open_nursery() as nursery:
            for peer in drawn:
                if peer not in results:
                    nursery.start_soon(ask, peer)
        await self._judge(got, drawn, results, first_peer, first)

    def _tolerance(self, recomputed: list[Recomputed]) -> float:
        """The tolerance of a check whose recomputations are ``recomputed``: the run's, widened by their spread
        (protolearn/precision.py), as the coordinator widens it for the evidence."""
        return self.tolerance + spread_allowance([r.spread for r in recomputed])

    async def _judge(
        self, got: Received, drawn: list[str], results: dict[str, Recomputed], first_peer: str, first: Recomputed | None,
    ) -> None:
        """Settle a spot check whose first recomputation (by ``first_peer``) disagreed with ``got.peer``'s output,
        or did not come, with the witnesses the coordinator ``drawn``, whose answers are ``results``."""
        tol = self._tolerance(list(results.values()))
        near = {w: distance(got.tensor, r.tensor) <= tol for w, r in results.items()}
        against = [w for w in drawn if w in results and not near[w]]
        if len(drawn) >= 2 and len(against) == len(drawn) and all(
            distance(results[w].tensor, results[v].tensor) <= self.tolerance for i, w in enumerate(against) for v in against[i + 1:]
        ):
            self._count(got.peer, passed=False)
            outputs = [SignedOutput.of(got.peer, got.signature, got.frame)] + [results[w].signed(w) for w in drawn]
            ev = OutputEvidence(
                accused=got.peer, step=got.step, ticket=got.ticket, direction=got.direction, stage=got.stage, inputs=got.inputs, outputs=outputs,
            )
            await self._send_evidence(got.peer, f"spot check of step {got.step} ticket {got.ticket} ({got.direction})", ev)
            return
        sides = [w for w in drawn if w != first_peer]
        if first is not None and sides and len(results) == len(drawn) and all(near[w] for w in sides):
            # Every other drawn witness sides with the checked output: the first recomputation is the odd one.
            self._count(got.peer, passed=True)
            await self._send_evidence(first_peer, f"spot check: its recomputation of step {got.step} ticket {got.ticket} "
                                                  f"disagreed with {len(sides)} drawn witness(es) and the checked output", None)
            return
        self.stats.checks_inconclusive += 1
        votes = dict(results)
        if first is not None:
            votes[first_peer] = first
        tol = self._tolerance(list(votes.values()))
        far = [w for w, r in votes.items() if distance(got.tensor, r.tensor) > tol]
        if far and 2 * len(far) > len(votes):
            self.policy.failed(got.peer)
            nearest = min(distance(got.tensor, votes[w].tensor) for w in far)
            missing = len([w for w in drawn if w not in results])
            why = f"{missing} of {len(drawn)} drawn witnesses did not answer" if missing else "too few replicas to convict"
            await self._send_evidence(got.peer, f"spot check: its {got.direction} output of step {got.step} is {nearest:.3g} away from "
                                                f"{len(far)} recomputation(s) ({why})", None)

    def _count(self, peer: str, *, passed: bool) -> None:
        counts = self.per_peer.setdefault(peer, [0, 0])
        if passed:
            self.stats.checks_passed += 1
            counts[0] += 1
            self.policy.passed(peer)
        else:
            self.stats.checks_failed += 1
            counts[1] += 1
            self.policy.failed(peer)

    def peer_checks(self) -> list[PeerCheck]:
        """What this node's checks found of the peers that sent it tensors lately (for the heartbeat)."""
        recent = sorted(self._seen, key=self._seen.__getitem__, reverse=True)[:MAX_PEER_CHECKS]
        out = []
        for p in recent:
            passed, failed = self.per_peer.get(p, (0, 0))
            score = self.monitor.score(p) if self.monitor is not None else 0.0
            score = min(max(float(score), 0.0), 1e6) if score == score else 1e6
            out.append(PeerCheck(peer_id=p, score=score, state=self.policy.state(p), passed=passed, failed=failed))
        return out

    async def _gather_inputs(self, got: Received) -> list[TensorFrame] | None:
        """The input frames A computed from, checked against the digest it signed (None: unavailable)."""
        key = (got.step, got.ticket)
        frames: list[TensorFrame] = []
        if got.direction == "bwd":
            sent = self.tickets.frame(key, "fwd")
            if sent is None:
                return None
            frames.append(sent)
        needs_show = (got.direction == "fwd" and got.stage > 0) or (got.direction == "bwd" and got.stage < self.run.stages.num_stages - 1)
        if needs_show:
            shown = await self._show(got.peer, got.step, got.ticket, "input" if got.direction == "fwd" else "grad")
            if shown is None:
                return None
            frames.append(shown)
        if inputs_digest(frames) != got.inputs:
            log.info("spot check skipped peer=%s step=%d ticket=%d: inputs do not match what it signed", got.peer, got.step, got.ticket)
            return None
        return frames

    async def _show(self, peer: str, step: int, ticket: int, what: str) -> TensorFrame | None:
        try:
            with trio.fail_after(self.timeout_s):
                async with self.host.open_stream(peer, SHOW) as s:
                    await s.send(ShowRequest(step=step, ticket=ticket, what=what))
                    reply = await s.receive((Ack, Refuse))
                    if isinstance(reply, Refuse):
                        return None
                    return await s.receive_tensor(limits=self.limits)
        except (ProtocolError, trio.TooSlowError) as err:
            log.info("show failed peer=%s reason=%s", peer, getattr(err, "reason", "timed out"))
            return None

    async def _ask_check(self, peer: str, got: Received, inputs: list[TensorFrame]) -> Recomputed | None:
        try:
            with trio.fail_after(self.timeout_s):
                async with self.host.open_stream(peer, CHECK) as s:
                    await s.send(CheckRequest(step=got.step, ticket=got.ticket, stage=got.stage, direction=got.direction, inputs=len(inputs)))
                    for f in inputs:
                        await s.send_tensor(f)
                    reply = await s.receive((CheckResult, Refuse))
                    if isinstance(reply, Refuse):
                        log.info("check refused peer=%s step=%d reason=%s", peer, got.step, reply.reason)
                        return None
                    frame = await s.receive_tensor(codec="none", limits=self.limits)
                    low_frame = None if self.low is None else await s.receive_tensor(codec="none", limits=self.limits)
            out = decode(frame, peer=peer, shape=self.shape, dtype=torch.float32, limits=self.limits, require_finite=False)
            statement = boundary_statement(self.run_hash, got.step, got.ticket, got.direction, got.stage, got.inputs, frame_digest(frame))
            verify_peer(peer, statement, reply.signature)
            got_back = Recomputed(reply.signature, frame, out)
            if low_frame is not None and self.low is not None:
                low = decode(low_frame, peer=peer, shape=self.shape, dtype=torch.float32, limits=self.limits, require_finite=False)
                verify_peer(peer, low_statement(self.run_hash, got.step, got.ticket, got.direction, got.stage, got.inputs, frame_digest(low_frame), self.low),
                            reply.low_signature)
                got_back.low_signature, got_back.low_frame, got_back.spread = reply.low_signature, low_frame, distance(out, low)
            return got_back
        except (ProtocolError, trio.TooSlowError) as err:
            log.info("check failed peer=%s reason=%s", peer, getattr(err, "reason", "timed out"))
            return None

    def reducer_fault(self, fault: ReducerFault) -> None:
        """The collective caught a reducer of this stage signing a wrong part: send the proof."""
        self._spawn(self._send_evidence, fault.reducer, f"collective round {fault.round}: a wrong reduced part", None, fault)

    async def _send_evidence(self, accused: str, reason: str, ev: OutputEvidence | None, fault: ReducerFault | None = None) -> None:
        if accused in self._reporting or accused in self.convicted:
            return
        now = trio.current_time()
        if ev is None and fault is None:
            if now - self._claimed_at.get(accused, -CLAIM_INTERVAL_S) < CLAIM_INTERVAL_S:
                return
            self._claimed_at[accused] = now
        self._reporting.add(accused)
        self.stats.evidence_sent += ev is not None or fault is not None
        log.warning("integrity report peer=%s evidence=%s reason=%s", accused, ev is not None or fault is not None, reason)
        try:
            if await self.report(accused, reason, ev, fault):
                self.convicted.add(accused)
        except ProtocolError as err:
            log.warning("integrity report failed peer=%s reason=%s", accused, err.reason)
        finally:
            self._reporting.discard(accused)
