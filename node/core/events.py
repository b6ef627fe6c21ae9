"""The node core's vocabulary: the events it takes and the actions it returns (see :mod:`protolearn.node.core.closed_step`).

Each action that asks something is answered by exactly one event: :class:`AskReported` by
:class:`Reported`, :class:`Average` by :class:`RoundDone` or :class:`RoundFailed`, :class:`Fetch` by
:class:`Fetched`, :class:`Redo` by :class:`RedoAnswer`, :class:`AskReopened` by :class:`ReopenAnswer`,
:class:`WaitCommit` by :class:`CommitAnswer`, :class:`Apply` and :class:`Skip` by :class:`Applied`, and (DiLoCo)
:class:`SyncOuter` by :class:`OuterDone`. The rest
(:class:`Emit`, :class:`StartHeld`, :class:`Resync`, :class:`WaitClosed`) need no answer.
"""

from __future__ import annotations

from dataclasses import dataclass, field


# -- events ----------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Closed:
    """The coordinator closed ``step`` at ``revision``; ``account`` is this stage's peer → tickets, each list in
    ascending order (its producer sorts them; the core keeps the lists and never changes them)."""

    step: int
    revision: int
    account: dict[str, list[int]]
    loss: float | None
    # Tickets of the step whose parameter gradients this replica holds.
    held: list[int]
    # The tickets in ``account``, sorted and each once, when the producer has them at hand (one list for every
    # replica of the stage); None: the core works them out.
    tickets: list[int] | None = None


@dataclass(frozen=True)
class Reported:
    """Whether some other replica of the stage reported a parameter hash after ``step``."""

    step: int
    applied_elsewhere: bool


@dataclass(frozen=True)
class RoundDone:
    step: int
    revision: int
    excluded: list[str]


@dataclass(frozen=True)
class RoundFailed:
    step: int
    revision: int
    reason: str
    # The participants whose statements or silence ended the round here (the collective's Failed.missing).
    causes: tuple[str, ...] = ()


@dataclass(frozen=True)
class Fetched:
    """The left-out replica got the round's result (``gone``: the participants no longer keep it;
    neither: this try ran out of time or every participant refused)."""

    step: int
    revision: int
    ok: bool
    gone: bool = False
    reason: str = ""


@dataclass(frozen=True)
class RedoAnswer:
    """The coordinator granted or refused the redo; ``None``: it did not answer (unreachable, restarting)."""

    step: int
    revision: int
    granted: bool | None
    reason: str = ""
    # The refusal's code (``step_committed``: the step committed without this replica's result).
    code: str = ""


@dataclass(frozen=True)
class ReopenAnswer:
    """Whether ``step`` reopened after closing at ``revision``; ``None``: the coordinator did not answer."""

    step: int
    revision: int
    reopened: bool | None
    reason: str = ""


@dataclass(frozen=True)
class CommitAnswer:
    step: int
    revision: int
    committed: bool
    # Why the coordinator refused this replica's result (its stage's majority holds another): resync.
    refused: str = ""


@dataclass(frozen=True)
class Applied:
    step: int
    param_hash: str


@dataclass(frozen=True)
class Synced:
    """The replica installed state after ``applied`` steps (a donor's, a checkpoint, or the init)."""

    applied: int


@dataclass(frozen=True)
class OuterDone:
    """DiLoCo: the outer round after ``step`` ended here: ``param_hash`` is the stage's new shared state, or
    ``resync`` (this replica was left out, or could not get the result)."""

    step: int
    param_hash: str = ""
    resync: bool = False
    reason: str = ""


Event = Closed | Reported | RoundDone | RoundFailed | Fetched | RedoAnswer | ReopenAnswer | CommitAnswer | Applied | Synced | OuterDone


# -- actions ---------------------------------------------------------------------------------------
@dataclass(frozen=True)
class AskReported:
    step: int
    # Ask after this long (a replica that just applied the step reports it with its next heartbeat).
    delay_s: float = 0.0


@dataclass(frozen=True)
class Average:
    """Run the stage's collective round over ``weights`` with the sum of exactly ``tickets``."""

    step: int
    revision: int
    round: int
    weights: dict[str, float]
    tickets: list[int]


@dataclass(frozen=True)
class Fetch:
    """Take the round's result from a participant that finished it: this replica was left out of the round, or
    its own round failed. ``weights``: the round's participants and their weights (what proves a result)."""

    step: int
    revision: int
    round: int
    weights: dict[str, float]
    try_s: float


@dataclass(frozen=True)
class Redo:
    step: int
    revision: int
    tickets: list[int]
    reason: str
    # A refusal is the normal answer (e.g. the participants are alive, just slow): log it at info.
    expected: bool = False
    # Ask after this long (the coordinator did not answer the last time).
    delay_s: float = 0.0
    # Why, as the coordinator's code (protocol/coordination.py RedoKind), and with "round_failed" its causes.
    kind: str = ""
    causes: tuple[str, ...] = ()


@dataclass(frozen=True)
class AskReopened:
    step: int
    revision: int
    delay_s: float = 0.0


@dataclass(frozen=True)
class WaitCommit:
    step: int
    revision: int
    report: bool


@dataclass(frozen=True)
class Apply:
    step: int
    revision: int
    loss: float | None
    tickets: list[int]
    replicas: list[str]
    # The tickets whose gradients are in the applied average (None: this replica fetched the result).
    counted: list[int] | None


@dataclass(frozen=True)
class Skip:
    """The step committed, but no live replica of this stage holds its result: count it applied with no
    update (the parameters stay as they are), answered by :class:`Applied`."""

    step: int
    revision: int
    reason: str


@dataclass(frozen=True)
class Resync:
    step: int
    reason: str


@dataclass(frozen=True)
class StartHeld:
    """Start the next step's work that was held until this step was applied, in arrival order."""

    payloads: list[object]


@dataclass(frozen=True)
class WaitClosed:
    """The step reopened: wait until it closes at ``revision`` and finish it again."""

    step: int
    revision: int


@dataclass(frozen=True)
class SyncOuter:
    """DiLoCo: step ``step`` was the last inner step of outer round ``round``: sync with the stage (answered
    by :class:`OuterDone`; ``node/outer_sync.py``)."""

    step: int
    round: int


@dataclass(frozen=True)
class Emit:
    """A progress event for the node's log (and, with ``level``, a log line)."""

    event: str
    fields: dict[str, object] = field(default_factory=dict)
    level: int = 0
    message: str = ""


Action = AskReported | Average | Fetch | Redo | AskReopened | WaitCommit | Apply | Skip | Resync | StartHeld | WaitClosed | SyncOuter | Emit
