"""Finishing one closed step on a replica: average, wait for the commit, apply (I1, I2).

:func:`finish_step` takes the step's frozen accounting (stage → peer → tickets). A participant sums
exactly its accounted tickets' gradients and runs the stage's collective; a replica the accounting left
out fetches the finished round's result from a participant. Then every replica waits for the commit
barrier (every stage averaged the step in full) and applies the identical optimizer step.

Whenever a ticket's gradients would be missing from the average, the step is reopened instead and
``finish_step`` returns the revision to wait for: a replica died during averaging (the collective left
it out), this replica lost its gradients (it restarted), the round failed outright, or every
participant of the stage is gone. Only when the coordinator refuses to reopen (it already committed)
does a replica resync from a live one.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING

import trio
from protolearn.node.accounting import contribution
from protolearn.node.averaging import AveragingError, ResultGone, round_id
from protolearn.node.errors import StateSyncError
from protolearn.protocol import coordination as cm
from protolearn.protocol.errors import ProtocolError

if TYPE_CHECKING:
    from protolearn.node.node import Node

log = logging.getLogger("protolearn.node")
# Long-poll length of one commit wait (the coordinator caps it at 30 s).
COMMIT_POLL_S = 10.0
# A replica the accounting left out asks the participants for the step's result this long before it
# checks whether the step reopened, or whether every participant is gone and the step must be redone.
FETCH_TRY_S = 3.0


async def finish_step(node: Node, step: int, info: cm.StepInfo) -> int:
    """Average step ``step`` as its frozen accounting says and apply it; returns 0.

    Returns the revision to wait for instead when the step was reopened to redo tickets (a
    replica's contribution is out of the average), so that the step covers exactly B tickets (I1).
    """
    node.state = "averaging"
    node.progress.update(state="averaging")
    t0 = time.monotonic()
    account = {pt.peer_id: list(pt.tickets) for sa in info.accounting if sa.stage == node.stage for pt in sa.peers}
    mine = account.get(node.host.peer_id, [])
    if not account:
        raise StateSyncError(f"step {step} closed without an accounting for stage {node.stage}; rejoin to resync")
    rid = round_id(step, info.revision)
    if node.host.peer_id in account:
        held = await trio.to_thread.run_sync(node.worker.held_tickets, step, limiter=node.compute)
        summed, missing, dropped = contribution(mine, held)
        if dropped:
            # Completion refused or route broken after this stage: another attempt counts these.
            node.progress.event("tickets_not_counted", step=step, tickets=dropped)
        if missing:
            # E.g. this peer was restarted after the step closed: its earlier life computed these tickets.
            if await node._reported_hashes(step):
                # A replica already applied the step (it got the result from the earlier life): take its state.
                log.warning("step %d: accounted tickets %s have no gradients here; a replica applied the step, resyncing", step, missing)
                await node.resync(step)
                return 0
            log.error("step %d: accounted tickets %s have no gradients here; asking to redo them", step, missing)
            if await _redo(node, step, info.revision, missing, "replica lost the tickets' gradients"):
                return info.revision + 1
        flat = await trio.to_thread.run_sync(node.worker.flat_grads, step, summed, limiter=node.compute)
        weights = {p: float(len(t)) for p, t in account.items()}
        try:
            done = await node.averager.run_round_detailed(rid, weights, flat)
        except AveragingError as err:
            # No agreed result (e.g. two replicas died in one round). Nothing was applied and the
            # step cannot commit without this stage, so the whole step is recomputed.
            node.averager.next_round = round_id(step, info.revision + 1)
            node.progress.event("averaging_failed", step=step, reason=str(err))
            tickets = sorted({t for ts in account.values() for t in ts})
            if await _redo(node, step, info.revision, tickets, f"stage {node.stage} averaging failed: {err}"):
                return info.revision + 1
            raise
        if done.excluded:
            lost = sorted({t for p in done.excluded for t in account.get(p, [])})
            node.averager.next_round = round_id(step, info.revision + 1)
            node.progress.event("replica_out", step=step, excluded=done.excluded, tickets=lost)
            if lost and await _redo(node, step, info.revision, lost, f"replicas {done.excluded} of stage {node.stage} died during averaging"):
                return info.revision + 1
            if lost:
                log.error("step %d applied without tickets %s of dead replicas %s: the coordinator refused to redo them", step, lost, done.excluded)
                node.progress.event("tickets_lost", step=step, tickets=lost, excluded=done.excluded)
        result = done.result
        # The tickets whose gradients are in the applied average (I1: all B of them).
        counted = sorted(t for p, ts in account.items() if p not in done.excluded for t in ts)
    else:
        result, counted = None, None
        deadline = trio.current_time() + node.config.averaging_timeout_s
        while result is None:
            with trio.move_on_after(FETCH_TRY_S):
                try:
                    result = await node.averager.fetch_result(rid, sorted(account))
                except ResultGone as err:
                    log.warning("%s", err)
                    break  # the participants moved on: catch up below
                except AveragingError as err:
                    log.warning("%s", err)
            if result is not None:
                break
            if await _reopened(node, step, info.revision):
                return info.revision + 1  # a participant died and its tickets are being redone: average again
            # The coordinator grants this only once every participant of the stage is gone (dead or
            # left): then nobody holds the stage's gradients, and the whole step is redone here.
            tickets = sorted({t for ts in account.values() for t in ts})
            if await _redo(node, step, info.revision, tickets, f"all replicas of stage {node.stage} that averaged the step are gone", expected=True):
                return info.revision + 1
            if trio.current_time() > deadline:
                break
        if result is None:
            # The participants moved on (they keep only recent results): catch up from a live replica.
            await node.resync(step)
            return 0
    # Until every stage has averaged the step, it may still reopen: then its next round is revision + 1.
    node.averager.next_round = round_id(step, info.revision + 1)
    node.progress.event("averaged", step=step, revision=info.revision, seconds=round(time.monotonic() - t0, 4))
    if not await node.link.wait_committed(step, info.revision, report=node.host.peer_id in account, poll_s=COMMIT_POLL_S):
        node.progress.event("reopened", step=step, revision=info.revision)
        return info.revision + 1
    node.averager.next_round = round_id(step + 1)
    t_avg = time.monotonic() - t0
    param_hash, norm = await trio.to_thread.run_sync(node.worker.apply, step, result, limiter=node.compute)
    node._hash_by_step[step] = param_hash
    await node.persistence.after_step(node)
    if node.worker.last and info.loss is not None:
        node.last_loss = info.loss
    await trio.to_thread.run_sync(node.worker.forget, step, limiter=node.compute)
    node.router.release(node.accounting.applied_step(step))
    node.state = "training"
    elapsed = max(1e-9, time.monotonic() - node.router.stats.started)
    tps = node.router.stats.tokens / elapsed
    node.progress.update(state="training", step=step + 1, loss=info.loss, tokens_per_s=tps, in_flight=node.accounting.num_in_flight)
    node.progress.event(
        "step", step=step, loss=info.loss, hash=param_hash, tickets=mine, replicas=sorted(account), counted=counted,
        grad_norm=norm, averaging_s=round(t_avg, 4), tokens_per_s=round(tps, 1), revision=info.revision,
    )
    return 0


async def _reopened(node: Node, step: int, revision: int) -> bool:
    """Whether ``step`` was reopened after closing at ``revision`` (it will close again)."""
    try:
        info = await node.link.wait_step(step, min_revision=revision + 1, timeout_s=0.5)
    except ProtocolError:
        return False
    return info.closed or info.open_step == step


async def _redo(node: Node, step: int, revision: int, tickets: list[int], reason: str, *, expected: bool = False) -> bool:
    """Ask the coordinator to redo ``tickets`` of ``step``; True if the step will close again.

    ``expected``: a refusal is the normal answer (the participants are alive, just slow), not worth a warning.
    """
    try:
        reply = await node.link.redo(step, tickets, reason)
    except ProtocolError as err:
        log.log(logging.INFO if expected else logging.WARNING, "redo refused step=%d tickets=%s reason=%s", step, tickets, err.reason)
        # Another replica of the stage may have reopened the step first: then it closes again anyway.
        return await _reopened(node, step, revision)
    node.progress.event("redo", step=step, tickets=tickets, reason=reason, reopened=reply.reopened)
    return True
