"""The root of every error protolearn raises on purpose.

Each package derives its own hierarchy from :class:`ProtolearnError`. The CLI catches this root and
prints one line, so the message of every subclass must say what went wrong and what to do.
"""


class ProtolearnError(Exception):
    """Base class of all deliberate protolearn errors."""


class ConfigError(ProtolearnError):
    """A run or node configuration is missing, malformed or impossible."""
