"""The coordinator's side of DiLoCo's outer rounds: checks an :class:`~protolearn.protocol.coordination.OuterReady`
against its own records, then asks :mod:`.outer_rounds` (sans-IO).

Before an arrival counts (DESIGN.md, Trust: roles and weights come from the coordinator's records):

- the sender must be a live member serving the stage it names (``dispatch.py`` passes the member);
- the round's boundary step (``round * H - 1``) must have committed: nobody applied an uncommitted step;
- the round must not be over already: if a strict majority of the stage's serving replicas report a state
  after that boundary step, the round happened (before a coordinator restart, or while this replica's
  attempt failed): it is left out and resyncs;
- its anchor (its state after the previous sync) must be the one a strict majority of the stage's
  serving replicas report for that sync, when they report one: a replica that missed a sync, or whose
  sync went wrong, resyncs rather than average from another starting point.

Token weights are counted here from the ledger's closed steps (:meth:`OuterDesk.processed`): the tickets
each replica accounts for at its stage in the committed steps of the round, O(H x B) once per decision.

A replica a round went ahead without because it had not arrived (``late``) resyncs when it does arrive. One
that stays a live, serving member and never arrives (it heartbeats, its device or its will to work is gone)
would otherwise stay in its stage for good: it is waited for by every round's quorum until the quorum wait,
and it is one of the reporters a joiner's state must agree with. Each round it misses that way is an
``outer_hold`` strike, any arrival clears them, and ``expel_after_strikes`` in a row ban it (``liveness:``),
as a replica that holds the per-step commit is (``holdups.py``). An honest slow replica arrives, late, and is
not struck again.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from protolearn.coordinator.core.members import Member
from protolearn.coordinator.core.outer_rounds import Answer, Decision, OuterRounds, OuterSpec
from protolearn.coordinator.core.registry import Registry
from protolearn.coordinator.core.tickets import TicketLedger
from protolearn.coordinator.core.verdicts import VerdictPolicy
from protolearn.coordinator.errors import Refusal
from protolearn.protocol import coordination as cm
from protolearn.protocol.majority import strict_majority

log = logging.getLogger("protolearn.coordinator")


class OuterDesk:
    """Outer-round arrivals of a DiLoCo run, checked against the registry and the ledger."""

    def __init__(
        self, spec: OuterSpec, num_stages: int, registry: Registry, ledger: TicketLedger, verdicts: VerdictPolicy, *,
        ban: Callable[[str, str, float], object], expel_after: int | None,
    ) -> None:
        self.spec = spec
        self.registry = registry
        self.ledger = ledger
        self.verdicts = verdicts
        self.ban = ban
        self.expel_after = expel_after
        self.rounds = OuterRounds(spec, num_stages)
        # Rounds in a row each live replica was left out of without arriving (see the module docstring).
        self._missed: dict[str, int] = {}

    @property
    def version(self) -> int:
        return self.rounds.version

    def last(self, stage: int) -> Decision | None:
        return self.rounds.last.get(stage)

    def ready(self, member: Member, msg: cm.OuterReady, now: float) -> cm.OuterDecision:
        self._missed.pop(member.peer_id, None)  # it arrived: whatever it was told, it is not holding its stage
        stage = member.serving_stage
        if msg.stage != stage:
            raise Refusal("bad_stage", f"{member.peer_id} serves stage {stage}, not {msg.stage}")
        boundary = self.spec.boundary(msg.round)
        if self.spec.steps and (msg.round - 1) * self.spec.inner_steps >= self.spec.steps:
            raise Refusal("bad_round", f"the run's {self.spec.steps} steps end before outer round {msg.round}")
        if not self.ledger.committed(boundary):
            raise Refusal("not_committed", f"outer round {msg.round} follows step {boundary}, which has not committed")
        why = self._anchor_refusal(stage, msg, boundary)
        if why:
            return self._reply(msg, Answer("left_out", why))
        answer = self.rounds.arrive(
            member.peer_id, stage, msg.round, msg.attempt, since_step=msg.since_step, claimed=msg.tokens, now=now,
            live=self.registry.reachable, processed=self.processed,
        )
        return self._reply(msg, answer)

    def tick(self, now: float) -> list[str]:
        """A timer pass (rounds whose grace ran out); returns the log lines of every decision since the last call."""
        self.rounds.tick(now, self.registry.reachable, self.processed)
        self._missed = {p: n for p, n in self._missed.items() if self.registry.is_live(p)}
        return self.settle(now)

    def settle(self, now: float) -> list[str]:
        """Strike the replicas the decisions since the last call went ahead without (module docstring); log lines."""
        fresh, self.rounds.fresh = self.rounds.fresh, []
        lines = decision_lines(fresh)
        for d in fresh:
            for peer, why in d.left_out.items():
                if why.startswith("late") and self.registry.is_live(peer):
                    lines += self._strike(peer, d, now)
        return lines

    def _strike(self, peer: str, d: Decision, now: float) -> list[str]:
        n = self._missed[peer] = self._missed.get(peer, 0) + 1
        why = f"stage {d.stage}'s outer round {d.round} went ahead without it; it is live and did not arrive"
        self.verdicts.flag(peer, "outer_hold", why, now)
        out = [f"outer hold peer={peer} strikes={n} {why}"]
        if self.expel_after is not None and n >= self.expel_after:
            self._missed.pop(peer, None)
            reason = f"liveness: missed {n} outer rounds in a row while live ({why})"
            self.ban(peer, reason, now)
            out.append(f"expelled peer={peer} {reason}")
        return out

    def processed(self, peer: str, stage: int, first: int, last: int) -> int:
        """Tickets of the committed steps ``first..last`` that ``peer`` processed at ``stage`` (their last closing's routes)."""
        n = 0
        for step in range(max(0, first), last + 1):
            closed = self.ledger.closed.get(step)
            if closed is None or not self.ledger.committed(step):
                continue
            n += sum(1 for route in closed.routes if len(route) > stage and route[stage] == peer)
        return n

    def _majority_at(self, stage: int, step: int) -> str | None:
        """The state hash after ``step`` that a strict majority of ``stage``'s serving replicas report, or None."""
        if step < 0:
            return None
        serving = self.registry.serving(stage)
        said = {p: h for p, s, h in self.registry.stage_hashes(stage, cm.MAX_STAGE_HASHES) if s == step and h}
        return strict_majority((said[p] for p in serving if p in said), len(serving))

    def _anchor_refusal(self, stage: int, msg: cm.OuterReady, boundary: int) -> str:
        done = self._majority_at(stage, boundary)
        if done is not None:
            return (f"stage {stage}'s replicas already hold the state after outer round {msg.round} ({done[:12]}); "
                    "this replica was left out of it: resync")
        prev = self.spec.boundary(msg.round - 1)
        held = self._majority_at(stage, prev)
        if held is not None and held != msg.anchor_hash:
            return (f"stage {stage}'s replicas hold {held[:12]} after the sync at step {prev}, this replica "
                    f"{msg.anchor_hash[:12] or 'nothing'}: resync")
        return ""

    def _reply(self, msg: cm.OuterReady, a: Answer) -> cm.OuterDecision:
        d = a.decision
        weights, followers = [], []
        if d is not None and a.role in ("participant", "follower"):
            weights = [cm.OuterWeight(peer_id=p, weight=w) for p, w in sorted(d.weights.items())]
            followers = list(d.followers)
        return cm.OuterDecision(
            stage=msg.stage, round=msg.round if d is None else d.round, attempt=msg.attempt if d is None else d.attempt,
            role=a.role, reason=a.reason[: cm.MAX_TEXT], weights=weights, followers=followers,
        )


def decision_lines(decisions: list[Decision]) -> list[str]:
    """Log lines for the decisions a timer pass took."""
    return [f"outer round decided {d.reason}; weights={ {p[-8:]: round(w) for p, w in d.weights.items()} } "
            f"left_out={ {p[-8:]: why.split(':')[0] for p, why in d.left_out.items()} }" + (f" notes={list(d.notes)}" if d.notes else "")
            for d in decisions]


def answer_ready(desk: OuterDesk | None, member: Member, msg: cm.OuterReady, now: float) -> cm.OuterDecision:
    """The coordinator's answer to ``member``'s :class:`~protolearn.protocol.coordination.OuterReady` (``desk``:
    None when the run averages every step), settling the rounds it completes."""
    if desk is None:
        raise Refusal("not_diloco", "this run averages every step ([sync] mode = \"step\"); it has no outer rounds")
    reply = desk.ready(member, msg, now)
    for line in desk.settle(now):
        log.info("%s", line)
    return reply
