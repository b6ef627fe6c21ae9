"""Where the commands' log lines go: files that survive a full disk, warnings above the status line, and
py-libp2p's repeats digested.

- :class:`SafeFileHandler`: a log file that stops writing, and says so once, when its disk fills up or
  it becomes unwritable (logging's own handler prints a traceback per failed line: about 70 lines for
  one full disk).
- :class:`SayHandler`: warnings and errors for the terminal, handed to a ``say`` function (the node's
  :class:`~protolearn.node.progress.Progress`), which prints them above its live status line instead of
  gluing them onto it; digested like py-libp2p's (below), so a retry loop does not flood it.
- :class:`RepeatDigest`: a filter for py-libp2p's records. Its first record of a kind (logger and
  message template) in an interval passes; the rest are counted, and the next one after the interval
  carries the count (``... (and 373 more like it in 10 s)``). A coordinator that is down made a node
  log 374 ``Failed to open TCP stream`` errors in 25 s; now that is a few lines. The same rule as the
  transport's rejection log (:mod:`protolearn.protocol.log_digest`).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from pathlib import Path

# py-libp2p's repeats of one kind of record pass once per this many seconds.
REPEAT_INTERVAL_S = 10.0
# Kinds tracked at once (older ones are forgotten: a kind seen again simply passes again).
MAX_KINDS = 256
LINE_FORMAT = "%(asctime)s %(levelname)s %(name)s %(message)s"


class SafeFileHandler(logging.FileHandler):
    """A log file; on a write error (full disk, unwritable) it stops and calls ``on_error`` once."""

    def __init__(self, path: Path, on_error: Callable[[str], None]) -> None:
        super().__init__(path, encoding="utf-8", delay=False)
        self._on_error = on_error
        self.failed = False

    def emit(self, record: logging.LogRecord) -> None:
        if not self.failed:
            super().emit(record)

    def handleError(self, record: logging.LogRecord) -> None:  # noqa: N802 - logging's name
        if self.failed:
            return
        self.failed = True
        why = "it could not be written"
        import sys

        err = sys.exc_info()[1]
        if isinstance(err, OSError):
            why = err.strerror or str(err)
        self._on_error(f"warning: stopped writing the log {self.baseFilename}: {why}; the process goes on without it")


class SayHandler(logging.Handler):
    """Hands each record, formatted as one line, to ``say``."""

    def __init__(self, say: Callable[[str], None], level: int = logging.WARNING) -> None:
        super().__init__(level)
        self._say = say
        self.setFormatter(logging.Formatter("%(levelname)s %(message)s"))

    def emit(self, record: logging.LogRecord) -> None:
        try:
            self._say(self.format(record))
        except Exception:  # noqa: BLE001 - a log line must never take the process down
            self.handleError(record)


class RepeatDigest(logging.Filter):
    """Lets the first record of each kind per interval through and counts the rest (see the module docstring)."""

    def __init__(self, interval_s: float = REPEAT_INTERVAL_S, clock: Callable[[], float] = time.monotonic) -> None:
        super().__init__()
        self.interval_s = interval_s
        self.clock = clock
        # kind → (start of its interval, records held back in it)
        self._kinds: dict[tuple[str, str], tuple[float, int]] = {}

    def filter(self, record: logging.LogRecord) -> bool:
        kind = (record.name, str(record.msg))
        now = self.clock()
        start, held = self._kinds.get(kind, (None, 0))
        if start is not None and now - start < self.interval_s:
            self._kinds[kind] = (start, held + 1)
            return False
        if held:
            record.msg = f"{record.msg} (and {held} more like it in the last {now - start:.0f} s)"  # type: ignore[operator]
        self._kinds.pop(kind, None)
        self._kinds[kind] = (now, 0)
        if len(self._kinds) > MAX_KINDS:
            del self._kinds[next(iter(self._kinds))]
        return True


def quiet_libp2p(handlers: list[logging.Handler]) -> None:
    """py-libp2p's warnings and errors go to ``handlers`` only (never to a terminal), digested; its INFO
    records (a connection-manager tick every few seconds) go nowhere."""
    import libp2p.network.auto_connector  # noqa: F401 - it sets its logger to INFO when imported: first import it

    lib = logging.getLogger("libp2p")
    lib.setLevel(logging.WARNING)
    lib.propagate = False
    # Its AUTO_CONNECTOR_STATE tick, every few seconds, at INFO: the level comes from "libp2p" again.
    logging.getLogger("libp2p.network.auto_connector").setLevel(logging.NOTSET)
    digest = RepeatDigest()
    for handler in handlers:
        handler.addFilter(digest)
        lib.addHandler(handler)


def configure_node_logging(path: Path, say: Callable[[str], None]) -> SafeFileHandler:
    """INFO and up to the node's log file; warnings and errors to ``say`` (above the status line)."""
    root = logging.getLogger("protolearn")
    root.setLevel(logging.INFO)
    root.propagate = False  # the handlers below are the only ones; no duplicate lines via the root logger
    file_handler = SafeFileHandler(path, say)
    file_handler.setFormatter(logging.Formatter(LINE_FORMAT))
    root.addHandler(file_handler)
    # The terminal gets one of each kind of warning per interval: a coordinator that is away makes
    # every retry warn (the file keeps them all).
    terminal = SayHandler(say)
    terminal.addFilter(RepeatDigest())
    root.addHandler(terminal)
    # A separate handler on the same file for py-libp2p: it is digested, and a failed peer dial (a peer
    # that left is normal here) is no news for the terminal.
    lib_file = SafeFileHandler(path, lambda line: None)
    lib_file.setLevel(logging.WARNING)
    lib_file.setFormatter(logging.Formatter(LINE_FORMAT))
    quiet_libp2p([lib_file])
    return file_handler


def configure_stderr_logging(level: str) -> None:
    """A command that logs to stderr (the coordinator): ``level`` and up, py-libp2p's warnings digested."""
    import sys

    logging.basicConfig(stream=sys.stderr, level=level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    handler = logging.StreamHandler(sys.stderr)
    handler.setLevel(logging.WARNING)
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    quiet_libp2p([handler])
