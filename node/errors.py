"""Errors of a volunteer node. The CLI prints each as one line and exits non-zero."""

from protolearn.errors import ProtolearnError


class NodeError(ProtolearnError):
    """Base of the errors a node raises on purpose."""


class JoinError(NodeError):
    """The node could not join: coordinator unreachable, wrong peer id, or a run it cannot train."""


class StateSyncError(NodeError):
    """No live replica could hand over a stage state that matches the hash the replicas report."""


class Banned(NodeError):
    """The coordinator banned this node (its reason says why); it cannot rejoin the run."""


class IdentityInUse(NodeError):
    """Another process with this node's identity key joined in its place; one identity runs in one process."""


class SelfTestError(NodeError):
    """This node's stage output on the run's self-test input differs from its replicas': a faulty device."""


class AveragingError(NodeError):
    """A collective round did not finish; the message names the missing peers, and ``causes`` the participants
    whose statements or silence ended it (the round's :attr:`Failed.missing`)."""

    def __init__(self, message: str, causes: tuple[str, ...] = ()) -> None:
        super().__init__(message)
        self.causes = causes


class ResultGone(AveragingError):
    """The participants no longer keep that round's result (they moved on): the caller must resync."""
