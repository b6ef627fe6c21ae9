"""The state a simulated swarm shares: the clock, the coordinator, the nodes and who serves each stage.

:class:`World` holds facts only; the actors that change them (:mod:`.pipeline`, :mod:`.stage0`,
:mod:`.finishing`, :mod:`.rounds`, :mod:`.membership`) each take it at construction. A :class:`SimNode`
is one volunteer: its hardware, its link, the real sans-IO cores the node runs (the
:class:`~protolearn.node.core.closed_step.NodeCore` with its accounting, a
:class:`~protolearn.node.core.routing.RouteCore` with its balancer, and on stage 0 a
:class:`~protolearn.node.core.leasing.LeaseCore`), and what the simulation measures of it.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

from protolearn.node.core.closed_step import NodeCore
from protolearn.node.core.leasing import LeaseCore
from protolearn.node.core.routing import RouteCore
from protolearn.sim.costs import RunCosts, Wire
from protolearn.sim.coordinator_host import CoordinatorHost
from protolearn.sim.engine import Engine
from protolearn.sim.metrics import Metrics
from protolearn.sim.scenario import Scenario

Key = tuple[int, int]  # (step, ticket)


@dataclass(eq=False)
class SimNode:
    """One simulated volunteer node."""

    peer: str
    index: int
    tflops: float
    wire: Wire
    joined_at: float
    stage: int = -1
    core: NodeCore | None = None
    lease: LeaseCore | None = None
    routes: RouteCore = field(default_factory=RouteCore)
    alive: bool = True
    # Crashed without closing its connections (power or network loss): it answers nothing and nobody is told.
    silent: bool = False
    left_at: float | None = None
    member: bool = False  # the coordinator holds it live (as far as the node knows)
    # Bumped whenever the node drops what it was doing (a resync, a move): older scheduled calls see a stale epoch.
    epoch: int = 0
    # Its accelerator: when the queued work is done, and how many jobs are queued or running.
    gpu_free: float = 0.0
    queued: int = 0
    # Seconds of compute per held attempt of (step, ticket), and the attempt's route up to this node.
    work: dict[Key, float] = field(default_factory=dict)
    # Finishing a step: the (step, revision) its train loop waits to close, whether it is finishing one.
    waiting: tuple[int, int] | None = None
    finishing: bool = False
    # Stage 0: lease nonces, the step's sit-out list, liveness bookkeeping (node/driver.py).
    nonces: dict[Key, bytes] = field(default_factory=dict)
    reported_at: dict[str, tuple[float, int]] = field(default_factory=dict)
    wake_token: int = 0
    # The view version its last join or heartbeat reply gave (it sends it back, for a delta).
    view_version: int = -1
    # When this node became busy averaging (None: it is not), and when it started syncing state.
    averaging_since: float | None = None
    syncing_since: float | None = None

    @property
    def serving(self) -> bool:
        return self.alive and self.core is not None and self.core.state.live


@dataclass
class World:
    """What every actor of the simulation reads and writes."""

    scenario: Scenario
    engine: Engine
    host: CoordinatorHost
    costs: RunCosts
    metrics: Metrics
    rng: random.Random
    nodes: dict[str, SimNode] = field(default_factory=dict)
    # Per stage: the peers the coordinator's view shows serving it (training or averaging), in join order.
    serving: list[list[str]] = field(default_factory=list)

    @property
    def now(self) -> float:
        return self.engine.now

    @property
    def num_stages(self) -> int:
        return len(self.costs.stages)
