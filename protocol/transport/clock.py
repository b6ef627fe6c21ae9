"""The transport's one clock: every time reading of ``protocol/transport/`` goes through a :data:`Clock`.

What reads it: the host's rejection and refusal log intervals (``host.py``, ``host.clock``), the
bulk lane's offer expiry and its "lane unreachable" marks (``bulk.py``), and the per-chunk deadline
of a lane transfer (``seal.py``). The deadlines trio enforces around stream IO (``fail_after`` /
``move_on_after``) are not clock reads of ours: they follow trio's own clock, which
``trio.run(clock=...)`` injects.

A clock is any callable that returns seconds as a float, never goes backwards, and can be called
from **any thread**. :func:`open_host` takes one (``clock=``) and hands it to every reader, so a test
can expire an offer or an unreachable mark by advancing a fake clock instead of waiting.

Why the default is :func:`time.monotonic` and not ``trio.current_time``: the lane's chunk loops run
in worker threads, where ``trio.current_time`` raises RuntimeError (it works only in the trio
thread), and their deadline is enforced with socket timeouts, which count real seconds. One clock
for both sides keeps offer lifetimes and chunk deadlines on one time scale. Only durations are ever
compared, and ``time.monotonic`` advances at the same rate as trio's default clock, so a real run
behaves exactly as when ``bulk.py`` and the rejection log read ``trio.current_time``.
"""

from __future__ import annotations

import time
from collections.abc import Callable

Clock = Callable[[], float]

MONOTONIC: Clock = time.monotonic

__all__ = ["MONOTONIC", "Clock"]
