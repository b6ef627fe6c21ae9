"""The commands' logging: a log file that survives a full disk, and repeats digested into one line."""

from __future__ import annotations

import errno
import logging
from pathlib import Path

from protolearn.cli.logs import RepeatDigest, SafeFileHandler


def test_repeats_of_one_kind_pass_once_per_interval_and_the_next_one_counts_them() -> None:
    now = [0.0]
    digest = RepeatDigest(interval_s=10.0, clock=lambda: now[0])

    def record(msg: str) -> logging.LogRecord:
        return logging.LogRecord("libp2p.transport.tcp.tcp", logging.ERROR, __file__, 1, msg, (), None)

    passed = []
    for t in range(25):
        now[0] = float(t)
        r = record("Failed to open TCP stream")
        if digest.filter(r):
            passed.append(r.getMessage())
    assert passed == [
        "Failed to open TCP stream",
        "Failed to open TCP stream (and 9 more like it in the last 10 s)",
        "Failed to open TCP stream (and 9 more like it in the last 10 s)",
    ]
    assert digest.filter(record("another kind"))  # each kind has its own interval


def test_a_log_file_on_a_full_disk_stops_and_says_so_once(tmp_path: Path) -> None:
    said: list[str] = []
    handler = SafeFileHandler(tmp_path / "node.log", said.append)
    handler.setFormatter(logging.Formatter("%(message)s"))

    class FullDisk:
        def write(self, _: str) -> None:
            raise OSError(errno.ENOSPC, "No space left on device")

        def flush(self) -> None:
            raise OSError(errno.ENOSPC, "No space left on device")

    handler.stream.close()
    handler.stream = FullDisk()  # type: ignore[assignment]
    for _ in range(5):
        handler.emit(logging.LogRecord("protolearn.node", logging.INFO, __file__, 1, "a line", (), None))
    assert handler.failed and len(said) == 1 and "No space left on device" in said[0] and "goes on without it" in said[0]
    handler.stream = None  # type: ignore[assignment]
    handler.close()
