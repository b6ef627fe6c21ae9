"""Decoupled DiLoCo's outer rounds (issue 24): who takes part in a stage's round, and with what weight (sans-IO).

In ``[sync] mode = "diloco"`` each replica of a stage trains on its own for ``inner_steps`` = H steps;
then the stage's replicas average their pseudo-gradients in **outer round** r, after inner step
``b = r*H - 1`` committed. A replica that applied step b says so with
:class:`~protolearn.protocol.coordination.OuterReady` and long-polls the decision. :class:`OuterRounds`
takes those arrivals with ``now`` and decides, per stage and round, once:

- **when**: once every live replica of the stage has arrived, or once at least ``q`` have and
  ``grace_s`` has passed since the first arrival, where ``q = min(quorum, live replicas)`` (a stage
  whose other replicas died goes on alone rather than wait for a quorum that cannot come). The quorum is a
  floor while the missing replicas may still come, not for ever: after :func:`quorum_wait_s` (4 graces,
  at least 5 s) the round goes ahead with whoever arrived, so a replica that heartbeats but never
  arrives (a hung device) cannot hold its stage, whose next step cannot close while the others wait;
- **who**: the arrivals that are still live. A live replica that has not arrived is left out
  (``late``), one that arrived and died is left out (``gone``); each later arrival for a decided round
  is told it was left out. A left-out replica resyncs from a participant's post-sync state (the node's
  ordinary resync), so the round never waits for it and it serves again from the next round on;
- **weights**: the tokens each participant processed for this stage since the last sync, read off the
  coordinator's own frozen accounting of the committed steps (``processed``), never from the replica:
  an arrival's ``claimed`` token count is only kept for the log, so lying about it gains nothing. The
  one claim taken is ``since_step`` (the first step its parameters cover since it last took the
  stage's state, e.g. after a restart), and only to *lower* its own count. A participant that
  processed nothing follows (it fetches the round's result instead of contributing a zero); if nobody
  processed anything, every arrival contributes with weight 1. Then, with ``max_weight_share``, no
  replica's weight exceeds that share of the total (:func:`capped`, Throttle's rule: the largest are cut
  to a common cap; a cap that fewer than ``1/share`` replicas cannot meet gives them equal weights).

Every decision carries its reason. A round whose collective failed on its participants (they hold no
result; under the collective's timing assumption all honest participants end alike) is retried as the
next ``attempt`` with the same rule; nobody applied the failed one.

What this does not trust: arrivals come only from live members serving the stage (``dispatch.py``), the
anchor each names (its state after the last sync) must be the one a strict majority of its stage's
replicas report for that sync, if they report one, and the round's boundary step must have committed.
What it rests on: the registry's ``reachable`` replicas, the ledger's committed steps and closed-step
routes. State is bounded by the stages: the last decision and the pending round per stage. The last
decisions are persisted with the rest of the coordinator's state (:meth:`OuterRounds.drain`), so a
restarted coordinator tells a participant that asks again what it told the others; a pending round is
collected again from the nodes' repeated polls.
"""

from __future__ import annotations

from collections.abc import Callable, Collection
from dataclasses import asdict, dataclass, field
from typing import Any

# (peer, stage, first step, last step) → tickets of those committed steps the peer processed at that stage.
Processed = Callable[[str, int, int, int], int]
Live = Callable[[int], Collection[str]]
# The longest a round waits for its quorum, in graces and at least in seconds (see the module docstring).
QUORUM_WAIT_GRACES = 4
QUORUM_WAIT_MIN_S = 5.0


def quorum_wait_s(grace_s: float) -> float:
    return max(QUORUM_WAIT_MIN_S, QUORUM_WAIT_GRACES * grace_s)


@dataclass(frozen=True)
class OuterSpec:
    """The run's ``[sync]`` settings the coordinator needs (``stages/config.py`` SyncConfig)."""

    inner_steps: int
    # The run's steps: its last outer round ends at its last step (0: no end).
    steps: int = 0
    quorum: int = 1
    grace_s: float = 2.0
    max_weight_share: float | None = None
    tokens_per_ticket: int = 1

    def boundary(self, round_: int) -> int:
        """The last inner step of outer round ``round_`` (1-based; ``r*H - 1``, or the run's last step)."""
        end = round_ * self.inner_steps
        return (min(end, self.steps) if self.steps > 0 else end) - 1


@dataclass(frozen=True)
class Arrival:
    at: float
    since_step: int
    claimed: int


@dataclass(frozen=True)
class Decision:
    """Stage ``stage``'s outer round ``round`` (attempt ``attempt``): ``weights`` of the contributors,
    ``followers`` (in sync, nothing processed: they fetch the result), ``left_out`` with why."""

    stage: int
    round: int
    attempt: int
    weights: dict[str, float]
    followers: tuple[str, ...]
    left_out: dict[str, str]
    quorum: int
    at: float
    reason: str
    # Arrivals whose own token count differs from the records (a claim: shown, never used).
    notes: tuple[str, ...] = ()

    def role(self, peer: str) -> str:
        if peer in self.weights:
            return "participant"
        if peer in self.followers:
            return "follower"
        return "left_out"

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> Decision:
        return cls(**{**d, "followers": tuple(d["followers"]), "notes": tuple(d.get("notes", ()))})


@dataclass(frozen=True)
class Answer:
    """What an arrival is told: ``role`` (``pending`` until decided), and the decision once there is one;
    ``code`` is set for a refusal (the arrival does not count)."""

    role: str
    reason: str
    decision: Decision | None = None
    code: str = ""


@dataclass
class _Pending:
    round: int
    attempt: int
    opened_at: float
    arrivals: dict[str, Arrival] = field(default_factory=dict)


def capped(weights: dict[str, float], share: float | None) -> dict[str, float]:
    """Cap every weight at ``share`` of the capped total (Throttle): the k largest become a common cap ``c``
    with ``c = share * (k * c + rest)``, the rest stay. With fewer than ``1/share`` weights no cap can hold:
    equal weights. Deterministic (sorted by weight, then peer)."""
    n = len(weights)
    if share is None or n <= 1 or share >= 1.0:
        return dict(weights)
    total = sum(weights.values())
    if total <= 0:
        return dict(weights)
    if share * n < 1.0:
        return {p: 1.0 for p in weights}
    order = sorted(weights, key=lambda p: (-weights[p], p))
    if weights[order[0]] <= share * total:
        return dict(weights)
    rest = total
    for k in range(1, n):
        rest -= weights[order[k - 1]]
        if k * share >= 1.0:
            break
        c = share * rest / (1.0 - k * share)
        if weights[order[k]] <= c <= weights[order[k - 1]]:
            return {p: (c if i < k else weights[p]) for i, p in enumerate(order)}
    return {p: 1.0 for p in weights}


class OuterRounds:
    """The outer rounds of every stage: arrivals in, decisions out (see the module docstring)."""

    def __init__(self, spec: OuterSpec, num_stages: int) -> None:
        self.spec = spec
        self.num_stages = num_stages
        self.last: dict[int, Decision] = {}
        self.pending: dict[int, _Pending] = {}
        # Bumped on every decision, so that long polls wake (the service's progress marker).
        self.version = 0
        # Decisions not yet logged (the caller drains them), and whether the last ones changed since persisted.
        self.fresh: list[Decision] = []
        self.dirty = False

    def restore(self, decisions: list[Decision]) -> None:
        """The last decision of each stage, as persisted (:meth:`drain`)."""
        self.last = {d.stage: d for d in decisions}
        self.pending.clear()

    def drain(self) -> list[Decision] | None:
        """The last decision of every stage to persist, if any changed since the last drain (else None)."""
        if not self.dirty:
            return None
        self.dirty = False
        return [self.last[s] for s in sorted(self.last)]

    def arrive(
        self, peer: str, stage: int, round_: int, attempt: int, *, since_step: int, claimed: int, now: float,
        live: Live, processed: Processed,
    ) -> Answer:
        """``peer`` (a live member serving ``stage``, its anchor checked by the caller) applied the last inner
        step of ``round_`` and is ready; returns what it is told now (it asks again while ``pending``)."""
        key = (round_, attempt)
        last = self.last.get(stage)
        if last is not None and key <= (last.round, last.attempt):
            if key == (last.round, last.attempt):
                return self._told(peer, last)
            return Answer("left_out", f"stage {stage} is past outer round {round_} attempt {attempt} (it decided round "
                                      f"{last.round} attempt {last.attempt}); resync", last)
        pending = self.pending.get(stage)
        if pending is None or (pending.round, pending.attempt) < key:
            pending = self.pending[stage] = _Pending(round_, attempt, now)
        elif (pending.round, pending.attempt) > key:
            return Answer("left_out", f"stage {stage} is collecting outer round {pending.round} attempt {pending.attempt}, "
                                      f"past round {round_} attempt {attempt}; resync")
        pending.arrivals.setdefault(peer, Arrival(now, since_step, claimed))
        decided = self._try(stage, now, live, processed)
        if decided is not None:
            return self._told(peer, decided)
        return Answer("pending", self._waiting_line(stage, pending, now, live))

    def tick(self, now: float, live: Live, processed: Processed) -> list[Decision]:
        """A timer pass: decide every pending round whose grace ran out (or whose missing replicas died)."""
        out = []
        for stage in sorted(self.pending):
            d = self._try(stage, now, live, processed)
            if d is not None:
                out.append(d)
        return out

    def _told(self, peer: str, d: Decision) -> Answer:
        role = d.role(peer)
        if role == "left_out":
            why = d.left_out.get(peer, "it had not arrived when the round was decided")
            return Answer(role, f"left out of stage {d.stage}'s outer round {d.round} (attempt {d.attempt}): {why}; resync", d)
        return Answer(role, d.reason, d)

    def _quorum(self, live: Collection[str]) -> int:
        return min(self.spec.quorum, max(1, len(live)))

    def _waiting_line(self, stage: int, p: _Pending, now: float, live: Live) -> str:
        alive = set(live(stage))
        q = self._quorum(alive)
        return (f"outer round {p.round} of stage {stage}: {len(alive & set(p.arrivals))} of {len(alive)} live replicas ready "
                f"(quorum {q}), {max(0.0, p.opened_at + self.spec.grace_s - now):.1f} s of grace left")

    def _try(self, stage: int, now: float, live: Live, processed: Processed) -> Decision | None:
        p = self.pending.get(stage)
        if p is None:
            return None
        alive = set(live(stage))
        ready = {peer for peer in p.arrivals if peer in alive}
        if not ready:
            return None
        q = self._quorum(alive)
        everyone = alive <= ready
        graced = now >= p.opened_at + self.spec.grace_s
        overdue = now >= p.opened_at + quorum_wait_s(self.spec.grace_s)
        if not everyone and not (len(ready) >= q and graced) and not overdue:
            return None
        if everyone:
            why = "every live replica arrived"
        elif len(ready) >= q:
            why = f"{len(ready)} arrived (quorum {q}) and the {self.spec.grace_s:g} s grace passed"
        else:
            why = f"only {len(ready)} of quorum {q} arrived within {quorum_wait_s(self.spec.grace_s):g} s"
        d = self._decide(stage, p, ready, alive, q, now, processed, why)
        del self.pending[stage]
        self.last[stage] = d
        self.version += 1
        self.fresh.append(d)
        self.dirty = True
        return d

    def _decide(
        self, stage: int, p: _Pending, ready: set[str], alive: set[str], q: int, now: float, processed: Processed, why: str,
    ) -> Decision:
        spec = self.spec
        first, last = (p.round - 1) * spec.inner_steps, spec.boundary(p.round)
        tokens: dict[str, float] = {}
        notes = []
        for peer in sorted(ready):
            a = p.arrivals[peer]
            n = processed(peer, stage, max(first, a.since_step), last) * spec.tokens_per_ticket
            tokens[peer] = float(n)
            if a.claimed and a.claimed != n:
                notes.append(f"{peer} claimed {a.claimed} tokens, the records say {n}")
        contributors = {peer: w for peer, w in tokens.items() if w > 0}
        if not contributors:
            contributors = {peer: 1.0 for peer in tokens}  # nobody processed anything: all contribute alike
        weights = capped(contributors, spec.max_weight_share)
        followers = tuple(sorted(set(tokens) - set(weights)))
        left_out = {peer: "late: it had not arrived when the round was decided" for peer in sorted(alive - ready)}
        left_out |= {peer: "gone: it arrived, then left the stage's live replicas" for peer in sorted(set(p.arrivals) - alive)}
        reason = (f"stage {stage} outer round {p.round} (attempt {p.attempt}) after step {last}: {why}; "
                  f"{len(weights)} contribute, {len(followers)} follow, {len(left_out)} left out")
        return Decision(stage, p.round, p.attempt, weights, followers, left_out, q, now, reason, tuple(notes))
