"""How many tickets (microbatches) one optimizer step may have.

A step's tickets travel together in one coordinator message (a replica that asks for its whole step to be redone
names them all: ``protocol/coordination.py``'s ``Redo``), so the run config refuses a step with more
(``stages/config.py``). Both read it from here: ``stages`` may not import ``protocol``. At this bound a redo of a
whole step is about 200 KB of msgpack, well inside a request's size limit.
"""

from __future__ import annotations

MAX_TICKETS_PER_STEP = 65_536
