"""A volunteer node's lifecycle: join → sync state → train its stage step by step → leave.

:func:`run_node` opens the libp2p host, joins the coordinator (checking its peer ID and the run hash),
builds only its stage, takes the stage's state from a live replica (or initialises it deterministically
on a fresh run), and trains until the run's last step or until cancelled, then leaves gracefully.
When the coordinator moves the node to another stage it builds that one at the next step boundary, and
trains on (:mod:`protolearn.node.node` holds the joined node and what it does per stage).
"""

from __future__ import annotations

import logging
import os
import sys
import threading

import torch
import trio
from protolearn.node.config import NodeConfig
from protolearn.node.core.watchdog import Overdue
from protolearn.node.errors import StateSyncError
from protolearn.node.final_wait import stay_for_final_model
from protolearn.node.join import join_coordinator
from protolearn.node.link_watch import serve_node_metrics, watch_link
from protolearn.node.node import Node
from protolearn.node.progress import Progress
from protolearn.protocol.identity import Identity
from protolearn.protocol.transport import RelayLimits, TransportConfig, open_host


def warm_torch() -> None:
    """Pay torch's one-time start-up costs: the first optimizer built imports torch._dynamo (about 2 s on
    this machine's CPUs). Done before the join, a node that joins a running swarm reaches its first
    microbatch that much sooner after it, and the step it joins at waits that much less on it."""
    torch.optim.AdamW([torch.zeros(1, requires_grad=True)])


EXIT_HUNG = 1  # the node's exit status when it gives up on its device
# The longest the join waits for warm_torch (a slow disk or a loaded machine: the join goes ahead anyway).
WARM_WAIT_S = 10.0


async def give_up_on_device(node: Node, progress: Progress, late: Overdue) -> None:
    """A compute call never returned (``late``): leave the swarm, so that nothing waits for this node, and
    exit with one line. The thread cannot be killed and trio cannot cancel a wait on it, so the process
    ends here, without the checkpoint at leave (writing it needs the compute thread)."""
    line = late.line(node.stage)
    progress.event("compute_hung", kind=late.kind, running_s=round(late.running_s, 3), median_s=late.median_s,
                   bound_s=round(late.bound_s, 3), applied=node.applied)
    await node.leave(f"compute hung ({late.kind} for {late.running_s:.0f} s)")
    print(f"error: {line}", file=sys.stderr, flush=True)
    logging.shutdown()
    progress.close()
    os._exit(EXIT_HUNG)



async def run_node(config: NodeConfig, identity: Identity, progress: Progress) -> int:
    """Join, train and leave. Returns the number of steps this node's stage has applied."""
    if config.threads:
        torch.set_num_threads(config.threads)
    tconfig = TransportConfig(request_timeout_s=config.request_timeout_s, link=config.link)
    # Whether to relay is decided before the host opens; the node announces it only if it turns out public.
    relay = RelayLimits() if config.relay else None
    # torch's one-time costs are paid before the join, while the host opens: from its join on, the swarm
    # waits for this node (the step it joins at), so the join comes once they are paid, or WARM_WAIT_S at
    # most. Not after the join: on a loaded machine the warm-up then outlasted the membership expiry, and
    # the coordinator dropped the node it had just let in.
    warming = threading.Thread(target=warm_torch, name="warm-torch", daemon=True)
    warming.start()
    async with open_host(identity, [config.listen], tconfig, relay=relay) as host:
        progress.event("start", peer_id=host.peer_id, addrs=host.addrs(), pid=os.getpid())
        await trio.to_thread.run_sync(warming.join, WARM_WAIT_S, abandon_on_cancel=True)
        link, joined, run, reach = await join_coordinator(host, config, on_wait=progress.say)
        progress.event(
            "reachability", verdict=reach.verdict, relay=reach.relay, reason=reach.reason, addrs=reach.addrs,
            observed_port=reach.observed_port, local_port=reach.local_port, rewrites_ports=reach.rewrites_ports,
        )
        progress.say(f"joined {link.peer[-8:]}: run {run.name} ({run.run_hash()[:12]}), stage {joined.stage}, step {joined.step}; peer id {host.peer_id}")
        progress.event("joined", stage=joined.stage, step=joined.step, run_hash=joined.run_hash, reason=joined.reason, members=len(joined.members))
        node = Node(config, host, link, joined, run, progress, reach)
        if joined.step >= node.target_steps:
            progress.say(f"run {run.name} is already at step {joined.step} of {node.target_steps}: nothing left to train")
            progress.event("finished", applied=0, reason="the run had finished before this node joined")
            await node.leave("finished")
            return 0
        try:
            async with trio.open_nursery() as nursery:
                await nursery.start(link.heartbeat_loop, node.make_heartbeat, node.on_heartbeat)
                await nursery.start(node.compute_watch.watch, lambda late: give_up_on_device(node, progress, late))
                await nursery.start(watch_link, link, progress.update)
                if config.metrics_port is not None:
                    await nursery.start(serve_node_metrics, config, link, progress)
                await nursery.start(node.hashes.check_loop, node.heartbeat_s, lambda: node.stage)
                await nursery.start(node.relay_watch.watch)
                await nursery.start(node.persistence.writer)
                stage, open_step = joined.stage, joined.step
                while True:
                    await node.build(stage)
                    async with trio.open_nursery() as stage_nursery:
                        await stage_nursery.start(node.router.serve)
                        try:
                            await node.sync_state(open_step)
                        except StateSyncError:
                            if link.step < node.target_steps:
                                raise
                            # The replicas finished the run and left while this node started up.
                            progress.say(f"run {run.name} finished (step {link.step}) while this node was syncing; nothing left to train")
                            stage_nursery.cancel_scope.cancel()
                            break
                        finished = await node.train()
                        stage_nursery.cancel_scope.cancel()
                    if finished:
                        break
                    stage, open_step = link.stage, link.step
                progress.event("finished", applied=node.applied)
                if host.link is not None:  # what the emulated link carried, on its own clock
                    progress.event("link", **host.link.snapshot())
                await stay_for_final_model(link, node.make_heartbeat, progress.say, every_s=node.heartbeat_s)
                await node.hashes.check(node.stage)
                nursery.cancel_scope.cancel()
        finally:
            await node.at_leave()
            await node.leave("finished" if node.applied >= node.target_steps else "stopped")
        return node.applied
