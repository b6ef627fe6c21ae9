"""What a node tells its user: a live status line and a JSON-lines log.

The status line shows stage, step (of the run's), state, loss (last stage), tokens/s, peers and
in-flight count, and, when it applies, how long the coordinator has been unreachable and what training
waits for. On a terminal it is redrawn in place with rich; otherwise (a log file, the demo's pipes) a
plain line is printed at most every ``plain_every_s``. Events (join, sync, step applied, errors) go to
the JSON-lines log, one object per line with ``t`` (unix time) and ``event``, so tests and tools can
follow a run.

A full disk (or a log that becomes unwritable) must not stop training: the first failed write turns
the log off and says so once on the terminal; the status line goes on.
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any

from rich.console import Console
from rich.live import Live
from rich.text import Text

from protolearn.errors import ConfigError


# Fields whose change is printed at once on a plain (non-terminal) display.
PROMPT_FIELDS = frozenset({"stage", "state", "waiting"})
# Fields whose change between empty and set is printed at once (their text changes every second).
PROMPT_WHEN_SET = frozenset({"coordinator"})


class Progress:
    """Status line plus JSON-lines events. Use as a context manager."""

    def __init__(
        self, log_path: Path, *, name: str, live: bool | None = None, plain_every_s: float = 5.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """``clock`` paces the plain display (it is built before trio runs, so not trio's clock)."""
        self.log_path = log_path
        self.name = name
        self.fields: dict[str, Any] = {
            "stage": "-", "num_stages": 0, "step": 0, "steps": 0, "state": "joining", "loss": None, "tokens_per_s": 0.0,
            "peers": 0, "in_flight": 0, "waiting": "", "coordinator": "",
        }
        # The events logged so far (by name): the CLI tells "interrupted before it joined" apart.
        self.seen: set[str] = set()
        self._console = Console(stderr=True)
        self._live_enabled = sys.stderr.isatty() if live is None else live
        self._live: Live | None = None
        self._file: IO[str] | None = None
        self._plain_every_s = plain_every_s
        self._clock = clock
        self._last_plain = 0.0

    def __enter__(self) -> Progress:
        try:
            self.log_path.parent.mkdir(parents=True, exist_ok=True)
            self._file = self.log_path.open("a", encoding="utf-8")
        except OSError as err:
            raise ConfigError(f"cannot write the node's log {self.log_path}: {err.strerror or err}; use a writable --data-dir") from None
        if self._live_enabled:
            self._live = Live(self._render(), console=self._console, refresh_per_second=4, transient=False)
            self._live.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Stop the live status line (restoring the terminal) and close the event log."""
        if self._live is not None:
            self._live.__exit__(None, None, None)
            self._live = None
        if self._file is not None:
            self._file.close()
            self._file = None

    def event(self, event: str, **fields: Any) -> None:
        """Append one JSON line (flushed, so another process can follow the file)."""
        self.seen.add(event)
        if self._file is None:
            return
        try:
            self._file.write(json.dumps({"t": round(time.time(), 3), "event": event, **fields}) + "\n")
            self._file.flush()
        except OSError as err:
            # Full disk: drop the log, keep training. (Closing flushes again and fails again: ignore that.)
            file, self._file = self._file, None
            try:
                file.close()
            except OSError:
                pass
            self.say(f"warning: stopped writing the event log {self.log_path}: {err.strerror or err}; training goes on without it")

    def say(self, line: str) -> None:
        """A one-off message above the status line."""
        self._console.print(line, highlight=False, soft_wrap=True)

    def update(self, **fields: Any) -> None:
        # Without a terminal the line is printed every few seconds, but at once when what the node does
        # changes: a node that stops at "waiting: stage 1 has no replicas" must not keep showing "joining".
        changed = any(
            (k in PROMPT_FIELDS and self.fields.get(k) != v) or (k in PROMPT_WHEN_SET and bool(self.fields.get(k)) != bool(v))
            for k, v in fields.items()
        )
        self.fields.update(fields)
        if self._live is not None:
            self._live.update(self._render())
            return
        now = self._clock()
        if changed or now - self._last_plain >= self._plain_every_s:
            self._last_plain = now
            self._console.print(self._render(), highlight=False, soft_wrap=True)

    def _render(self) -> Text:
        f = self.fields
        loss = "-" if f["loss"] is None else f"{f['loss']:.4f}"
        # A stage is an index (0-based, as swarm status shows it), so its range is shown, not a count.
        stage = f"{f['stage']} of 0-{f['num_stages'] - 1}" if f["num_stages"] > 1 else str(f["stage"])
        step = f"{f['step']}/{f['steps']}" if f["steps"] else str(f["step"])
        return Text(
            f"{self.name}  stage {stage}  step {step}  {f['state']:<9}  loss {loss}  "
            f"{f['tokens_per_s']:,.0f} tok/s  peers {f['peers']}  in-flight {f['in_flight']}"
            + (f"  {f['coordinator']}" if f["coordinator"] else "")
            + (f"  waiting: {f['waiting']}" if f["waiting"] else "")
        )
