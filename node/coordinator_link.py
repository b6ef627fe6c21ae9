"""A node's client for the coordinator: join, heartbeats, leases, completions, step waits, reports, leave.

:class:`CoordinatorLink` wraps a transport :class:`~protolearn.protocol.transport.Host` and the
coordinator's multiaddr. Every call is one request/response on ``/protolearn/coordinator/1.0.0``.
When the coordinator cannot be reached (it restarted, the network blinked) a call retries with
exponential backoff and jitter until ``retry_for_s`` has passed, then raises the last error. A
refusal is never retried: it raises :class:`CoordinatorRefused`, whose ``code`` tells the caller what
to do (``not_member``: join again; ``duplicate``: the ticket was already counted; ...). An answer that
is not a decision (``busy``, ``rate_limited``: :data:`NOT_A_DECISION`) is asked again in the same way and
then raises :class:`CoordinatorBusy`, a timeout: "busy" is never read as "no".

Retried writes are made idempotent here: if a ``Complete`` is retried after its reply was lost, a
``duplicate`` or ``step_closed`` refusal means the first attempt was counted, and the call returns
normally. Every join and heartbeat carries the link's :attr:`~CoordinatorLink.session` (random, one per
link): a join retried after its reply was lost is answered again with the same stage, while another
process with this node's key is refused (``identity_in_use``), and a heartbeat refused as ``superseded``
(another process with the key took this one's place) stops the node with :class:`IdentityInUse`.

:meth:`CoordinatorLink.heartbeat_loop` is a service (``task_status.started()``) that sends a
heartbeat every interval, keeps :attr:`members`, :attr:`bans` and :attr:`stage` current. When the
coordinator no longer knows the node (it expired while unreachable, or while its process was starved
between its join and its first heartbeat), whichever request hears ``not_member`` first joins again,
once per loss, and every request so refused is asked again as the member it is again; the new
:attr:`stage` may differ, and the node moves as it would after a rebalance.
"""

from __future__ import annotations

import logging
import random
import secrets
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal, TypeVar

import trio
from protolearn.node.errors import Banned, IdentityInUse
from protolearn.protocol import coordination as cm
from protolearn.protocol.status_schema import Status
from protolearn.protocol.boundary import OutputEvidence
from protolearn.protocol.reducer_check import ReducerFault
from protolearn.protocol.errors import PeerTimeout, PeerUnavailable, ProtocolError, Refused
from protolearn.protocol.transport.streams import FramedStream
from protolearn.protocol.wire import Message

log = logging.getLogger("protolearn.node")

R = TypeVar("R", bound=Message)
# After a heartbeat stream could not be opened or broke, heartbeats go as requests this long before a new one.
BEATS_RETRY_S = 30.0
# How long a corpus check waits for stage 0 to settle the swarm's data, and how often it asks.
CORPUS_WAIT_S = 60.0
CORPUS_RETRY_S = 1.0


class CoordinatorRefused(Refused):
    """The coordinator refused a request on purpose; ``code`` is its stable reason code."""

    def __init__(self, peer: str, code: str, reason: str) -> None:
        super().__init__(peer, f"{code}: {reason}")
        self.code = code
        self.detail = reason  # without the code: what a user reads
        # How many attempts failed (unreachable) before this refusal came back.
        self.after_failures = 0


class CoordinatorBusy(PeerTimeout):
    """The coordinator answered only that it could not take the request now (``busy``, ``rate_limited``), for
    as long as the link retries: no answer, not a "no". A caller that reads it as a refusal would act on
    a decision nobody made (e.g. apply a step that is being redone), so it is a timeout."""

    def __init__(self, peer: str, code: str, reason: str) -> None:
        super().__init__(peer, f"{code}: {reason}")
        self.code = code


# Refusals that decide nothing about the request: the coordinator could not take it now (its long-poll
# slots are full, this peer is over its request rate). They are asked again with back-off, like an
# unreachable coordinator, and past ``retry_for_s`` raise :class:`CoordinatorBusy`.
NOT_A_DECISION = frozenset({"busy", "rate_limited"})


@dataclass(frozen=True)
class RetryPolicy:
    """How long and how often to retry an unreachable coordinator."""

    retry_for_s: float = 60.0
    initial_backoff_s: float = 0.1
    # The gap between the coordinator coming back and a node noticing is up to this (times the
    # jitter): a restart must cost nodes ~1 s, not 5. Each failed attempt is one refused TCP dial,
    # so even many thousands of nodes probing a dead coordinator every second cost it nothing.
    max_backoff_s: float = 1.0
    request_timeout_s: float = 10.0


def _parse_refusal(peer: str, err: Refused) -> CoordinatorRefused:
    # The transport sends "Refusal: <code>: <reason>" for the coordinator's refusals.
    text = err.reason
    if text.startswith("Refusal: "):
        code, _, reason = text[len("Refusal: "):].partition(": ")
        return CoordinatorRefused(peer, code, reason)
    return CoordinatorRefused(peer, "refused", text)


def coordinator_peer_id(addr: str) -> str:
    """The peer ID at the end of a ``/.../p2p/<id>`` multiaddr."""
    _, sep, peer = addr.rpartition("/p2p/")
    if not sep or not peer or "/" in peer:
        raise PeerUnavailable("unknown", f"coordinator address {addr!r} has no /p2p/<peer id>; copy the full line `coordinator start` printed")
    return peer


class CoordinatorLink:
    def __init__(self, host: Any, coordinator: str, *, retry: RetryPolicy | None = None, session: str = "") -> None:
        self.host = host
        self.session = session or secrets.token_hex(8)
        self.addr = coordinator
        self.peer = coordinator_peer_id(coordinator)
        self.retry = retry or RetryPolicy()
        self._join: cm.Join | None = None
        self.joined: cm.JoinReply | None = None
        self.stage: int = -1
        self.members: list[cm.MemberView] = []
        self.view_version = -1
        self.bans: list[str] = []
        # From the last heartbeat: peers that left (or left this node's neighbourhood), and per stage
        # the replicas serving it (empty until the coordinator said).
        self.removed: list[str] = []
        self.stage_replicas: list[int] = []
        self.step = 0
        self.last_closed = -1
        self.rejoins = 0
        # The interval to heartbeat at: the join reply's, then the latest a heartbeat reply set (it grows with
        # the swarm: coordinator/core/pacing.py).
        self.heartbeat_interval_s = 1.0
        self._rejoining = trio.Lock()
        # heartbeat_loop's open heartbeat stream (cm.BEATS), while it has one.
        self._beats: FramedStream | None = None
        self._beat_now = trio.Event()
        # Since when (trio time) every request has failed to reach the coordinator; None while it answers.
        self.unreachable_since: float | None = None

    async def _request(self, msg: Message, reply_type: type[R], *, timeout: float | None = None) -> tuple[R, int]:
        """Send with retries; returns the reply and how many attempts failed before it."""
        limit = timeout or self.retry.request_timeout_s
        backoff = self.retry.initial_backoff_s
        failures = busy = 0
        rejoined = False
        deadline = trio.current_time() + self.retry.retry_for_s
        while True:
            generation = self.rejoins
            try:
                target = self.addr if failures else self.peer
                try:
                    reply = await self.host.request(target, cm.COORDINATOR, msg, reply_type, timeout=limit)
                except PeerUnavailable:
                    if target is self.addr:
                        raise
                    # Not connected yet (or the address was forgotten): dial the full multiaddr.
                    reply = await self.host.request(self.addr, cm.COORDINATOR, msg, reply_type, timeout=limit)
                self.unreachable_since = None
                return reply, failures
            except Refused as err:
                self.unreachable_since = None  # it answered, if only to refuse
                refusal = err if isinstance(err, CoordinatorRefused) else _parse_refusal(self.peer, err)
                if refusal.code == "not_member" and not rejoined and self._join is not None and not isinstance(msg, (cm.Join, cm.Leave)):
                    rejoined = True
                    await self._rejoin(generation, refusal.detail)
                    continue
                if refusal.code not in NOT_A_DECISION:
                    refusal.after_failures = failures
                    raise refusal from None
                busy += 1
                if trio.current_time() + backoff > deadline:
                    raise CoordinatorBusy(self.peer, refusal.code, f"{refusal.detail} (asked {busy} times)") from None
                log.info("coordinator busy (%s: %s); asking again in %.2f s", refusal.code, refusal.detail, backoff)
            except (PeerUnavailable, PeerTimeout) as err:
                failures += 1
                if self.unreachable_since is None:
                    self.unreachable_since = trio.current_time()
                if trio.current_time() + backoff > deadline:
                    raise
                log.info("coordinator unreachable (%s); retrying in %.2f s", err.reason, backoff)
            await trio.sleep(backoff * random.uniform(0.5, 1.0))
            backoff = min(backoff * 2, self.retry.max_backoff_s)

    async def _rejoin(self, generation: int, why: str) -> None:
        """Join again, unless another request did since this one was sent (``generation``: :attr:`rejoins`)."""
        assert self._join is not None
        async with self._rejoining:
            if self.rejoins != generation:
                return
            log.warning("coordinator no longer knows this node (%s); joining again", why)
            await self.join(self._join)
            self.rejoins += 1

    async def join(self, msg: cm.Join) -> cm.JoinReply:
        """Join (or join again) with this link's session, which a retry after a lost reply repeats."""
        msg = self._join = msg.model_copy(update={"session": self.session})
        reply, _ = await self._request(msg, cm.JoinReply)
        self.joined = reply
        self.heartbeat_interval_s = reply.heartbeat_interval_s
        self.stage, self.step = reply.stage, reply.step
        self.members, self.view_version, self.bans = list(reply.members), reply.view_version, list(reply.bans)
        return reply

    async def heartbeat(self, hb: cm.Heartbeat) -> cm.HeartbeatReply:
        """One heartbeat. The view comes as deltas of this node's neighbourhood (its own and the adjacent
        stages: all a replica routes to or averages with), merged here, or as a bounded snapshot."""
        hb = hb.model_copy(update={"view_version": self.view_version, "view_delta": True, "session": self.session})
        reply = await self._beat_on_stream(hb)
        if reply is None:
            reply, _ = await self._request(hb, cm.HeartbeatReply)
        self.stage, self.step, self.last_closed = reply.stage, reply.step, reply.last_closed
        if reply.heartbeat_interval_s > 0:
            self.heartbeat_interval_s = reply.heartbeat_interval_s
        self.bans = list(reply.bans)
        self.removed = list(reply.removed)
        if reply.stage_replicas:
            self.stage_replicas = list(reply.stage_replicas)
        if reply.view_changed:
            if reply.view_delta:
                gone = set(reply.removed) | {m.peer_id for m in reply.members}
                self.members = [m for m in self.members if m.peer_id not in gone] + list(reply.members)
            else:
                self.members = list(reply.members)
            self.view_version = reply.view_version
        return reply

    async def heartbeat_loop(
        self,
        make: Callable[[], cm.Heartbeat],
        on_reply: Callable[[cm.HeartbeatReply], None] | None = None,
        *,
        task_status: Any = trio.TASK_STATUS_IGNORED,
    ) -> None:
        """Heartbeat every :attr:`heartbeat_interval_s` (the coordinator's latest) until cancelled, on a heartbeat
        stream (:data:`~protolearn.protocol.coordination.BEATS`) while one is open, else as requests: after a stream
        could not be opened or broke, for :data:`BEATS_RETRY_S`, then a new stream is tried."""
        if self.joined is None or self._join is None:
            raise RuntimeError("join before starting the heartbeat loop")
        task_status.started()
        while True:
            opened = False
            try:
                async with self.host.open_stream(self.peer, cm.BEATS, timeout=self.retry.request_timeout_s) as s:
                    opened = True
                    self._beats = s
                    await self._beat_while(make, on_reply, lambda: self._beats is s)
            except ProtocolError as err:
                if opened:
                    raise
                log.info("no heartbeat stream (%s); heartbeats go as requests for %g s", err.reason, BEATS_RETRY_S)
            finally:
                self._beats = None
            until = trio.current_time() + BEATS_RETRY_S
            await self._beat_while(make, on_reply, lambda: trio.current_time() < until)

    async def _beat_while(
        self, make: Callable[[], cm.Heartbeat], on_reply: Callable[[cm.HeartbeatReply], None] | None, keep_on: Callable[[], bool],
    ) -> None:
        while keep_on():
            try:
                reply = await self.heartbeat(make())
            except CoordinatorRefused as err:
                if err.code == "banned":
                    raise Banned(f"the coordinator banned this node ({err.detail}); it stopped training") from None
                if err.code == "superseded":
                    raise IdentityInUse(f"this node stopped training: {err.detail}") from None
                if err.code != "not_member":
                    raise
                # Refused again, right after _request joined again for it: the next beat joins again.
            else:
                if on_reply is not None:
                    on_reply(reply)
            self._beat_now = trio.Event()
            with trio.move_on_after(self.heartbeat_interval_s):
                await self._beat_now.wait()

    async def _beat_on_stream(self, hb: cm.Heartbeat) -> cm.HeartbeatReply | None:
        """``hb`` on the heartbeat stream, if one is open; None if not, or if it failed, refusals included: the
        stream is dropped and the caller sends ``hb`` as a request, with its retries and its handling of refusals."""
        s = self._beats
        if s is None:
            return None
        try:
            await s.send(hb, timeout=self.retry.request_timeout_s)
            reply = await s.receive(cm.HeartbeatReply, timeout=self.retry.request_timeout_s)
        except ProtocolError as err:
            log.info("heartbeat stream dropped (%s); this beat goes as a request", err.reason)
            self._beats = None
            await s.reset()
            return None
        self.unreachable_since = None
        return reply

    def beat_now(self) -> None:
        """Send the next heartbeat at once (the node's state changed, e.g. it can take tickets now)."""
        self._beat_now.set()

    async def lease(self, max_tickets: int, *, wait_s: float = 0.0, holding: list[int] | None = None) -> cm.LeaseReply:
        """Up to ``max_tickets`` of the open step's tickets; with none free, the coordinator may hold the request up
        to ``wait_s`` for one to free (``cm.Lease.wait_s``). ``holding``: the tickets this node works on (the reply
        names the others it holds, ``held``)."""
        wait_s = min(wait_s, cm.MAX_WAIT_S)
        msg = cm.Lease(max_tickets=max_tickets, wait_s=wait_s, holding=list(holding or []))
        reply, _ = await self._request(msg, cm.LeaseReply,
                                       timeout=wait_s + self.retry.request_timeout_s if wait_s else None)
        return reply

    async def release(self, step: int, indices: list[int]) -> list[int]:
        reply, _ = await self._request(cm.Release(step=step, indices=indices), cm.ReleaseReply)
        return reply.released

    async def complete(
        self, step: int, index: int, route: list[str], loss: float, ack: bytes | None = None, nonce: bytes = b"",
    ) -> cm.CompleteReply:
        """Report ticket (step, index) done, with the last stage's signed ``ack`` of its route, loss and lease
        ``nonce`` (needed when the run has more than one stage); idempotent across retries (see the module docstring)."""
        msg = cm.Complete(step=step, index=index, route=route, loss=float(loss), ack=ack, nonce=nonce)
        try:
            reply, _ = await self._request(msg, cm.CompleteReply)
            return reply
        except CoordinatorRefused as err:
            if err.after_failures == 0 or err.code not in ("duplicate", "step_closed"):
                raise
            log.info("completion of (%d,%d) was already counted: %s", step, index, err.reason)
            return cm.CompleteReply(step=step, index=index, step_closed=err.code == "step_closed", remaining=-1)

    async def wait_step(
        self, step: int, *, min_revision: int = 1, timeout_s: float = 10.0, until: Literal["closed", "committed"] = "closed"
    ) -> cm.StepInfo:
        """Long-poll until ``step`` closes (or, ``until="committed"``, commits or reopens) or ``timeout_s`` passes."""
        timeout_s = min(timeout_s, cm.MAX_WAIT_S)
        msg = cm.WaitStep(step=step, min_revision=min_revision, timeout_s=timeout_s, until=until)
        reply, _ = await self._request(msg, cm.StepInfo, timeout=timeout_s + self.retry.request_timeout_s)
        return reply

    async def wait_committed(
        self, step: int, revision: int, *, report: bool, poll_s: float = 10.0, result_hash: str = "",
    ) -> bool:
        """The commit barrier: True once every stage averaged ``step`` at ``revision``; False if it reopened.

        ``report``: this node took part in the step, so it reports its stage's full average (again on
        every poll, so a restarted coordinator hears it too); a node the accounting left out only
        waits. Nobody applies a step that may still reopen, so a replica that dies while any stage
        averages never costs a ticket (I1). Waits as long as the step stays undecided (a stage with no
        replica left halts the run until one is restored). ``result_hash``: the hash of the result this
        node holds; when its stage's majority holds another one, the refusal (``result_mismatch``) is
        raised as :class:`CoordinatorRefused`: this node must resync, not apply.
        """
        while True:
            try:
                info = await self.averaged(step, revision, result_hash) if report else None
                if info is None or not info.committed:
                    info = await self.wait_step(step, min_revision=revision, timeout_s=poll_s, until="committed")
            except CoordinatorRefused as err:
                if err.code == "result_mismatch":
                    raise
                if err.code in ("stale_revision", "step_not_closed"):
                    return False  # reopened (and maybe closed again) under this node
                log.warning("averaged report refused step=%d reason=%s", step, err.reason)
                await trio.sleep(1.0)
                continue
            except ProtocolError as err:
                log.warning("commit wait failed step=%d reason=%s", step, err.reason)
                await trio.sleep(1.0)
                continue
            if info.committed and info.revision == revision:
                return True
            if not info.closed or info.revision != revision:
                return False

    async def averaged(self, step: int, revision: int, result_hash: str = "") -> cm.StepInfo:
        """Report that this node's stage averaged ``step`` at ``revision`` in full, to a result hashing to
        ``result_hash``; the reply says if it committed."""
        reply, _ = await self._request(cm.Averaged(step=step, revision=revision, result_hash=result_hash), cm.StepInfo)
        return reply

    async def outer_ready(self, msg: cm.OuterReady) -> cm.OuterDecision:
        """DiLoCo: this replica is ready for an outer round; long-polls the decision (``pending`` after ``msg.timeout_s``)."""
        return (await self._request(msg, cm.OuterDecision, timeout=min(msg.timeout_s, cm.MAX_WAIT_S) + self.retry.request_timeout_s))[0]

    async def check_corpus(self, fingerprint: str, *, wait_s: float = CORPUS_WAIT_S) -> cm.CorpusCheckReply:
        """Check this node's training data against the swarm's (refused with ``corpus_mismatch``).

        Stage 0's majority decides the swarm's data (coordinator/core/corpus.py): while stage 0 has not said
        (``corpus_pending``) or is split evenly (``corpus_disputed``), the check is repeated for up to
        ``wait_s``; a dispute still open then counts as a mismatch.
        """
        deadline = trio.current_time() + wait_s
        while True:
            try:
                reply, _ = await self._request(cm.CorpusCheck(fingerprint=fingerprint), cm.CorpusCheckReply)
                return reply
            except CoordinatorRefused as err:
                if err.code not in ("corpus_pending", "corpus_disputed"):
                    raise
                if trio.current_time() + CORPUS_RETRY_S > deadline:
                    code = "corpus_mismatch" if err.code == "corpus_disputed" else err.code
                    raise CoordinatorRefused(self.peer, code, f"{err.detail} (still so after {wait_s:g} s)") from None
                log.info("corpus check: %s; retrying in %g s", err.detail, CORPUS_RETRY_S)
                await trio.sleep(CORPUS_RETRY_S)

    async def redo(
        self, step: int, indices: list[int], reason: str, *, revision: int = 0, kind: str = "", causes: tuple[str, ...] = (),
    ) -> cm.RedoReply:
        """Ask to redo ``indices`` of ``step``; ``revision``: the closing of the step this is about; ``kind`` and
        ``causes``: why (:class:`~protolearn.protocol.coordination.Redo`)."""
        msg = cm.Redo(step=step, indices=indices, reason=reason[: cm.MAX_TEXT], revision=revision, kind=kind,  # type: ignore[arg-type]
                      causes=list(causes)[: cm.MAX_PARTICIPANTS])
        reply, _ = await self._request(msg, cm.RedoReply)
        return reply

    async def report(
        self, target: str, reason: str, evidence: cm.StatementEvidence | None = None, conflicting: cm.StatementEvidence | None = None,
        *, lost: int = 0,
    ) -> cm.ReportReply:
        """Report ``target``; only two statements it signed that contradict each other can ban it. ``lost``: a
        liveness report's count of microbatches the target lost in a row."""
        msg = cm.Report(target=target, reason=reason[: cm.MAX_TEXT], lost=lost, evidence=evidence, conflicting=conflicting)
        reply, _ = await self._request(msg, cm.ReportReply)
        return reply

    async def witnesses(self, target: str, step: int, ticket: int, direction: str) -> list[str]:
        """The replicas the coordinator drew to recompute ``target``'s (step, ticket, direction) output."""
        reply, _ = await self._request(cm.WitnessDraw(target=target, step=step, ticket=ticket, direction=direction), cm.WitnessDrawReply)
        return reply.witnesses

    async def integrity_report(
        self, target: str, reason: str, evidence: OutputEvidence | None, fault: ReducerFault | None = None,
    ) -> cm.ReportReply:
        """Report a stage that failed a check; only evidence the coordinator verifies itself can ban it."""
        msg = cm.IntegrityReport(target=target, reason=reason[: cm.MAX_TEXT], evidence=evidence, reducer_fault=fault)
        reply, _ = await self._request(msg, cm.ReportReply)
        return reply

    async def leave(self, reason: str = "") -> list[int]:
        try:
            reply, _ = await self._request(cm.Leave(reason=reason[: cm.MAX_TEXT]), cm.LeaveReply)
        except CoordinatorRefused as err:
            if err.code in ("not_member", "banned"):
                return []
            raise
        return reply.released

    async def stage_hashes(self, stage: int) -> list[cm.ParamHash]:
        """The parameter hashes ``stage``'s serving replicas reported (what a replica checks itself against)."""
        reply, _ = await self._request(cm.StageHashesRequest(stage=stage), cm.StageHashes)
        if reply.step >= 0:
            self.step = max(self.step, reply.step)  # the frontier only moves on
        return list(reply.param_hashes)

    async def status(self, loss_history: int = 200) -> Status:
        reply, _ = await self._request(cm.StatusRequest(loss_history=loss_history), Status)
        return reply
