"""The collective adapter: runs :class:`~protolearn.protocol.collective.CollectiveRound` over libp2p streams.

Each part travels on its own ``collective`` stream: a :class:`PartHeader` message (with the sender's
suspected-dead peers, and for a reduced part the contributors it sums), the part as a raw float32 tensor,
or, in a round with a slice compression, as the ``uint8`` blob of its lossless encoding
(:mod:`protolearn.node.part_frames`: either way the round gets the float32 values the sender signed, so
replicas stay bit-identical), and an :class:`Ack` or :class:`Refuse`. ``fin`` and
``probe`` are a header alone. A send that breaks, or a probe that gets no answer, is reported to the
machine as a failed peer; a send that is acknowledged is reported as delivered (the successor-first rule
needs that). The wait between events is the machine's :meth:`next_deadline`, so the adaptive deadlines
(scaled by the bandwidth EMA this adapter keeps across rounds) are what time a round out.
Reduced parts and fins are signed with this node's Ed25519 key (the round gets ``sign`` and ``verify``;
see :mod:`protolearn.protocol.statements`), and a received part is hashed in a worker thread before the
round checks it, so hashing 16 MiB parts never stalls the event loop. A finished round's fin and full
result are kept for a while (:mod:`protolearn.node.finished_rounds`), for a peer that still probes it and
for a replica that fetches the result, so that nobody waits out a deadline on a replica that is done.
Parts of a round this replica has not started yet (a faster replica got the step's accounting first)
are held, but only for the current and the next round, and within per-peer and total bounds on parts
and bytes checked against the header before the payload is read (:mod:`protolearn.node.core.early_parts`),
so memory stays bounded whoever sends them. A replica that the step's accounting leaves out (it processed
no ticket, so no peer expects it), or whose own round failed, asks a participant for the finished round's
vector with :class:`ResultRequest` and takes it only as proven by a strict majority of the participants'
signed fins (:meth:`Averager.fetch_result`, :mod:`protolearn.node.result_fetch`), and so applies exactly the same update. The round's hard deadline comes from the node config; a round survives
dead peers, and :attr:`Averager.last_done` says whose contributions are in (``excluded``: tickets to redo);
:attr:`Averager.last_failed` keeps a failed round's reason and, if a peer signed two stories, the evidence.
The run's aggregation rule (:mod:`protolearn.protocol.collective.robust`) and the reducer cross-check are passed to
every round; with the cross-check, scatter slices are signed, and a round this replica vetoed (a reducer
signed a wrong part: :attr:`Failed.reducer_faults` holds the proof for the coordinator) answers late probes
with its vetoing fin instead of ``left``, so that no peer stops waiting for its objection.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Collection
from dataclasses import dataclass

import torch
import trio
from protolearn.node.core.early_parts import EarlyParts
from protolearn.node.errors import AveragingError, ResultGone  # noqa: F401 - where callers import them from
from protolearn.node import part_frames
from protolearn.node.finished_rounds import FinishedRounds
from protolearn.node.result_fetch import fetch_proven
from protolearn.protocol.reducer_check import ReducerFault
from protolearn.protocol.collective import (
    DEFAULT_FLOOR_S,
    Aggregation,
    Bandwidth,
    CollectiveRound,
    Done,
    Failed,
    PartHeader,
    Probe,
    Rejected,
    Send,
    PartFilter,
)
from protolearn.protocol.collective.liveness import FailureDetector
from protolearn.protocol.errors import OverLimit, ProtocolError
from protolearn.protocol.collective.result_proof import fins_of
from protolearn.protocol.pipeline import COLLECTIVE, Ack, Refuse, ResultRequest
from protolearn.protocol.rounds import in_early_window
from protolearn.protocol.statements import Sign, Verify, part_hash, verify_ed25519
from protolearn.protocol.sync_compression import SliceCodec
from protolearn.protocol.transport import FramedStream, Host, TensorHeader

log = logging.getLogger("protolearn.node")
MAX_INBOUND = 64  # collective streams handled at once
MAX_INBOUND_PER_PEER = 8


@dataclass
class _Pending:
    peer: str
    msg: PartHeader
    data: torch.Tensor | None
    data_digest: bytes | None


class Averager:
    """All-reduce of one stage's gradients among its replicas, one round per step."""

    def __init__(
        self, host: Host, stage: int, numel: int, *, timeout_s: float, floor_s: float = DEFAULT_FLOOR_S,
        window: Callable[[], int] | None = None, first_round: int = 0, clock: Callable[[], float] = trio.current_time,
        sign: Sign | None = None, verify: Verify = verify_ed25519, max_liars: int = 1,
        members: Callable[[], Collection[str]] | None = None, aggregation: Aggregation | None = None,
        cross_check: bool = False, part_filter: PartFilter | None = None,
        on_reducer_fault: Callable[[ReducerFault], None] | None = None,
    ) -> None:
        """``window``: the round this replica takes part in next, from its owner (the node core, which
        knows whether a step may still reopen). Without one, the averager counts its own rounds from
        ``first_round`` (a stand-alone averager in a test or benchmark). ``sign``: this node's signature
        (by default the host's identity key); ``verify``: a peer's; ``max_liars``: see
        :class:`~protolearn.protocol.collective.CollectiveRound`. ``members``: this stage's members in the
        node's view, so that parts from non-members held before a round starts share a small budget
        (None: every sender is treated as a possible member; the per-peer bounds hold either way).
        ``aggregation``: the run's rule (``Aggregation.from_config(run.integrity)``; None: the mean).
        ``cross_check``: every part's owner is checked by its successor (scatter traffic doubles); every
        replica of a stage must use the same setting. ``part_filter``: applied to the parts this replica
        reduces before it signs them (the node's outbound filter, node/outbound.py; None: parts go as
        reduced). ``on_reducer_fault``: called with each proof that a reducer signed a wrong part (the node
        sends it to the coordinator)."""
        self.host = host
        self.stage = stage
        self.numel = numel
        self.timeout_s = timeout_s
        self.floor_s = floor_s
        self.clock = clock
        self.sign = sign if sign is not None else host.sign
        self.verify = verify
        self.max_liars = max_liars
        self.aggregation = aggregation if aggregation is not None else Aggregation()
        self.cross_check = cross_check
        self.part_filter = part_filter
        self._window = window
        self._own_next = first_round
        # Receive-rate EMA across rounds: the per-wait deadlines scale with it.
        self.bandwidth = Bandwidth()
        # The last round's outcome: ``contributors`` are in the result, ``excluded`` died and are out.
        self.last_done: Done | None = None
        # The last round that failed, with its evidence (two statements one peer signed) when a peer lied.
        self.last_failed: Failed | None = None
        self.on_reducer_fault = on_reducer_fault
        self._round: CollectiveRound | None = None
        self._outbox: trio.MemorySendChannel[Send | Probe] | None = None
        self._finished = trio.Event()
        # Parts of rounds not started here yet, bounded per peer and in all (node/core/early_parts.py).
        self._early: EarlyParts[_Pending] = EarlyParts(vector_bytes=4 * numel)
        self._members = members
        self._part_limits = part_frames.limits(numel)
        # Bytes this replica wrote on its collective streams (parts, fins, probes, their headers): what
        # replica sync costs it, for the benchmarks.
        self.bytes_sent = 0
        # Finished rounds' fins and full results, for late probes and left-out replicas (node/finished_rounds.py).
        self.finished = FinishedRounds(timeout_s)
        # Sends of the current round queued or in flight, per peer (the end of a round waits for live peers').
        self._pending: dict[str, int] = {}
        self._drained = trio.Event()

    @property
    def next_round(self) -> int:
        return self._window() if self._window is not None else self._own_next

    def register(self) -> None:
        # A replica has a few streams to another at once (a scatter and a gather part, a probe, a fin, a
        # result request), so 8 per peer; peers outside this stage's view share a quarter of the slots.
        known = None if self._members is None else (lambda peer: peer in self._members())
        self.host.serve_stream(
            COLLECTIVE, self._handle, max_inbound=MAX_INBOUND, max_inbound_per_peer=MAX_INBOUND_PER_PEER,
            known=known, max_inbound_unknown=MAX_INBOUND // 4,
        )

    # -- inbound ---------------------------------------------------------------------------------
    async def _handle(self, peer: str, s: FramedStream) -> None:
        msg = await s.receive((PartHeader, ResultRequest))
        if msg.stage != self.stage:
            await s.send(Refuse(code="stage", reason=f"this replica serves stage {self.stage}, not {msg.stage}"))
            return
        if isinstance(msg, ResultRequest):
            await self.finished.serve(s, msg.round, self.next_round)
            return
        r = self._round if self._round is not None and self._round.round_id == msg.round else None
        if r is not None:
            r.peer_alive(peer, self.clock())  # a part may take a while to arrive; its sender is alive
        if msg.phase == "probe":
            if r is not None:  # a probe's claims may hand this replica a dead peer's part
                self._dispatch(r.receive(peer, "probe", 0, None, suspects=msg.suspects, now=self.clock()))
            elif self.finished.ended_here(msg.round):
                # Done with that round here: the prober waits for our fin (it may have missed it), or, if the
                # round failed here, should stop waiting for us.
                fin = self.finished.fin(msg.round)
                await s.send(fin if fin is not None else Refuse(code="left", reason=f"round {msg.round} failed here"))
                return
            await s.send(Ack())
            return
        # A part of a round not started here may be held: its bytes are admitted against the sender's
        # bounds (node/core/early_parts.py) once its header is checked, before its payload is read.
        early = r is None and in_early_window(self.next_round, msg.round)
        reserved: list[int] = []
        length = None
        if r is not None and 0 <= msg.part < len(r.bounds):
            a, b = r.bounds[msg.part]
            length = b - a

        def admit(header: TensorHeader) -> None:
            part_frames.check_header(peer, header, msg.part, length, self.numel)
            if early:
                self._reserve_early(peer, msg.round, header.data_bytes)
                reserved.append(header.data_bytes)

        try:
            data, data_digest = None, None
            if msg.phase != "fin":
                frame = await s.receive_tensor(codec="none", limits=self._part_limits, admit=admit)
                data = await part_frames.values(peer, frame, length, self.numel)
                if msg.phase == "gather" or msg.signature:  # the round checks it against the signed hash
                    data_digest = await trio.to_thread.run_sync(part_hash, data)
            elif early:
                self._reserve_early(peer, msg.round, 0)
                reserved.append(0)
            # The round may have started while the tensor was read; its held parts are already taken.
            r = self._round if self._round is not None and self._round.round_id == msg.round else None
            if r is None and reserved and in_early_window(self.next_round, msg.round):
                self._early.hold(msg.round, peer, reserved.pop(), _Pending(peer, msg, data, data_digest))
                await s.send(Ack())
                return
        finally:
            if reserved:  # not held: refused, broken, or its round started meanwhile
                self._early.unreserve(peer, reserved.pop())
        if r is not None:
            actions = self._receive(r, _Pending(peer, msg, data, data_digest))
            refused = [a for a in actions if isinstance(a, Rejected)]
            self._dispatch(actions)
            if refused:
                await s.send(Refuse(code="invalid", reason=refused[0].reason[:500]))
                return
        elif in_early_window(self.next_round, msg.round):
            # Read for a round that was running then (and ended since): held like any early part, if it fits.
            num_bytes = 0 if data is None else 4 * data.numel()
            why = self._early.reserve(peer, num_bytes, member=self._members is None or peer in self._members())
            if why is not None:
                await s.send(Refuse(code="busy", reason=f"early part for round {msg.round}: {why}"[:500]))
                return
            self._early.hold(msg.round, peer, num_bytes, _Pending(peer, msg, data, data_digest))
        else:
            await s.send(Refuse(code="stale", reason=f"round {msg.round} is not current (next round {self.next_round})"))
            return
        await s.send(Ack())

    def _reserve_early(self, peer: str, round_id: int, num_bytes: int) -> None:
        member = self._members is None or peer in self._members()
        why = self._early.reserve(peer, num_bytes, member=member)
        if why is not None:
            raise OverLimit(peer, f"stage {self.stage} early part for round {round_id} of {num_bytes} bytes: {why}")

    def _receive(self, r: CollectiveRound, p: _Pending) -> list:
        m = p.msg
        return r.receive(p.peer, m.phase, m.part, p.data, contributors=m.contributors, suspects=m.suspects, signer=m.signer,
                         digest=m.digest, signature=m.signature, inputs=m.inputs, vetoed=m.vetoed, data_digest=p.data_digest, now=self.clock())

    async def fetch_result(self, round_id: int, weights: dict[str, float], numel: int | None = None,
                           codec: SliceCodec | None = None) -> torch.Tensor:
        """Round ``round_id``'s full vector (``numel`` values, by default the stage's: a PowerSGD factor round's
        are fewer; ``codec``: the round's slice compression) from another of its participants (``weights``),
        proven by a strict majority of their signed fins (:func:`protolearn.node.result_fetch.fetch_proven`)."""
        n = self.numel if numel is None else numel
        started = self.clock()
        result = await fetch_proven(
            self.host, self.stage, round_id, weights, numel=n, rule_tag=self.aggregation.tag,
            cross_check=self.cross_check, compression="none" if codec is None else codec.tag, verify=self.verify,
            timeout_s=self.timeout_s, clock=self.clock,
        )
        # A sample of the rate too (it counts any wait for the round to finish there, so it errs low): a replica
        # that is always left out learns its link from its fetches.
        self.bandwidth.observe(4 * n, self.clock() - started)
        self._own_next = max(self._own_next, round_id + 1)
        return result

    def fetch_time_s(self, numel: int | None = None) -> float:
        """How long a fetch of the full vector (``numel`` values, by default the stage's) may take before the
        node core looks elsewhere: the collective's part deadline for that many bytes, at the measured rate."""
        n = self.numel if numel is None else numel
        return FailureDetector(floor_s=self.floor_s, bandwidth=self.bandwidth).deadline_s(4 * n)

    def _dispatch(self, actions: list) -> None:
        for a in actions:
            if isinstance(a, (Send, Probe)):
                assert self._outbox is not None  # a round in progress always has its outbox
                try:
                    self._outbox.send_nowait(a)
                    self._pending[a.peer] = self._pending.get(a.peer, 0) + 1
                except trio.ClosedResourceError:
                    # The round finished and is draining its last sends; anything it asks for now is moot.
                    log.warning("collective %s to %s dropped: round %d already finished here", type(a).__name__, a.peer, self._round.round_id if self._round else -1)
            elif isinstance(a, Rejected):
                self.host.log_refusal(a.peer, COLLECTIVE, "rejected", f"stage {self.stage}: {a.reason}")
            elif isinstance(a, (Done, Failed)):
                self._finished.set()

    def peer_banned(self, peer: str, reason: str) -> None:
        """The coordinator banned ``peer``: it is out of the round in flight from now on, as if its stream
        broke. A banned peer that still answers probes would otherwise be waited on (for its fin, say)
        until it goes silent."""
        r = self._round
        if r is not None and peer in r.weights:
            log.info("collective peer banned peer=%s round=%d reason=%s", peer, r.round_id, reason)
            self._dispatch(r.peer_failed(peer, f"banned by the coordinator: {reason}", self.clock()))

    # -- a round ---------------------------------------------------------------------------------
    async def run_round(self, round_id: int, weights: dict[str, float], vector: torch.Tensor) -> torch.Tensor:
        """Sum ``vector`` over the replicas in ``weights``; returns the identical result on every survivor.

        Replicas that die are left out consistently; :attr:`last_done` names who is in and who is out.
        """
        done = await self.run_round_detailed(round_id, weights, vector)
        return done.result

    async def run_round_detailed(self, round_id: int, weights: dict[str, float], vector: torch.Tensor, *,
                                 codec: SliceCodec | None = None) -> Done:
        """Like :meth:`run_round`, returning the :class:`Done` with ``contributors`` and ``excluded``.

        ``vector`` may be shorter than the stage's (a PowerSGD factor); with a slice ``codec`` it is the
        codec's contributions, and parts travel in its encoding (:mod:`protolearn.node.replica_sync`)."""
        if vector.numel() > self.numel:
            raise ValueError(f"a round of {vector.numel()} values exceeds this stage's {self.numel}")
        r = CollectiveRound(
            round_id, self.host.peer_id, weights, vector.numel(), op="sum", timeout_s=self.timeout_s,
            bandwidth=self.bandwidth, floor_s=self.floor_s, max_liars=self.max_liars, aggregation=self.aggregation,
            cross_check=self.cross_check, sign=self.sign, verify=self.verify, part_filter=self.part_filter, codec=codec,
        )
        # Unbounded in principle, bounded in fact: the machine emits at most a few sends per peer and part.
        send, recv = trio.open_memory_channel[Send | Probe](16 * len(weights) ** 2 + 64)
        self._round, self._outbox, self._finished = r, send, trio.Event()
        self._pending = {}
        self._early.drop_before(round_id)
        try:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(self._sender, recv, round_id, nursery)
                self._dispatch(r.start(vector, self.clock()))
                for p in self._early.take(round_id):
                    self._dispatch(self._receive(r, p))
                while r.finished is None:
                    wake = r.next_deadline()
                    with trio.move_on_at(self.clock() + 1.0 if wake is None else wake):
                        await self._finished.wait()
                    self._dispatch(r.poll(self.clock()))
                # Finished means we hold every live peer's fin, not that they hold ours: a fin queued by the
                # same event that finished this round is still on its way, and without it the peer waits
                # out its deadline. So let the sends to live peers drain, for a bounded time. Sends to
                # suspected peers are not waited for: a dead peer's dial can take most of a second to fail.
                send.close()
                with trio.move_on_after(max(1.0, r.wait_s())):
                    while any(self._pending.get(p) for p in r.live_peers()):
                        self._drained = trio.Event()
                        await self._drained.wait()
                nursery.cancel_scope.cancel()
        finally:
            self._round, self._outbox = None, None
            self._own_next = round_id + 1
        result = r.finished
        fin = (result.contributors, result.digest, result.signature, b"") if isinstance(result, Done) else r.veto
        self.finished.ended(round_id, None if fin is None else PartHeader(
            round=round_id, stage=self.stage, phase="fin", part=0, contributors=list(fin[0]),
            suspects=sorted(r.suspects), signer=self.host.peer_id, digest=fin[1], signature=fin[2], vetoed=fin[3],
        ))
        if isinstance(result, Failed):
            self.last_failed = result
            if result.reducer_faults and self.on_reducer_fault is not None:
                for fault in result.reducer_faults:
                    self.on_reducer_fault(fault)
            raise AveragingError(f"stage {self.stage} averaging of step {round_id} failed: {result.reason}",
                                 tuple(p for p in result.missing if p != self.host.peer_id))
        assert isinstance(result, Done)
        if result.excluded:
            log.warning("collective step=%d stage=%d left out dead replicas %s", round_id, self.stage, result.excluded)
        self.last_done = result
        # Only a full average is served (see node/finished_rounds.py).
        self.finished.done(round_id, None if result.excluded else result.result, fins_of(r.peers, r.held_fins()))
        return result

    async def _sender(self, recv: trio.MemoryReceiveChannel[Send | Probe], round_id: int, nursery: trio.Nursery) -> None:
        async with recv:
            async for action in recv:
                nursery.start_soon(self._send_counted, action, round_id)

    async def _send_counted(self, a: Send | Probe, round_id: int) -> None:
        try:
            await self._send_part(a, round_id)
        finally:
            self._pending[a.peer] -= 1
            self._drained.set()

    async def _send_part(self, a: Send | Probe, round_id: int) -> None:
        r = self._round
        if r is None or r.round_id != round_id:
            return
        phase = "probe" if isinstance(a, Probe) else a.phase
        msg = PartHeader(
            round=round_id, stage=self.stage, phase=phase, part=0, suspects=sorted(r.suspects),
        ) if isinstance(a, Probe) else PartHeader(
            round=round_id, stage=self.stage, phase=phase, part=a.part, contributors=list(a.contributors),
            suspects=sorted(r.suspects), signer=a.signer, digest=a.digest, signature=a.signature, inputs=a.inputs,
            vetoed=a.vetoed,
        )
        # A part is bounded by the transport's per-chunk deadline (a dead or hung peer stops taking chunks),
        # not by a total: a slow but live transfer must not count as a death. A busy live peer answers a
        # probe well within two waits; a dead one refuses the connection at once.
        limit = max(2 * r.wait_s(), self.host.config.connect_timeout_s) if isinstance(a, Probe) else float("inf")
        frame = await part_frames.frame_of(r.codec, a.data) if isinstance(a, Send) and a.data is not None else None
        try:
            with trio.fail_after(limit):
                async with self.host.open_stream(a.peer, COLLECTIVE) as s:
                    try:
                        await s.send(msg)
                        if frame is not None:
                            await s.send_tensor(frame)
                        reply = await s.receive((Ack, Refuse, PartHeader))
                    finally:
                        self.bytes_sent += s.bytes_sent
        except ProtocolError as err:
            log.info("collective peer failed peer=%s round=%d phase=%s reason=%s", a.peer, round_id, phase, err.reason)
            self._dispatch(r.peer_failed(a.peer, err.reason, self.clock()))
            return
        except trio.TooSlowError:
            log.info("collective peer failed peer=%s round=%d phase=%s reason=no answer within %g s", a.peer, round_id, phase, limit)
            self._dispatch(r.peer_failed(a.peer, f"no answer within {limit:g} s", self.clock()))
            return
        if isinstance(reply, PartHeader):
            # A probed peer that finished the round answers with its fin (only a probe gets this answer).
            if isinstance(a, Probe) and reply.phase == "fin" and reply.round == round_id and reply.stage == self.stage:
                self._dispatch(self._receive(r, _Pending(a.peer, reply, None, None)))
            else:
                self.host.log_refusal(a.peer, COLLECTIVE, "rejected", f"stage {self.stage}: {phase} answered with a {reply.phase} header")
            return
        if isinstance(reply, Refuse) and reply.code == "left" and isinstance(a, Probe):
            # Its own word that it is out of the round (it failed there): stop waiting for it.
            log.info("collective peer left peer=%s round=%d reason=%s", a.peer, round_id, reply.reason)
            self._dispatch(r.peer_failed(a.peer, reply.reason, self.clock()))
            return
        if isinstance(reply, Refuse):
            # Alive but not taking this (e.g. it already finished): not a death, so nothing to suspect.
            log.warning("collective part refused peer=%s round=%d phase=%s reason=%s", a.peer, round_id, phase, reply.reason)
        if isinstance(a, Send):
            self._dispatch(r.delivered(a, self.clock()))
        else:
            r.peer_alive(a.peer, self.clock())
