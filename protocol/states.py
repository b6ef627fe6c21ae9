"""What a member is doing, as its heartbeat says: one type from the node core to the coordinator's view.

A module of its own, without pydantic or msgpack, so that the node core (:mod:`protolearn.node.core`)
imports nothing but the standard library and its own pure siblings.
"""

from __future__ import annotations

from enum import StrEnum


class NodeState(StrEnum):
    SYNCING = "syncing"
    TRAINING = "training"
    AVERAGING = "averaging"
    LEAVING = "leaving"

    @property
    def live(self) -> bool:
        """A live replica serves its stage: it takes work and can donate its state."""
        return self in (NodeState.TRAINING, NodeState.AVERAGING)
