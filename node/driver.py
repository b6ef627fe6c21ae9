"""Stage 0's ticket driver: lease the open step's tickets, start them, restart broken ones, report completions.

Only a stage-0 replica starts microbatches. While step t is open, :meth:`TicketDriver.drive` leases
tickets from the coordinator (at most ``max_in_flight`` in this replica's hands) and starts each one
through the :class:`~protolearn.node.router.Router`. It remembers when each in-flight ticket was
(re)started, and restarts a ticket whose gradient has not come back in time, whose forward send just
failed on a next-stage peer (:meth:`peer_down`), or, after a replica left the membership
(:meth:`member_left`), every in-flight ticket. A ticket that cannot start is released back to the
coordinator; one whose gradient comes back is reported complete (:meth:`complete`, the router's
``on_complete``). The node (:mod:`protolearn.node.node`) owns one driver for its lifetime and binds it
to each stage it builds.
"""

from __future__ import annotations

import logging
import time

import trio
from protolearn.node.accounting import Accounting
from protolearn.node.config import NodeConfig
from protolearn.node.coordinator_link import CoordinatorLink, CoordinatorRefused
from protolearn.node.progress import Progress
from protolearn.node.router import Router
from protolearn.node.worker import StageWorker
from protolearn.protocol.errors import ProtocolError
from protolearn.stages.config import RunConfig

log = logging.getLogger("protolearn.node")
LEASE_RETRY_S = 0.05


class TicketDriver:
    """Leases and drives stage 0's tickets. Call :meth:`bind` after each build, then :meth:`drive` per step."""

    def __init__(self, config: NodeConfig, run: RunConfig, link: CoordinatorLink, progress: Progress) -> None:
        self.config = config
        self.run = run
        self.link = link
        self.progress = progress
        self._slot_free = trio.Event()
        # When each in-flight ticket of the open step was (re)started; a departure restarts them.
        self._started: dict[int, float] = {}
        self._departed = trio.Event()
        # Next-stage peers a forward send just failed on: the tickets sent to them earlier are restarted.
        self._down: set[str] = set()
        self.worker: StageWorker
        self.router: Router
        self.accounting: Accounting

    def bind(self, worker: StageWorker, router: Router, accounting: Accounting) -> None:
        """Drive the stage the node just built."""
        self.worker = worker
        self.router = router
        self.accounting = accounting

    def member_left(self) -> None:
        """A replica left or died: tickets routed through it will never get their gradient back."""
        self._departed.set()
        self._slot_free.set()  # wake the drive loop now rather than at its next poll

    async def drive(self, step: int, closed: trio.Event) -> None:
        """Lease tickets of ``step`` and start them, at most ``max_in_flight`` at once, until it closes."""

        async def pause(seconds: float) -> None:
            with trio.move_on_after(seconds):
                await closed.wait()

        self._started = {t: at for t, at in self._started.items() if self.accounting.holds(step, t)}
        # A ticket whose gradient has not come back within this long is restarted (its route broke).
        stall_s = self.config.request_timeout_s * self.run.stages.num_stages
        async with trio.open_nursery() as nursery:
            while not closed.is_set():
                now = time.monotonic()
                stalled = [t for t, at in self._started.items() if now - at > stall_s]
                if self._down:
                    down, self._down = self._down, set()
                    stalled += [t for t in self._started if self.router.sent_to.get((step, t)) in down and t not in stalled]
                if self._departed.is_set():
                    self._departed = trio.Event()
                    stalled = list(self._started)
                for t in stalled:
                    log.warning("ticket restarted step=%d ticket=%d reason=its route broke (no gradient back)", step, t)
                    self.progress.event("ticket_redo", step=step, ticket=t, reason="route broke")
                    self._started[t] = now
                    nursery.start_soon(self._run_ticket, step, t)
                if not self.worker.last and not self.router.next_peers:
                    # No replica of stage 1 yet: leased tickets would only expire in our hands.
                    await pause(LEASE_RETRY_S * 4)
                    continue
                room = self.config.max_in_flight - self.accounting.num_in_flight
                if room <= 0:
                    self._slot_free = trio.Event()
                    with trio.move_on_after(1.0):
                        await self._slot_free.wait()
                    continue
                try:
                    reply = await self.link.lease(min(room, self.config.lease_block))
                except ProtocolError as err:
                    log.warning("lease failed step=%d reason=%s", step, err.reason)
                    await pause(1.0)
                    continue
                if reply.step != step:
                    if reply.indices:  # the next step's tickets: not ours to start before step is applied
                        await self._release(reply.step, reply.indices)
                    return
                if not reply.indices:
                    await pause(LEASE_RETRY_S)
                    continue
                for i in reply.indices:
                    # A ticket we hold may come back: our lease ran out, or the step reopened to redo it.
                    # Starting it again is safe: every stage replaces a redone ticket's earlier attempt.
                    self._started[i] = time.monotonic()
                    nursery.start_soon(self._run_ticket, step, i)

    def peer_down(self, peer: str) -> None:
        """A forward send to next-stage ``peer`` just failed (the router's ``on_peer_down``), or the
        connection to it closed: the tickets sent to it will not come back."""
        if self.worker.first:  # only stage 0 can restart a ticket
            self._down.add(peer)
            self._slot_free.set()

    async def _run_ticket(self, step: int, ticket: int) -> None:
        ok = await self.router.start_ticket(step, ticket)
        if not ok:
            self._started.pop(ticket, None)
            await self._release(step, [ticket])
            self._slot_free.set()

    async def _release(self, step: int, indices: list[int]) -> None:
        try:
            await self.link.release(step, indices)
        except ProtocolError as err:
            log.info("release failed step=%d tickets=%s reason=%s", step, indices, err.reason)

    async def complete(self, step: int, ticket: int, route: list[str], loss: float) -> None:
        """The router's ``on_complete``: ``ticket``'s gradient came back, so report it to the coordinator."""
        self._slot_free.set()
        self._started.pop(ticket, None)
        try:
            await self.link.complete(step, ticket, route, loss)
        except ProtocolError as err:
            log.warning("complete refused step=%d ticket=%d reason=%s", step, ticket, err.reason)
            self.progress.event("complete_refused", step=step, ticket=ticket, reason=err.reason)
            if isinstance(err, CoordinatorRefused) and err.code == "bad_route":
                # A replica on its route left or moved: hand the ticket back so it is redone now, not when the lease runs out.
                await self._release(step, [ticket])
