"""The finished run's model: whether the run is over, and where its final model is (sans-IO).

With ``settings.keep_final`` (``coordinator start`` sets it), the coordinator keeps the model of a
finished run, so that ``swarm export`` works after every node left. Once the run's last step commits
(:attr:`FinalModelDesk.finished`), members are told to stay and serve their stage
(``HeartbeatReply.final = "collecting"``, :meth:`FinalModelDesk.phase`) while the coordinator's adapter
(``protolearn/cli/final_model.py``) fetches every stage from a live replica. The adapter records the
outcome here: :meth:`FinalModelDesk.saved` (members are told ``"saved"`` and leave; ``Members.final_step``
and the status's ``final_step`` name the step it holds) or :meth:`FinalModelDesk.failed` (members
leave; their checkpoints hold the stages).
"""

from __future__ import annotations

from protolearn.coordinator.core.run import RunInfo
from protolearn.coordinator.core.tickets import TicketLedger
from protolearn.protocol.coordination import FinalState


class FinalModelDesk:
    """Whether the run finished, and the final model's state: "" (not kept yet), "saved" or "failed"."""

    def __init__(self, run: RunInfo, ledger: TicketLedger, *, keep: bool) -> None:
        self.run = run
        self.ledger = ledger
        self.keep = keep
        self.state = ""
        self.step = -1

    @property
    def finished(self) -> bool:
        """Every step of the run has committed."""
        return self.run.steps > 0 and self.ledger.committed_through >= self.run.steps - 1

    @property
    def half_done(self) -> bool:
        """At least half the run's steps have committed (the adapter loads what its fetch needs from then on)."""
        return self.run.steps > 0 and 2 * (self.ledger.committed_through + 1) >= self.run.steps

    @property
    def held_step(self) -> int:
        """The step of the final model the coordinator holds and serves, -1 if none."""
        return self.step if self.state == "saved" else -1

    def phase(self) -> FinalState:
        """What members are told of the final model (HeartbeatReply.final): see protocol/coordination.py."""
        if self.state == "saved":
            return "saved"
        if self.keep and self.finished and not self.state:
            return "collecting"
        return ""

    def saved(self, step: int) -> None:
        """The adapter holds the model after ``step`` and serves it."""
        self.step = step
        self.state = "saved"

    def failed(self) -> None:
        """The adapter gave up fetching it; members leave with their checkpoints."""
        self.state = "failed"
