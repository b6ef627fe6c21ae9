"""The expiry notes (coordinator/core/deadlines.py): one note per key, due oldest first, moved along by the caller."""

from __future__ import annotations

from protolearn.coordinator.core.deadlines import Notes


def test_a_key_has_one_note_and_comes_up_once_its_note_is_past_due() -> None:
    n = Notes([("a", 0.0)])
    n.note("b", 1.0)
    n.note("a", 5.0)  # it has one already: the older one stays
    assert len(n) == 2
    assert list(n.due(3.0, 3.0)) == []  # 3.0 - 0.0 is not more than 3.0
    assert list(n.due(4.5, 3.0)) == ["a", "b"]  # oldest first, and taken out
    assert len(n) == 0 and list(n.due(100.0, 3.0)) == []


def test_a_key_noted_again_while_due_comes_up_only_when_its_new_note_is_due() -> None:
    n = Notes([("a", 0.0), ("b", 0.5)])
    seen = []
    for key in n.due(10.0, 3.0):
        seen.append(key)
        if key == "a":
            n.note("a", 8.0)  # heard from at 8.0: not due at 10.0
    assert seen == ["a", "b"] and len(n) == 1
    assert list(n.due(11.5, 3.0)) == ["a"]
