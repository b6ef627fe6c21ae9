"""Errors of the coordinator. A :class:`Refusal` is a request the coordinator turned down on purpose.

The service logs every refusal with the peer and the reason, and the transport sends it back to the
peer as an ``ErrorReply`` carrying :attr:`Refusal.code`, so a client can tell e.g. "not a member" (rejoin)
from "already completed" (drop the duplicate).
"""

from __future__ import annotations

from protolearn.errors import ConfigError, ProtolearnError


class CoordinatorError(ProtolearnError):
    """Base of the coordinator's errors."""


class Refusal(CoordinatorError):
    """A request refused with a stable ``code`` and a human ``reason``; state is left unchanged."""

    def __init__(self, code: str, reason: str) -> None:
        super().__init__(f"{code}: {reason}")
        self.code = code
        self.reason = reason


class Unreachable(CoordinatorError):
    """The coordinator could not be reached at the given address."""


class StoreError(CoordinatorError):
    """The data directory's database cannot be opened, read or written."""


class RunMismatch(ConfigError):
    """The run config given does not match the run persisted in the data directory."""
