"""The task-tree lookup gives py-libp2p's own walk's answer (protocol/transport/task_tree.py)."""

from __future__ import annotations

import trio
from libp2p.tools.anyio_service import Service, background_trio_service
from libp2p.tools.anyio_service.trio_manager import TrioManager

from protolearn.protocol.transport import task_tree

task_tree.install()


class _Tree(Service):
    """Starts a tree of tasks (depth 3, two children each) and records both answers from inside each one."""

    def __init__(self) -> None:
        self.answers: list[tuple[object, object]] = []
        self.started = 0
        self.all_started = trio.Event()
        self.release = trio.Event()

    async def run(self) -> None:
        self.manager.run_task(self._node, 0)
        await self.release.wait()

    async def _node(self, depth: int) -> None:
        manager = self.manager
        assert isinstance(manager, TrioManager)
        me = trio.lowlevel.current_task()
        self.answers.append((task_tree.find_parent(manager, me), task_tree.walk(manager, me)))
        if depth < 3:
            for _ in range(2):
                manager.run_task(self._node, depth + 1)
        self.started += 1
        if self.started == 15:
            self.all_started.set()
        await self.release.wait()


def test_the_lookup_finds_the_same_parent_as_the_walk_inside_the_tree_and_none_outside_it() -> None:
    async def main() -> None:
        with trio.fail_after(10):
            tree, other = _Tree(), _Tree()
            async with background_trio_service(tree) as manager, background_trio_service(other) as other_manager:
                await tree.all_started.wait()
                await other.all_started.wait()
                assert len(tree.answers) == 15
                for found, walked in tree.answers:
                    assert found is not None and found is walked
                # The test's own task runs no task of either tree; a task of one service is no parent in another's.
                me = trio.lowlevel.current_task()
                assert task_tree.find_parent(manager, me) is None is task_tree.walk(manager, me)
                some = next(iter(other_manager._root_tasks))
                assert task_tree.find_parent(manager, some.trio_task) is None is task_tree.walk(manager, some.trio_task)
                # A task that left its parent's children is no longer in the tree: both say so.
                leaf = tree.answers[-1][0]
                assert leaf is not None and leaf.parent is not None
                leaf.parent.discard_child(leaf)
                assert task_tree.find_parent(manager, leaf.trio_task) is None is task_tree.walk(manager, leaf.trio_task)
                leaf.parent.add_child(leaf)
                tree.release.set()
                other.release.set()

    trio.run(main)


def test_install_puts_the_lookup_in_py_libp2ps_manager() -> None:
    assert TrioManager._find_parent_task is task_tree.find_parent
