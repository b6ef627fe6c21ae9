"""Living with py-libp2p's errors: the reason a failure hides, and stream IO that must not raise.

py-libp2p hides a failed dial's reason in a ``MultiError`` under the error's cause (:func:`causes`
walks it, so a dial can tell a peer ID mismatch from an unreachable address), its messages can be long
or empty (:func:`why` makes one short line of any error), and a cancelled nursery wraps one error in
nested exception groups (:func:`single_leaf` unwraps it, so ``open_host`` raises what its body raised).
:func:`reset_quietly` aborts a stream whose connection may already be gone, bounded and best effort.
"""

from __future__ import annotations

from collections.abc import Iterator

import trio
from libp2p.abc import INetStream
from libp2p.exceptions import BaseLibp2pError


def causes(err: BaseException, depth: int = 0) -> Iterator[BaseException]:
    """``err`` and what it wraps: py-libp2p hides a failed dial's reason in a MultiError under its cause."""
    yield err
    if depth >= 8:
        return
    for inner in getattr(err, "errors", None) or ():
        if isinstance(inner, BaseException):
            yield from causes(inner, depth + 1)
    nested = err.__cause__ or (None if err.__suppress_context__ else err.__context__)
    if nested is not None:
        yield from causes(nested, depth + 1)


def why(err: BaseException) -> str:
    """One line of at most 300 characters saying what ``err`` is."""
    text = str(err) or type(err).__name__
    return text if len(text) <= 300 else text[:300] + "..."


def single_leaf(group: BaseExceptionGroup) -> BaseException | None:
    """The one exception inside nested single-member groups, else None."""
    exc: BaseException = group
    while isinstance(exc, BaseExceptionGroup):
        if len(exc.exceptions) != 1:
            return None
        exc = exc.exceptions[0]
    return exc


async def reset_quietly(raw: INetStream, timeout: float) -> None:
    """Abort ``raw`` in both directions, best effort and bounded: the connection may already be gone."""
    with trio.move_on_after(timeout):
        try:
            await raw.reset()
        except (BaseLibp2pError, OSError):
            pass


__all__ = ["causes", "reset_quietly", "single_leaf", "why"]
