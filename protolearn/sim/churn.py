"""Who comes and goes in a simulated swarm, and when: the scenario's distributions, or a trace file.

**Distributions.** The ``[swarm] nodes`` initial nodes arrive spread over ``ramp``. Each node lives an
exponentially distributed time of mean ``mean_lifetime`` (none leaves when it is 0) and then departs:
gracefully (a Leave) with probability ``graceful_share``, otherwise it crashes, closing its connections
with probability ``crash_closes_share`` (a killed process) or going silent (a host that lost power or its
network). New nodes arrive as a Poisson process of rate ``nodes / mean_lifetime``, which keeps the swarm
at its size on average.

**Trace.** ``time,event,node`` per line (``#`` comments), events ``join``, ``leave``, ``crash`` (closes its
connections) and ``silent``; ``node`` is any label, and a label joins once. Times are seconds.

A coordinator restart, if the scenario asks for one, happens at its time whatever the source.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from protolearn.errors import ConfigError
from protolearn.sim.world import SimNode, World

EVENTS = ("join", "leave", "crash", "silent")


def read_trace(path: str) -> list[tuple[float, str, str]]:
    """The trace's (time, event, label) lines, sorted by time; ConfigError names a bad line."""
    try:
        text = Path(path).read_text()
    except OSError as err:
        raise ConfigError(f"churn trace {path}: cannot read it ({err.strerror})") from None
    out = []
    for number, line in enumerate(text.splitlines(), 1):
        body = line.split("#", 1)[0].strip()
        if not body:
            continue
        parts = [p.strip() for p in body.split(",")]
        try:
            when, event, label = float(parts[0]), parts[1], parts[2]
        except (ValueError, IndexError):
            raise ConfigError(f"churn trace {path} line {number}: expected 'time,event,node', got {body!r}") from None
        if event not in EVENTS or when < 0:
            raise ConfigError(f"churn trace {path} line {number}: event {event!r} at {when} is not one of {', '.join(EVENTS)} at a time >= 0")
        out.append((when, event, label))
    return sorted(out, key=lambda e: e[0])


class Churn:
    """Schedules arrivals and departures on the world's clock."""

    def __init__(self, world: World, arrive: Callable[[], SimNode], depart: Callable[[SimNode, str], None],
                 crash_coordinator: Callable[[float], None]) -> None:
        self.w = world
        self.arrive = arrive
        self.depart = depart
        self.labels: dict[str, SimNode] = {}
        sc = world.scenario
        ch = sc.churn
        if ch.trace is not None:
            for when, event, label in read_trace(ch.trace):
                world.engine.at(when, self._traced, event, label)
        else:
            n = sc.swarm.nodes
            for i in range(n):
                world.engine.at(sc.swarm.ramp_s * i / max(1, n), self._arrive)
            if ch.mean_lifetime_s > 0:
                world.engine.at(world.rng.expovariate(n / ch.mean_lifetime_s), self._poisson)
        if ch.coordinator_restart_at_s is not None:
            world.engine.at(ch.coordinator_restart_at_s, crash_coordinator, ch.coordinator_outage_s)

    def _arrive(self) -> SimNode:
        node = self.arrive()
        life = self.w.scenario.churn.mean_lifetime_s
        if life > 0 and self.w.scenario.churn.trace is None:
            self.w.engine.after(self.w.rng.expovariate(1.0 / life), self._end_of_life, node)
        return node

    def _poisson(self) -> None:
        self._arrive()
        sc = self.w.scenario
        self.w.engine.after(self.w.rng.expovariate(sc.swarm.nodes / sc.churn.mean_lifetime_s), self._poisson)

    def _end_of_life(self, node: SimNode) -> None:
        ch, rng = self.w.scenario.churn, self.w.rng
        if rng.random() < ch.graceful_share:
            how = "leave"
        else:
            how = "crash" if rng.random() < ch.crash_closes_share else "silent"
        self.depart(node, how)

    def _traced(self, event: str, label: str) -> None:
        if event == "join":
            if label not in self.labels:
                self.labels[label] = self.arrive()
            return
        node = self.labels.get(label)
        if node is not None:
            self.depart(node, event)
