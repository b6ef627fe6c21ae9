"""The shape both short spec grammars share (boundary codecs, :mod:`protolearn.codec_spec`; replica-sync
compression, :mod:`protolearn.sync_spec`): ``name [":" argument]``, a bounded length, and a one-line
refusal that names the field and what is allowed. Each grammar keeps its own names and arguments."""

from __future__ import annotations

from collections.abc import Container


def split_spec(spec: object, *, field: str, names: Container[str], with_argument: Container[str], max_chars: int,
               allowed: str, error: type[Exception]) -> tuple[str, bool, str]:
    """``spec``'s (name, whether an argument follows, the argument); refuses with ``error`` a spec that is not a
    string, longer than ``max_chars``, or whose name is not in ``names`` (or carries an argument it takes none of)."""
    if not isinstance(spec, str):
        raise error(f"{field} must be a string, got {type(spec).__name__}; {allowed}")
    if len(spec) > max_chars:
        raise error(f"{field}={spec[:max_chars]!r}... is longer than {max_chars} characters; {allowed}")
    name, sep, arg = spec.partition(":")
    if name not in names or (sep and name not in with_argument):
        raise error(f"{field}={spec!r} is unknown; {allowed}")
    return name, bool(sep), arg
