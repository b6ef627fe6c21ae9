"""A replica's decisions in one DiLoCo outer round, as a sans-IO state machine.

After applying step ``b = r*H - 1`` (the last inner step of outer round r) a replica of a stage:

1. says it is ready and asks the coordinator for the round's decision (:class:`AskReady`, a long poll;
   ``coordinator/core/outer_rounds.py`` decides who takes part, with what weight, once a quorum arrived
   and the grace passed). A coordinator that does not answer is asked again, up to ``ask_timeout_s``,
   then the replica resyncs (never guesses);
2. as a **participant**, contributes ``w * delta`` to the stage's collective (:class:`AverageOuter`: its
   pseudo-gradient scaled by its weight, summed over the participants) and divides the result by the
   summed weight of the contributors the collective kept (every survivor holds the same set and the same
   bits), so it holds the token-weighted mean pseudo-gradient; as a **follower** (in sync, but it processed
   nothing since the sync), fetches the round's result from a participant (:class:`FetchOuter`), taken only
   when a strict majority of the participants signed it and it is a full round's (every participant's
   contribution in: ``protocol/collective/result_proof.py``, the same proof as a step's fetched result);
3. installs the outer Nesterov step on it (:class:`ApplyOuter`, ``stages/outer.py``): every participant
   and follower then holds the same new anchor (I2 as restated for DiLoCo: replicas are identical after
   every outer sync);
4. **left out** (it arrived late, its anchor is not its stage's, or the round was over), or a follower whose
   fetch failed: it resyncs, taking a participant's post-sync state (``node/syncing.py``) and trains on
   from the next step; the round never waited for it;
5. a participant whose collective **failed** first asks the other participants for the round's proven result,
   as a step's participant does (one mechanism: ``node/replica_sync.py``'s fetch): the collective makes every
   participant that finishes end with the same result, and one whose own round failed after its part was in
   must take that result, not average again without them. A round that finished here with only a minority of
   its participants' parts is not applied either (no majority could prove it to the rest): this replica asks
   for the next attempt too. A round that finished elsewhere without this
   replica is not a full round and is not served (its result has no proof this replica can check); nor is a
   round that failed everywhere (a reducer caught lying, two deaths at once): then it asks for the round's next attempt
   (a fresh round id; the coordinator decides it like the first, and the banned or dead are out), up to
   ``MAX_OUTER_ATTEMPTS`` (then it resyncs).

The actions :class:`AverageOuter` and :class:`FetchOuter` are the one seam where the pseudo-gradient
meets the wire: a flat float32 vector handed to the stage's averager (a compressor plugs in there).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from protolearn.node.core.events import Emit
from protolearn.node.core.inner_step import outer_round_id
from protolearn.protocol.majority import is_strict_majority
from protolearn.protocol.rounds import MAX_OUTER_ATTEMPTS

# A coordinator that does not answer: ask again after this long.
ASK_AGAIN_S = 1.0
# A participant whose collective failed asks the others for the round's result this long before it retries:
# one that finishes does so within a probe of hearing this replica left.
FETCH_AFTER_FAILURE_S = 10.0


# -- events ----------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Decided:
    """The coordinator's answer: ``role`` pending, participant, follower or left_out."""

    role: str
    reason: str
    weights: dict[str, float] = field(default_factory=dict)
    followers: tuple[str, ...] = ()


@dataclass(frozen=True)
class Unanswered:
    reason: str


@dataclass(frozen=True)
class Averaged:
    """The collective finished here with these contributors' parts in."""

    contributors: tuple[str, ...]


@dataclass(frozen=True)
class AverageFailed:
    reason: str


@dataclass(frozen=True)
class Fetched:
    ok: bool
    reason: str = ""


@dataclass(frozen=True)
class Installed:
    param_hash: str


OuterEvent = Decided | Unanswered | Averaged | AverageFailed | Fetched | Installed


# -- actions ---------------------------------------------------------------------------------------
@dataclass(frozen=True)
class AskReady:
    round: int
    attempt: int
    delay_s: float = 0.0


@dataclass(frozen=True)
class AverageOuter:
    """Contribute ``weights[me] * pseudo-gradient`` to collective round ``round_id`` over ``weights``."""

    round_id: int
    weights: dict[str, float]


@dataclass(frozen=True)
class FetchOuter:
    """Fetch round ``round_id``'s result from one of its participants (``weights``, the decision's: the proof of
    the result is over all of them), trying for up to ``try_s`` (None: the averager's own deadline)."""

    round_id: int
    weights: dict[str, float]
    try_s: float | None = None


@dataclass(frozen=True)
class ApplyOuter:
    """Install the outer step on the round's weighted mean pseudo-gradient (averaged or fetched)."""


@dataclass(frozen=True)
class Finish:
    """The round is over here: synced (``param_hash``) or ``resync``."""

    param_hash: str = ""
    resync: bool = False
    reason: str = ""


OuterAction = AskReady | AverageOuter | FetchOuter | ApplyOuter | Finish | Emit


def total_weight(weights: dict[str, float], contributors: tuple[str, ...] | list[str]) -> float:
    """The summed weight of the contributors a round kept, in sorted order (every survivor sums alike)."""
    return sum(weights.get(p, 0.0) for p in sorted(contributors))


class OuterRoundCore:
    """One replica's outer round ``round`` of stage ``stage`` (see the module docstring)."""

    def __init__(self, me: str, stage: int, round_: int, boundary: int, *, ask_timeout_s: float) -> None:
        """Outer round ``round_`` of ``stage``, after inner step ``boundary``."""
        self.me = me
        self.stage = stage
        self.round = round_
        self.boundary = boundary
        self.ask_timeout_s = ask_timeout_s
        self.attempt = 1
        self.role = "pending"
        self.weights: dict[str, float] = {}
        self._asked_since = 0.0
        self._failed = ""  # why this attempt's collective failed here, while asking the others for its result

    @property
    def round_id(self) -> int:
        return outer_round_id(self.boundary, self.attempt)

    def start(self, now: float) -> list[OuterAction]:
        self._asked_since = now
        return [AskReady(self.round, self.attempt)]

    def handle(self, event: OuterEvent, now: float) -> list[OuterAction]:
        if isinstance(event, Decided):
            return self._decided(event, now)
        if isinstance(event, Unanswered):
            if now < self._asked_since + self.ask_timeout_s:
                return [AskReady(self.round, self.attempt, ASK_AGAIN_S)]
            return self._resync(f"the coordinator did not decide outer round {self.round} within {self.ask_timeout_s:g} s ({event.reason})")
        if isinstance(event, Averaged):
            if total_weight(self.weights, event.contributors) <= 0:
                return self._resync(f"outer round {self.round}: the collective kept no weighted contribution")
            if not is_strict_majority(len(set(event.contributors) & set(self.weights)), len(self.weights)):
                # A minority's result: nothing the rest could take (no majority of fins proves it), so applying
                # it would split the stage. The round's next attempt, which the majority that went on refuses
                # (this replica then resyncs to its state) or which the rest join.
                return self._retry(f"only {len(event.contributors)} of its {len(self.weights)} participants' parts were in", now)
            out: list[OuterAction] = []
            gone = sorted(set(self.weights) - set(event.contributors))
            if gone:
                out.append(Emit("outer_replica_out", {"round": self.round, "excluded": gone}))
            return [*out, ApplyOuter()]
        if isinstance(event, AverageFailed):
            if not any(p != self.me for p in self.weights):
                return self._retry(event.reason, now)
            self._failed = event.reason
            return [FetchOuter(self.round_id, dict(self.weights), FETCH_AFTER_FAILURE_S)]
        if isinstance(event, Fetched):
            failed, self._failed = self._failed, ""
            if event.ok:
                return [ApplyOuter()]
            if failed:  # nobody finished this attempt: the next one
                return self._retry(failed, now)
            return self._resync(f"outer round {self.round}: could not fetch its result ({event.reason})")
        if isinstance(event, Installed):
            return [Finish(param_hash=event.param_hash)]
        raise TypeError(f"not an outer round event: {event!r}")

    def _decided(self, event: Decided, now: float) -> list[OuterAction]:
        self.role = event.role
        if event.role == "pending":
            self._asked_since = now  # an answer: the coordinator is there, the round is still being collected
            return [AskReady(self.round, self.attempt)]
        if event.role == "left_out":
            return self._resync(event.reason)
        self.weights = dict(event.weights)
        if event.role == "participant" and self.me in self.weights:
            return [AverageOuter(self.round_id, self.weights)]
        if event.role == "follower" and self.weights:
            return [FetchOuter(self.round_id, dict(self.weights))]
        return self._resync(f"outer round {self.round}: the decision ({event.role}) names no contribution of this replica to take part with")

    def _retry(self, reason: str, now: float) -> list[OuterAction]:
        """Ask for the round's next attempt (its collective failed on every participant this one reached)."""
        if self.attempt >= MAX_OUTER_ATTEMPTS:
            return self._resync(f"outer round {self.round} failed {self.attempt} times (last: {reason})")
        self.attempt += 1
        self._asked_since = now
        return [Emit("outer_failed", {"round": self.round, "attempt": self.attempt - 1, "reason": reason}, logging.WARNING,
                     f"stage {self.stage} outer round {self.round} failed ({reason}); asking for attempt {self.attempt}"),
                AskReady(self.round, self.attempt)]

    def _resync(self, reason: str) -> list[OuterAction]:
        return [Finish(resync=True, reason=reason)]
