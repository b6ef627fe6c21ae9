"""Microbatches through the simulated pipeline: compute on each node's accelerator, hops over its link.

What :mod:`protolearn.node.router` does, with the clock and the bytes modelled and every decision left to
the node's real cores:

- **Admission** is the receiving replica's :class:`~protolearn.node.core.accounting.Accounting`
  (process, hold for the next step, or refuse with a code), and a redone ticket replaces its attempt.
- **Routing** is the sender's :class:`~protolearn.node.core.routing.RouteCore` and its balancer: the
  next-stage replica with the least expected finish among those in view, retried on other peers as the
  router does (at most ``MAX_FORWARD_TRIES`` within the send deadline); refusals, failures and accepted
  hand-overs (service time, reported queue) are fed back to it, and a returning gradient is checked
  against the attempt held (:meth:`RouteCore.admit_gradient`). With ``[sim] route_candidates = k`` a
  decision considers a seeded sample of k of the next stage's replicas instead of all of them: a model (power of k
  choices), not the node's rule, which the built-in scenario uses (k = 16) because scoring every replica of a
  10,000-node swarm's stages made the balancer most of the run's time. tests/integration/test_simulate.py holds
  the model to the full choice on a small swarm (tokens/s within 5%, step time within 10%, no churn).
- **Time.** A node's accelerator runs one job at a time, first come first served: a forward costs the
  stage's forward FLOPs over the node's TFLOPS, a backward twice that, the last stage both at once. A hop
  costs the boundary tensor's bytes over the sender's up link and the receiver's down link
  (:func:`~.costs.transfer`). A dead receiver refuses the dial one round trip later; a silent one (a
  crashed host) lets the send run into its deadline.

Stage 0's ticket events (:mod:`.stage0`) go out through ``on_stage0``; ticket completions reach the
coordinator from there.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from math import ceil, log
from random import Random
from typing import Any, TypeVar

from protolearn.node.core import leasing as lc
from protolearn.protocol.acks import ack_statement
from protolearn.sim.costs import round_trip_s, transfer
from protolearn.sim.signatures import sim_sign
from protolearn.sim.world import SimNode, World

# node/router.py
MAX_FORWARD_TRIES = 4
RETRY_PAUSE_S = 0.2
# A send to a silent host fails after the transport's connect or chunk timeout (protocol/transport/config.py).
SILENT_SEND_S = 10.0
LOSS = 3.0  # every microbatch's loss (a plausible value: the coordinator checks the range)

T = TypeVar("T")


def sample(rng: Random, population: Sequence[T], k: int) -> list[T]:
    """``rng.sample(population, k)``, the same draws from the same stream, at half the cost where the population
    is large (CPython's own loop for that case with its per-draw call inlined: a route's candidates are drawn
    per microbatch and stage, millions of times at 10,000 nodes). tests/unit/test_sim_sample.py compares them."""
    n = len(population)
    if n <= 21 + (4 ** ceil(log(k * 3, 4)) if k > 5 else 0):  # CPython draws from a copied list here
        return rng.sample(population, k)
    getrandbits, bits = rng.getrandbits, n.bit_length()
    selected: set[int] = set()
    out = []
    for _ in range(k):
        j = getrandbits(bits)
        while j >= n or j in selected:
            j = getrandbits(bits)
        selected.add(j)
        out.append(population[j])
    return out


class Pipeline:
    """Forward and backward hops of every microbatch attempt in the simulated swarm."""

    def __init__(self, world: World, on_stage0: Callable[[SimNode, Any], None], on_peer_down: Callable[[SimNode, str], None]) -> None:
        """``on_stage0(node, event)``: a lease-core event of a stage-0 node (Handed, NotStarted, Completed);
        ``on_peer_down(node, peer)``: a stage-0 node's forward send to ``peer`` failed (node/driver.py)."""
        self.w = world
        self.on_stage0 = on_stage0
        self.on_peer_down = on_peer_down
        run = world.costs
        self.fwd_s = [c.fwd_flops / 1e12 for c in run.stages]  # divided by a node's TFLOPS
        self.bwd_s = [c.bwd_flops / 1e12 for c in run.stages]
        self.fwd_bytes = [c.fwd_bytes for c in run.stages]
        self.bwd_bytes = [c.bwd_bytes for c in run.stages]
        self.last = len(run.stages) - 1
        self.send_timeout_s = world.scenario.node.request_timeout_s
        # A forward refused "busy" keeps waiting for a free replica up to stage 0's stall bound.
        self.busy_cap_s = world.scenario.node.request_timeout_s * len(run.stages)
        self.candidates = world.scenario.sim.route_candidates
        self.run_hash = world.host.run.run_hash

    # -- the accelerator ---------------------------------------------------------------------------
    def compute(self, node: SimNode, seconds: float, fn: Callable[..., None], *args: Any) -> None:
        """Queue ``seconds`` of work on ``node``'s accelerator; ``fn(*args)`` runs when it is done."""
        now = self.w.engine.now
        start = node.gpu_free if node.gpu_free > now else now
        node.gpu_free = start + seconds
        node.queued += 1
        self.w.engine.at(node.gpu_free, self._done, node, node.epoch, fn, args)

    def _done(self, node: SimNode, epoch: int, fn: Callable[..., None], args: tuple[Any, ...]) -> None:
        node.queued -= 1
        if node.alive and not node.silent and epoch == node.epoch:
            fn(*args)

    def _charge(self, node: SimNode, key: tuple[int, int], route: list[str], seconds: float) -> None:
        """``seconds`` of compute on the attempt of ``key`` along ``route``: kept if it is still the one held."""
        if node.routes.tickets.route(key) == route:
            node.work[key] = node.work.get(key, 0.0) + seconds
        else:
            self.w.metrics.wasted_compute_s += seconds

    def _new_attempt(self, node: SimNode, key: tuple[int, int], route: list[str]) -> None:
        old = node.work.pop(key, None)
        if old is not None:
            self.w.metrics.wasted_compute_s += old  # a redo replaces the earlier attempt (I1)
        node.routes.tickets.hold(key, route)

    # -- stage 0 -------------------------------------------------------------------------------------
    def start_ticket(self, node: SimNode, step: int, ticket: int) -> bool:
        """Run ticket (step, ticket) through stage 0 and send it on (router.start_ticket); False: not started."""
        assert node.core is not None
        if node.core.accounting.admit_forward(step, ticket).action != "process":
            return False
        key, route = (step, ticket), [node.peer]
        self._new_attempt(node, key, route)
        nonce = node.nonces.get(key, b"")
        if self.last == 0:
            secs = (self.fwd_s[0] + self.bwd_s[0]) / node.tflops
            self.compute(node, secs, self._one_stage_done, node, key, route, nonce, secs)
            return True
        secs = self.fwd_s[0] / node.tflops
        self.compute(node, secs, self._forward_done, node, key, route, nonce, secs)
        return True

    def _one_stage_done(self, node: SimNode, key: tuple[int, int], route: list[str], nonce: bytes, secs: float) -> None:
        assert node.core is not None
        self._charge(node, key, route, secs)
        node.core.accounting.backward_done(*key)
        self.on_stage0(node, lc.Completed(key[0], key[1], route, LOSS, None, nonce))

    # -- forward -------------------------------------------------------------------------------------
    def _forward_done(self, node: SimNode, key: tuple[int, int], route: list[str], nonce: bytes, secs: float) -> None:
        self._charge(node, key, route, secs)
        now = self.w.engine.now
        self._send_forward(node, key, route, nonce, set(), now + self.send_timeout_s, now + self.busy_cap_s)

    def _send_forward(self, node: SimNode, key: tuple[int, int], route: list[str], nonce: bytes, tried: set[str], deadline: float,
                      hard: float) -> None:
        """router._send_forward: choose a next-stage peer and offer it the activation, trying at most
        MAX_FORWARD_TRIES peers (a busy one is tried again) until the send's deadline."""
        w = self.w
        now = w.engine.now
        if not node.alive or node.silent:
            return
        if now >= deadline or len(tried) >= MAX_FORWARD_TRIES:
            self._drop(node, key)
            return
        routes = node.routes
        peers = w.serving[node.stage + 1]
        if self.candidates and len(peers) > self.candidates:
            routes.next_peers = sample(w.rng, peers, self.candidates)
        else:
            routes.next_peers = peers
        choice = routes.choose(tried, now, key[0])
        if choice.peer is None:
            w.engine.after(RETRY_PAUSE_S, self._send_forward, node, key, route, nonce, tried, deadline, hard)
            return
        peer = choice.peer
        tried.add(peer)
        routes.tickets.sent(key, "fwd", peer, None)
        routes.sending(peer)
        target = w.nodes[peer]
        if target.silent:  # a crashed host: the dial or the first write times out (transport connect/chunk timeouts)
            w.engine.at(min(deadline, now + SILENT_SEND_S), self._send_failed, node, key, route, nonce, tried, deadline, hard, peer)
            return
        if not target.alive:  # a dead process: the dial is refused
            w.engine.after(round_trip_s(node.wire, target.wire), self._send_failed, node, key, route, nonce, tried, deadline, hard, peer)
            return
        nbytes = self.fwd_bytes[node.stage]
        w.metrics.fwd_bytes[node.stage] += nbytes
        arrive = transfer(node.wire, target.wire, nbytes, now)
        w.engine.at(arrive, self._activation_arrives, node, target, key, route, nonce, tried, deadline, hard, now, node.epoch)

    def _send_failed(self, node: SimNode, key: tuple[int, int], route: list[str], nonce: bytes, tried: set[str], deadline: float,
                     hard: float, peer: str) -> None:
        if not node.alive or node.silent:
            return
        node.routes.failed(peer, self.w.engine.now)
        if node.stage == 0:
            self.on_peer_down(node, peer)
        pause = RETRY_PAUSE_S if tried >= set(node.routes.next_peers) else 0.0
        self.w.engine.after(pause, self._send_forward, node, key, route, nonce, tried, deadline, hard)

    def _activation_arrives(self, node: SimNode, target: SimNode, key: tuple[int, int], route: list[str], nonce: bytes, tried: set[str],
                            deadline: float, hard: float, sent_at: float, epoch: int) -> None:
        w = self.w
        if not node.alive or node.silent or epoch != node.epoch:
            return
        now = w.engine.now
        if not target.alive or target.silent or target.core is None or target.stage != node.stage + 1:
            self._send_failed(node, key, route, nonce, tried, deadline, hard, target.peer)
            return
        step, ticket = key
        d = target.core.accounting.admit_forward(step, ticket, (step, ticket, route, nonce))
        back = target.wire.delay_s + node.wire.delay_s
        if d.action == "refuse":
            node.routes.refused(target.peer, d.code, now + back)
            if d.code == "busy":
                tried.discard(target.peer)
                # Backpressure, not a failure: the wait for a free replica restarts (router.BUSY_PATIENCE).
                deadline = max(deadline, min(now + self.send_timeout_s, hard))
            w.engine.after(back + (RETRY_PAUSE_S if d.code == "busy" else 0.0), self._send_forward, node, key, route, nonce, tried,
                           deadline, hard)
            return
        node.routes.accepted(key, target.peer, service_s=now + back - sent_at, queue_len=float(target.queued), now=now + back)
        if node.stage == 0:
            self.on_stage0(node, lc.Handed(step, ticket))
        if d.action == "process":
            self.forward_received(target, step, ticket, route, nonce)

    def forward_received(self, node: SimNode, step: int, ticket: int, route: list[str], nonce: bytes) -> None:
        """router._forward_received: this replica runs the attempt that came along ``route``."""
        key = (step, ticket)
        here = route + [node.peer]
        self._new_attempt(node, key, here)
        node.nonces[key] = nonce
        if node.stage == self.last:
            secs = (self.fwd_s[node.stage] + self.bwd_s[node.stage]) / node.tflops
            self.compute(node, secs, self._last_done, node, key, here, nonce, secs)
            return
        secs = self.fwd_s[node.stage] / node.tflops
        self.compute(node, secs, self._forward_done, node, key, here, nonce, secs)

    def _last_done(self, node: SimNode, key: tuple[int, int], route: list[str], nonce: bytes, secs: float) -> None:
        assert node.core is not None
        self._charge(node, key, route, secs)
        node.core.accounting.backward_done(*key)
        ack = sim_sign(node.peer, ack_statement(self.run_hash, key[0], key[1], route, LOSS, nonce))
        self._send_backward(node, key, route, ack, nonce, self.w.engine.now + self.send_timeout_s)

    def resend(self, node: SimNode, key: tuple[int, int], route: list[str]) -> None:
        """The next-stage replica that took ``key``'s activation left: send the activation held here on to
        another one (router.resend), so only the work past this replica is redone."""
        self.w.metrics.events["activation_resent"] += 1
        now = self.w.engine.now
        self._send_forward(node, key, route, node.nonces.get(key, b""), set(), now + self.send_timeout_s, now + self.busy_cap_s)

    def _drop(self, node: SimNode, key: tuple[int, int]) -> None:
        """No next-stage peer took it: the microbatch is dropped (a stage-0 ticket is handed back)."""
        assert node.core is not None
        self.w.metrics.events["microbatch_dropped"] += 1
        old = node.work.pop(key, None)
        if old is not None:
            self.w.metrics.wasted_compute_s += old
        node.core.accounting.dropped(*key)
        if node.stage == 0:
            self.on_stage0(node, lc.NotStarted(*key))

    # -- backward ------------------------------------------------------------------------------------
    def _send_backward(self, node: SimNode, key: tuple[int, int], route: list[str], ack: bytes, nonce: bytes, deadline: float) -> None:
        w = self.w
        if not node.alive or node.silent:
            return
        prev = w.nodes[route[node.stage - 1]]
        now = w.engine.now
        if prev.silent or not prev.alive:
            # Only that peer holds the graph: retry until the deadline, then the gradient is lost.
            if now + RETRY_PAUSE_S < deadline and not prev.silent:
                w.engine.after(RETRY_PAUSE_S, self._send_backward, node, key, route, ack, nonce, deadline)
            else:
                w.metrics.events["gradient_lost"] += 1
            return
        nbytes = self.bwd_bytes[node.stage]
        w.metrics.bwd_bytes[node.stage - 1] += nbytes
        arrive = transfer(node.wire, prev.wire, nbytes, now)
        w.engine.at(arrive, self._gradient_arrives, prev, key, route, ack, nonce, prev.epoch)

    def _gradient_arrives(self, node: SimNode, key: tuple[int, int], route: list[str], ack: bytes, nonce: bytes, epoch: int) -> None:
        if not node.alive or node.silent or epoch != node.epoch or node.core is None:
            return
        here = route[: node.stage + 1]
        admission = node.core.accounting.admit_backward(*key)
        decision = node.routes.admit_gradient(key, here, admission)
        if decision.action != "process":
            if admission.action == "process":
                node.core.accounting.gradient_moot(*key)
            return
        node.routes.returned(key, self.w.engine.now)
        secs = self.bwd_s[node.stage] / node.tflops
        self.compute(node, secs, self._backward_done, node, key, route, here, ack, nonce, secs)

    def _backward_done(self, node: SimNode, key: tuple[int, int], route: list[str], here: list[str], ack: bytes, nonce: bytes,
                       secs: float) -> None:
        assert node.core is not None
        if node.routes.tickets.route(key) != here:  # a redo raced this gradient: its graph went to the new attempt
            self.w.metrics.wasted_compute_s += secs
            node.core.accounting.gradient_moot(*key)
            return
        self._charge(node, key, here, secs)
        node.core.accounting.backward_done(*key)
        if node.stage == 0:
            self.on_stage0(node, lc.Completed(key[0], key[1], list(route), LOSS, ack, nonce))
            return
        self._send_backward(node, key, route, ack, nonce, self.w.engine.now + self.send_timeout_s)
