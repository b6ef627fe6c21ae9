"""A simulated node's life: join, sync its stage's state, train, heartbeat, and leave or crash.

- **Join.** A new node draws its accelerator and link from the scenario (:mod:`.scenario`), sends the real
  coordinator core a ``Join`` (its memory and in-flight limit included, so placement and the fit check
  are the core's), and builds the node's cores for the stage it got.
- **Sync.** It downloads its stage's state (parameters and both AdamW moments) from a live replica, over
  the slower of the donor's up link and its own down link; with no replica left it restores the stage
  from a checkpoint at the frontier (``state_from_checkpoint``), and on a fresh run it starts from the
  init. It then serves: the view shows it to the previous stage's routers, and its train loop starts.
- **Heartbeats** go to the real core at the interval the coordinator gives (the state, the last applied
  step and its stage); a reply that moves it to another stage makes it sync that stage; one that says
  it is no longer a member (it expired) makes it join again.
- **Departures.** A graceful leave sends ``Leave``; a crash of the process closes its connections (the
  coordinator sees it, and so do the stage-0 replicas that had handed it microbatches); a crashed host
  goes silent and is found by expiry. Once the coordinator's view drops a member, the routers stop
  choosing it, and stage-0 replicas, at their next heartbeat, restart what went through it as
  ``node/node.py``'s ``_departed`` does (:class:`PeerDown` for a stage-1 peer, :class:`MemberLeft` for a
  later one).
"""

from __future__ import annotations

import math
from collections.abc import Callable

from protolearn.coordinator.core.members import LIVE
from protolearn.coordinator.errors import Refusal
from protolearn.node.core import closed_step as nc
from protolearn.node.core import events as ev
from protolearn.node.core import leasing as lc
from protolearn.node.core.balancer import Balancer
from protolearn.node.core.routing import RouteCore
from protolearn.protocol import coordination as cm
from protolearn.protocol.pipeline import MAX_STATE_PARTS
from protolearn.sim.coordinator_host import Unavailable
from protolearn.sim.costs import Wire
from protolearn.sim.world import SimNode, World

JOIN_RETRY_S = 2.0
SYNC_RETRY_S = 1.0
# With no replica of its stage to sync from, a joiner restores the stage from a checkpoint after this long.
CHECKPOINT_RESTORE_S = 60.0


class Membership:
    """Arrivals, syncs, heartbeats and departures of every simulated node."""

    def __init__(
        self, world: World, *, rounds_gone: Callable[[SimNode], None], forget: Callable[[SimNode], None],
        train: Callable[[SimNode], None], peer_down: Callable[[SimNode, str, bool], None], member_left: Callable[[SimNode], None],
        resend: Callable[[SimNode, tuple[int, int], list[str]], None],
    ) -> None:
        """``resend(node, key, route)``: send an activation held by ``node`` on to another next-stage replica."""
        self.w = world
        self.rounds_gone = rounds_gone
        self.forget = forget
        self.train = train
        self.peer_down = peer_down
        self.member_left = member_left
        self.resend = resend
        # The departure repair (issue 26): the replica before a departed one sends on what it had handed to it;
        # without it (the protocol before), stage 0 restarts every ticket in flight on any later departure.
        self.repair = world.scenario.sim.repair_departures
        sc = world.scenario
        self._links = sc.hardware.link_specs()
        self._link_weights = [wt for _, wt in self._links]
        self._count = 0
        # Dead nodes the coordinator may still hold live: checked after each housekeeping.
        self._pending_drop: set[str] = set()
        m = world.scenario.run.model
        # The FLOPs of one layer-token, forward and backward: what a node's claimed throughput is counted in.
        self._layer_flops = 6.0 * (4 * m.d_model * m.d_model + 3 * m.d_model * m.d_ff)

    # -- arrival -------------------------------------------------------------------------------------
    def arrive(self) -> SimNode:
        w, hw = self.w, self.w.scenario.hardware
        i = self._count
        self._count += 1
        tflops = hw.tflops * math.exp(hw.tflops_sigma * w.rng.gauss(0.0, 1.0)) if hw.tflops_sigma else hw.tflops
        spec = w.rng.choices([s for s, _ in self._links], weights=self._link_weights)[0]
        node = SimNode(f"n{i:06d}", i, tflops, Wire(spec.up_bytes_per_s, spec.down_bytes_per_s, spec.delay_s), joined_at=w.now)
        w.nodes[node.peer] = node
        w.metrics.arrivals += 1
        self._join(node)
        return node

    def _join(self, node: SimNode) -> None:
        w, sc = self.w, self.w.scenario
        if not node.alive:
            return
        msg = cm.Join(addrs=[f"/ip4/10.{node.index >> 16 & 255}.{node.index >> 8 & 255}.{node.index & 255}/tcp/4001"],
                      device="cuda", memory_gb=sc.hardware.memory_gb, max_in_flight=sc.node.max_in_flight,
                      throughput=node.tflops * 1e12 / self._layer_flops, name=node.peer)
        try:
            reply = w.host.request(node.peer, msg)
        except Unavailable:
            w.engine.after(JOIN_RETRY_S, self._join, node)
            return
        except Refusal as err:
            w.metrics.events[f"join_refused_{err.code}"] += 1
            self._die(node, closed=True, why="refused")
            return
        assert isinstance(reply, cm.JoinReply)
        node.member = True
        node.view_version = reply.view_version
        w.host.connection_changed(node.peer, True)
        self._take_stage(node, reply.stage)
        w.engine.after(w.rng.uniform(0.0, reply.heartbeat_interval_s), self._beat, node, node.index)

    def _take_stage(self, node: SimNode, stage: int) -> None:
        sc = self.w.scenario
        node.stage = stage
        node.core = nc.NodeCore(node.peer, stage, nc.CoreConfig(
            sc.run.batch.microbatches_per_step, sc.node.max_in_flight, sc.node.max_deferred, sc.node.averaging_timeout_s))
        node.routes = RouteCore(balancer=Balancer(order=node.peer))
        node.lease = lc.LeaseCore(max_in_flight=sc.node.max_in_flight, lease_block=sc.node.lease_block,
                                  stall_s=sc.node.request_timeout_s * self.w.num_stages, last_stage=self.w.num_stages == 1) if stage == 0 else None
        self._sync(node, node.epoch)

    # -- state sync ----------------------------------------------------------------------------------
    def _sync(self, node: SimNode, epoch: int, waited: float = 0.0) -> None:
        w = self.w
        if not node.alive or node.silent or epoch != node.epoch:
            return
        if node.syncing_since is None:
            node.syncing_since = w.now
        donors = [p for p in w.serving[node.stage] if p != node.peer]
        ledger = w.host.core.ledger
        if w.host.up and ledger.step == 0:
            self._synced(node, epoch, 0)  # a fresh run: the deterministic init (node/persistence.py)
            return
        if not donors:
            if waited >= CHECKPOINT_RESTORE_S and w.host.up:
                w.metrics.events["state_from_checkpoint"] += 1
                self._synced(node, epoch, ledger.frontier)
                return
            w.engine.after(SYNC_RETRY_S, self._sync, node, epoch, waited + SYNC_RETRY_S)
            return
        # A share of the state from each of up to MAX_STATE_PARTS donors at once (node/state_sync.py).
        chosen = [w.nodes[p] for p in (w.rng.sample(donors, MAX_STATE_PARTS) if len(donors) > MAX_STATE_PARTS else donors)]
        nbytes = w.costs.stages[node.stage].state_bytes
        share = nbytes / len(chosen)
        secs = max(nbytes / node.wire.down_rate, max(share / d.wire.up_rate for d in chosen))
        secs += 2.0 * (max(d.wire.delay_s for d in chosen) + node.wire.delay_s)
        w.engine.after(secs, self._download_done, node, epoch, chosen)

    def _download_done(self, node: SimNode, epoch: int, donors: list[SimNode]) -> None:
        w = self.w
        if not node.alive or node.silent or epoch != node.epoch:
            return
        kept = [d for d in donors if d.serving and d.stage == node.stage and d.core is not None]
        lost = len(donors) - len(kept)
        if lost:
            w.metrics.events["sync_donor_lost"] += 1
            # The shares already received are kept: each lost one is fetched again from a replica that sent none,
            # at the step the kept shares are at (node/state_sync.py). With none such, the download starts over.
            applied = {d.core.applied for d in kept if d.core is not None}
            others = [w.nodes[p] for p in w.serving[node.stage] if p != node.peer]
            others.sort(key=lambda d: d in kept)  # a replica that sent no share first, then the kept donors
            spares = [d for d in others if d.core is not None and len(applied) == 1 and d.core.applied in applied][:lost]
            if len(applied) != 1 or len(spares) < lost:
                w.metrics.events["sync_restarted"] += 1
                self._sync(node, epoch)
                return
            share = w.costs.stages[node.stage].state_bytes / len(donors)
            secs = max(share * lost / node.wire.down_rate, max(share / d.wire.up_rate for d in spares))
            secs += 2.0 * (max(d.wire.delay_s for d in spares) + node.wire.delay_s)
            w.engine.after(secs, self._download_done, node, epoch, kept + spares)
            return
        self._synced(node, epoch, max(d.core.applied for d in donors if d.core is not None))

    def _synced(self, node: SimNode, epoch: int, applied: int) -> None:
        w = self.w
        assert node.core is not None
        if node.syncing_since is not None:
            w.metrics.sync_s += w.now - node.syncing_since
            node.syncing_since = None
        node.core = nc.NodeCore(node.peer, node.stage, node.core.config, applied=applied)
        node.core.handle(ev.Synced(applied), w.now)
        node.routes = RouteCore(balancer=Balancer(order=node.peer))
        if node.peer not in w.serving[node.stage]:
            w.serving[node.stage].append(node.peer)
        self._heartbeat(node)
        self.train(node)

    # -- heartbeats --------------------------------------------------------------------------------------
    def _beat(self, node: SimNode, index: int) -> None:
        if not node.alive or node.silent:
            return
        self._heartbeat(node)
        self.w.engine.after(self.w.host.heartbeat_interval_s, self._beat, node, index)

    def _heartbeat(self, node: SimNode) -> None:
        w = self.w
        core = node.core
        state = core.state if core is not None else "syncing"
        hb = cm.Heartbeat(state=state, step=(core.applied - 1) if core is not None else -1, stage=node.stage, view_delta=True,
                          view_version=node.view_version)
        try:
            reply = w.host.request(node.peer, hb)
        except Unavailable:
            return
        except Refusal as err:
            if err.code == "banned":
                w.metrics.events["banned"] += 1
                self.depart(node, "leave")
            elif err.code == "not_member":
                w.metrics.events["rejoined"] += 1
                self._rejoin(node)
            return
        assert isinstance(reply, cm.HeartbeatReply)
        node.view_version = reply.view_version
        if reply.stage != node.stage and reply.stage >= 0:
            w.metrics.events["moved"] += 1
            self._drop_work(node, f"moved to stage {reply.stage}")
            self._take_stage(node, reply.stage)

    def _rejoin(self, node: SimNode) -> None:
        """The coordinator forgot it (it expired): it joins again, maybe for another stage."""
        self._drop_work(node, "rejoined")
        node.member = False
        try:
            reply = self.w.host.request(node.peer, cm.Join(addrs=["/ip4/10.0.0.1/tcp/4001"], device="cuda", name=node.peer))
        except (Refusal, Unavailable):
            return
        assert isinstance(reply, cm.JoinReply)
        node.member = True
        node.view_version = reply.view_version
        self._take_stage(node, reply.stage)

    # -- resyncs and departures ----------------------------------------------------------------------
    def resync(self, node: SimNode, reason: str) -> None:
        """The node core gave up on the step: take a live replica's state again."""
        self.w.metrics.events["resync"] += 1
        self._drop_work(node, reason)
        assert node.core is not None
        node.core.start_syncing()
        self._sync(node, node.epoch)

    def _drop_work(self, node: SimNode, reason: str) -> None:
        w = self.w
        node.epoch += 1
        for secs in node.work.values():
            w.metrics.wasted_compute_s += secs
        node.work.clear()
        node.waiting, node.finishing = None, False
        node.gpu_free = w.now
        if node.peer in w.serving[node.stage]:
            w.serving[node.stage].remove(node.peer)
        self.rounds_gone(node)
        self.forget(node)

    def depart(self, node: SimNode, how: str) -> None:
        """``how``: ``leave`` (graceful), ``crash`` (the process dies, its connections close) or ``silent``."""
        w = self.w
        if not node.alive:
            return
        w.metrics.departures[how] += 1
        if how == "leave":
            try:
                w.host.request(node.peer, cm.Leave(reason="simulated leave"))
            except (Refusal, Unavailable):
                pass
        else:
            w.metrics.crashes.append((w.now, node.peer))
            w.metrics.last_crash[node.peer] = w.now
        self._die(node, closed=how != "silent", why=how)

    def _die(self, node: SimNode, *, closed: bool, why: str) -> None:
        w = self.w
        node.alive = False
        node.silent = not closed
        node.left_at = w.now
        w.metrics.node_s += w.now - node.joined_at
        if node.syncing_since is not None:
            w.metrics.sync_s += w.now - node.syncing_since
            node.syncing_since = None
        node.epoch += 1
        self.rounds_gone(node)
        self.forget(node)
        if not node.member:
            return
        if closed:
            w.host.connection_changed(node.peer, False)
            if node.stage == 1:  # its connections to the stage-0 replicas that handed it microbatches close
                for p in list(w.serving[0]):
                    n0 = w.nodes[p]
                    if n0.lease is not None and n0.routes.handed_to(n0.lease.step, node.peer):
                        self.peer_down(n0, node.peer, False)
        self._pending_drop.add(node.peer)
        self.check_dropped()

    def check_dropped(self) -> None:
        """After the coordinator's housekeeping (or a leave): who it no longer holds live leaves the view."""
        members = self.w.host.core.registry.members
        if not self.w.host.up:
            return
        # In peer order, not the set's (a string set's order follows PYTHONHASHSEED, and each drop draws from the rng).
        for peer in sorted(p for p in self._pending_drop if (m := members.get(p)) is None or m.status != LIVE):
            self._pending_drop.discard(peer)
            self._view_dropped(self.w.nodes[peer])

    def _view_dropped(self, node: SimNode) -> None:
        w = self.w
        node.member = False
        if node.peer in w.serving[node.stage]:
            w.serving[node.stage].remove(node.peer)
        crashed_at = w.metrics.last_crash.get(node.peer)
        if crashed_at is not None:
            w.metrics.detections.append(w.now - crashed_at)
        interval = w.host.heartbeat_interval_s
        # Each replica sees the departure in its next heartbeat's view delta (node/node.py's _departed).
        if node.stage == 1 or not self.repair:
            for p in list(w.serving[0]):
                n0 = w.nodes[p]
                w.engine.after(w.rng.uniform(0.0, interval), self._departure_seen, n0, node.peer, node.stage, n0.epoch)
        if node.stage >= 2:
            for p in list(w.serving[node.stage - 1]):
                up = w.nodes[p]
                w.engine.after(w.rng.uniform(0.0, interval), self._upstream_saw, up, node.peer, up.epoch)

    def _departure_seen(self, n0: SimNode, peer: str, stage: int, epoch: int) -> None:
        if not n0.alive or n0.epoch != epoch or n0.lease is None:
            return
        if stage == 1:
            self.peer_down(n0, peer, True)
        elif stage > 1:
            self.member_left(n0)

    def _upstream_saw(self, up: SimNode, peer: str, epoch: int) -> None:
        """A replica of the stage before the departed one forgets it; with the repair, it sends on again the
        activations it had handed to it (their gradient will never come back)."""
        if not up.alive or up.silent or up.epoch != epoch or up.core is None:
            return
        lost = up.routes.forget(peer)
        if not self.repair:
            return
        for key in lost:
            route = up.routes.resend(key, up.core.applied)
            if route is not None and up.core.accounting.holds(*key):
                self.resend(up, key, route)
