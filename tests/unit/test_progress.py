"""The node's progress line without a terminal: throttled, but a change of what the node does shows at once."""

from __future__ import annotations

from pathlib import Path

import pytest

from protolearn.node.progress import Progress


def test_a_plain_display_prints_state_and_waiting_changes_at_once(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with Progress(tmp_path / "node.jsonl", name="node", live=False, plain_every_s=3600.0) as p:
        p.update(stage="0/2")  # the first line
        p.update(step=1, tokens_per_s=5.0)  # throttled: nothing new to say
        p.update(state="training", waiting="stage 1 has no replicas")
        p.update(waiting="stage 1 has no replicas")  # unchanged: not printed again
    lines = [ln for ln in capsys.readouterr().err.splitlines() if ln.startswith("node")]
    assert len(lines) == 2, lines
    assert "stage 0/2" in lines[0] and "joining" in lines[0]
    assert "training" in lines[1] and lines[1].endswith("waiting: stage 1 has no replicas")


def test_a_full_disk_turns_the_event_log_off_says_so_once_and_the_status_line_goes_on(
    tmp_path: Path, capsys: pytest.CaptureFixture[str],
) -> None:
    import errno

    class FullDisk:
        def write(self, _: str) -> int:
            raise OSError(errno.ENOSPC, "No space left on device")

        def flush(self) -> None:
            raise OSError(errno.ENOSPC, "No space left on device")

        def close(self) -> None:
            raise OSError(errno.ENOSPC, "No space left on device")

    with Progress(tmp_path / "node.jsonl", name="node", live=False, plain_every_s=0.0) as p:
        assert p._file is not None
        p._file.close()
        p._file = FullDisk()  # type: ignore[assignment]
        for step in range(3):
            p.event("step", step=step)
            p.update(step=step + 1, steps=3)
        assert "step" in p.seen
    err = capsys.readouterr().err
    assert err.count("stopped writing the event log") == 1 and "No space left on device" in err
    assert "step 3/3" in err  # the status line went on
