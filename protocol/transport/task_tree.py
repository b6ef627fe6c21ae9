"""py-libp2p's service task tree: find the task a new one is started from in O(depth), not O(all tasks).

py-libp2p 0.8's ``TrioManager.run_task`` makes the new task a child of the task that starts it, and finds
that task by walking **every** task of the service (``_find_parent_task``). Its swarm starts two tasks per
new connection, and holds a few per live connection, so each connection cost the walk of every other one: at
3,500 members that walk was 8.5 % of the coordinator's CPU (py-spy over a ramp of ``bench.py
coordinator-net``), and a join's cost grew with the members.

:func:`install` keeps, for each of py-libp2p's function tasks, the trio task that runs it, so the parent is
found by a lookup. The answer is the walk's: the task found counts only while it is still in *this*
manager's tree (each link from it up to a root still held by its parent, the root by the manager), so a task
started from a task of another service, or from one that has left its tree, is a new root as before
(``tests/unit/test_task_tree.py`` holds the two to the same answers).
"""

from __future__ import annotations

import weakref
from typing import Any

import trio
from libp2p.tools.anyio_service.trio_manager import TrioManager
from libp2p.tools.anyio_service.trio_tasks import FunctionTask

# The function task each running trio task runs (at most one: a function task runs in its own trio task).
_RUNNING: weakref.WeakKeyDictionary[trio.lowlevel.Task, FunctionTask] = weakref.WeakKeyDictionary()
_WALK = TrioManager._find_parent_task


def find_parent(manager: TrioManager, trio_task: trio.lowlevel.Task) -> FunctionTask | None:
    """The function task of ``manager``'s tree that ``trio_task`` runs, or None (the new task is a root)."""
    task = _RUNNING.get(trio_task)
    if task is None:
        return None
    node: Any = task
    while node.parent is not None:
        if node not in node.parent.children:
            return None
        node = node.parent
    return task if node in manager._root_tasks else None


def _set_trio_task(self: FunctionTask, value: trio.lowlevel.Task) -> None:
    _SETTER(self, value)
    _RUNNING[value] = self


_PROPERTY = FunctionTask.__dict__["trio_task"]
_SETTER = _PROPERTY.fset


def install() -> None:
    """Replace the walk by the lookup (once; idempotent)."""
    if TrioManager._find_parent_task is not _WALK:
        return
    FunctionTask.trio_task = property(_PROPERTY.fget, _set_trio_task)  # type: ignore[method-assign]
    TrioManager._find_parent_task = find_parent  # type: ignore[method-assign]


def walk(manager: TrioManager, trio_task: trio.lowlevel.Task) -> FunctionTask | None:
    """py-libp2p's own walk, for tests that compare the two."""
    return _WALK(manager, trio_task)
