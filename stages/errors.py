"""Errors of the stages package. Config problems use :class:`protolearn.errors.ConfigError`."""

from protolearn.errors import ProtolearnError


class StagesError(ProtolearnError):
    """Base of the errors a stage module raises on purpose."""


class StageInputError(StagesError):
    """A stage got tokens, targets, hidden states or gradients of the wrong dtype, shape or range."""


class MicrobatchStateError(StagesError):
    """A microbatch id is unknown (no forward, or already backwarded/discarded) or already in flight."""
