"""One record per ticket on this replica: what it holds of each microbatch (step, ticket), and where
that microbatch's outputs went.

A sans-IO core with one owner for each per-ticket fact. The router writes them as a microbatch passes
through (:mod:`protolearn.node.router`); the router's decisions (:mod:`.routing`) read them to route a
gradient and to find the hand-overs whose gradient never came back; integrity reads them to check a
gradient against the activation it answers and to show a checker this replica's input
(:mod:`protolearn.node.integrity`); stage 0's driver asks which tickets went to a peer that failed
(:mod:`protolearn.node.driver`). Nobody else keeps a copy. Per ticket, a :class:`TicketRecord` holds:

- ``route``: the route (up to and including this replica) of the attempt whose graph is held here. A
  redone ticket's new attempt replaces it, so a gradient of the earlier attempt, which took another
  route, is refused rather than reaching the new graph (I1: a redo replaces the earlier attempt);
- ``tokens``: with the subspace codec, the token ids that travel with each activation, which this
  stage sends on with its own output;
- ``frames``: the frames this replica received (``input``, the activation; ``grad``, the gradient) and
  the activation it sent on (``fwd``), which the next stage's gradient names as its input;
- ``sent_to``: per direction, the peer its signed output went to (the last one it tried): only that peer
  may see this replica's input of the microbatch;
- ``handed_to``: the next-stage peer that last accepted its activation. While that peer's gradient has
  not come back the hand-over is **awaited**, with the time it was made.

:meth:`Tickets.prune` is the one place tickets are forgotten: once a step is applied its tickets can no
longer be checked or redone. An awaited hand-over outlives that, since a peer that never answers is
counted lost whatever the step (:meth:`Tickets.overdue`); awaited hand-overs are bounded in number (I5).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

Key = tuple[int, int]  # (step, ticket)
# Most hand-overs awaited at once (the oldest are forgotten first; I5).
MAX_AWAITED = 65_536


@dataclass
class TicketRecord:
    """What this replica knows of one microbatch (see the module docstring)."""

    route: list[str] | None = None
    tokens: Any = None
    # "input" and "grad": the frames received; "fwd": the activation sent on.
    frames: dict[str, Any] = field(default_factory=dict)
    # direction ("fwd", "bwd") → the peer the signed output went to
    sent_to: dict[str, str] = field(default_factory=dict)
    handed_to: str | None = None


class Tickets:
    """The per-ticket records of one built stage replica."""

    def __init__(self) -> None:
        self._records: dict[Key, TicketRecord] = {}
        # Hand-overs whose gradient is awaited: key → when it was handed (insertion-ordered, oldest first).
        self._awaited: dict[Key, float] = {}

    def _get(self, key: Key) -> TicketRecord:
        rec = self._records.get(key)
        if rec is None:
            rec = self._records[key] = TicketRecord()
        return rec

    # -- the attempt held here -------------------------------------------------------------------
    def hold(self, key: Key, route: list[str]) -> None:
        """This replica runs an attempt of ``key`` that came along ``route`` (ending with this replica)."""
        self._get(key).route = route

    def route(self, key: Key) -> list[str] | None:
        """The route of the attempt whose graph is held here, or None."""
        rec = self._records.get(key)
        return None if rec is None else rec.route

    def keep_tokens(self, key: Key, tokens: Any) -> None:
        self._get(key).tokens = tokens

    def tokens(self, key: Key) -> Any:
        rec = self._records.get(key)
        return None if rec is None else rec.tokens

    # -- frames in and out -----------------------------------------------------------------------
    def received(self, key: Key, what: str, frame: Any) -> None:
        """Keep the frame received for ``key``: ``input`` (an activation) or ``grad`` (a gradient)."""
        self._get(key).frames[what] = frame

    def sent(self, key: Key, direction: str, peer: str, frame: Any) -> None:
        """This replica sends its signed ``direction`` output of ``key``, ``frame``, to ``peer``."""
        rec = self._get(key)
        rec.sent_to[direction] = peer
        if direction == "fwd":
            rec.frames["fwd"] = frame

    def frame(self, key: Key, what: str) -> Any:
        """The frame kept for ``key``: ``input`` or ``grad`` received, ``fwd`` sent; None if none."""
        rec = self._records.get(key)
        return None if rec is None else rec.frames.get(what)

    def sent_to(self, key: Key, direction: str) -> str | None:
        rec = self._records.get(key)
        return None if rec is None else rec.sent_to.get(direction)

    # -- hand-overs to the next stage ------------------------------------------------------------
    def handed(self, key: Key, peer: str, now: float) -> None:
        """``peer`` accepted the activation of ``key``: its gradient is now awaited."""
        self._get(key).handed_to = peer
        self._awaited.pop(key, None)
        while len(self._awaited) >= MAX_AWAITED:
            del self._awaited[next(iter(self._awaited))]
        self._awaited[key] = now

    def awaited_per_peer(self) -> dict[str, int]:
        """How many hand-overs each peer holds whose gradient is still awaited."""
        out: dict[str, int] = {}
        for key in self._awaited:
            peer = self._records[key].handed_to or ""
            out[peer] = out.get(peer, 0) + 1
        return out

    def handed_to(self, step: int, peer: str) -> list[int]:
        """Tickets of ``step`` whose activation ``peer`` accepted last, sorted."""
        return sorted(t for (s, t), rec in self._records.items() if s == step and rec.handed_to == peer)

    def returned(self, key: Key, now: float) -> tuple[str, float] | None:
        """The gradient of ``key`` came back: (the peer it was handed to, the round trip), or None when it
        was not awaited (never handed, already back, or given up)."""
        at = self._awaited.pop(key, None)
        if at is None:
            return None
        return self._records[key].handed_to or "", now - at

    def overdue(self, now: float, limit_s: float) -> list[tuple[Key, str]]:
        """Give up on the hand-overs awaited for longer than ``limit_s``: (key, peer) of each, oldest first."""
        out = [(k, self._records[k].handed_to or "") for k, at in self._awaited.items() if now - at > limit_s]
        for key, _ in out:
            del self._awaited[key]
        return out

    def forget_peer(self, peer: str) -> list[Key]:
        """``peer`` left the swarm: await nothing more from it. Returns the hand-overs to it that were still
        awaited, oldest first (their gradient will never come)."""
        gone = [k for k in self._awaited if self._records[k].handed_to == peer]
        for k in gone:
            del self._awaited[k]
        return gone

    # -- forgetting ------------------------------------------------------------------------------
    def prune(self, applied: int) -> None:
        """Forget the tickets of steps before ``applied``: they can no longer be checked or redone. An
        awaited hand-over stays awaited (the peer that took it is counted lost if it never answers)."""
        kept: dict[Key, TicketRecord] = {}
        for key, rec in self._records.items():
            if key[0] >= applied:
                kept[key] = rec
            elif key in self._awaited:
                kept[key] = TicketRecord(handed_to=rec.handed_to)
        self._records = kept

    def __len__(self) -> int:
        """Tickets with a record."""
        return len(self._records)
