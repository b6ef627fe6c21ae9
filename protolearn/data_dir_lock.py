"""One process per data dir: an exclusive lock on ``<data dir>/lock``, held while the process runs.

A data dir holds an identity key, and one identity is one process: two processes with the same peer ID
answer each other's streams, leave each other's swarm membership and rejoin in a loop (and a node in
the coordinator's data dir takes the coordinator's own peer ID). So ``node join`` and ``coordinator
start`` take this lock before they touch the key, and a second process on the same data dir stops at
once with one line naming the first one.

The lock is ``fcntl.flock`` on a small file that also records who holds it (pid and command line), for
that error line. The kernel drops a flock when its process dies, SIGKILL included, so a crashed process
never leaves a stale lock behind; the file itself stays and is simply locked again by the next process.
"""

from __future__ import annotations

import fcntl
import os
import sys
from pathlib import Path
from types import TracebackType

from protolearn.errors import ConfigError, ProtolearnError

LOCK_FILE = "lock"
# What the lock file says of its holder is read back for the error line; a longer one is cut.
MAX_HOLDER_TEXT = 512


class DataDirInUse(ProtolearnError):
    """Another running process holds the data dir's lock; the message names it and says what to do."""


def _holder_text() -> str:
    argv = [os.path.basename(sys.argv[0]) if sys.argv else "python", *sys.argv[1:]]
    if argv and argv[0] in ("main.py", "__main__.py", "-m", "-c"):
        argv[0] = "protolearn"
    return f"{os.getpid()} {' '.join(argv)}"[:MAX_HOLDER_TEXT]


class DataDirLock:
    """Hold ``data_dir``'s lock for a ``with`` block; raises :class:`DataDirInUse` if another process has it.

    ``what`` names the flag a user changes to run a second process (e.g. ``"--name or --data-dir"``).
    """

    def __init__(self, data_dir: Path, *, what: str = "--data-dir") -> None:
        self.data_dir = Path(data_dir)
        self.path = self.data_dir / LOCK_FILE
        self.what = what
        self._fd: int | None = None

    def acquire(self) -> None:
        try:
            self.data_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o600)
        except OSError as err:
            raise ConfigError(f"cannot use data dir {self.data_dir}: {err.strerror or err}; check that it is a writable folder, or pass another {self.what}") from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _read_holder(fd)
            os.close(fd)
            pid, _, cmd = holder.partition(" ")
            who = f"process {pid} ({cmd})" if pid.isdigit() and cmd else f"process {pid}" if pid.isdigit() else "another process"
            raise DataDirInUse(
                f"data dir {self.data_dir} is in use by {who}: one identity runs in one process; stop that one, or give this one its own {self.what}"
            ) from None
        except OSError as err:
            os.close(fd)
            raise DataDirInUse(f"cannot lock data dir {self.data_dir}: {err.strerror or err}") from None
        try:
            os.ftruncate(fd, 0)
            os.pwrite(fd, (_holder_text() + "\n").encode(), 0)
        except OSError:
            pass  # a full disk: the lock holds all the same, only the error line of a second process is vaguer
        self._fd = fd

    def release(self) -> None:
        if self._fd is not None:
            fcntl.flock(self._fd, fcntl.LOCK_UN)
            os.close(self._fd)
            self._fd = None

    def __enter__(self) -> DataDirLock:
        self.acquire()
        return self

    def __exit__(self, kind: type[BaseException] | None, err: BaseException | None, tb: TracebackType | None) -> None:
        self.release()


def _read_holder(fd: int) -> str:
    try:
        return os.pread(fd, MAX_HOLDER_TEXT, 0).decode("utf-8", "replace").strip()
    except OSError:
        return ""
