"""Running a command's async main under trio so that a project error reaches the user as one line.

trio wraps errors from nursery children in (nested) exception groups; the CLI wants the first
:class:`~protolearn.errors.ProtolearnError` inside, re-raised on its own, so ``main()`` prints one
line. Anything else is a bug and keeps its traceback.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import trio

from protolearn.errors import ProtolearnError

T = TypeVar("T")


def first_project_error(err: BaseException) -> ProtolearnError | None:
    """The first ProtolearnError inside a (possibly nested) exception group."""
    if isinstance(err, ProtolearnError):
        return err
    if isinstance(err, BaseExceptionGroup):
        for sub in err.exceptions:
            found = first_project_error(sub)
            if found is not None:
                return found
    return None


def run_trio(main: Callable[..., Awaitable[T]], *args: Any) -> T:
    """``trio.run(main, *args)``, unwrapping a project error from any exception group."""
    try:
        return trio.run(main, *args)
    except BaseExceptionGroup as group:
        err = first_project_error(group)
        if err is None:
            raise
        raise err from None
