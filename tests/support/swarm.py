"""The swarm as a user runs it: ``coordinator start`` and ``node join`` through the CLI, on 127.0.0.1.

:class:`Swarm` is the :class:`~protolearn.supervisor.Supervisor` that ``protolearn demo`` runs its swarm
with, plus what the end-to-end tests wait on; the ``swarm`` fixture (``tests/conftest.py``) writes a
:data:`TINY` run config and stops every process at the end.
"""

from __future__ import annotations

import json
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

from protolearn.supervisor import Supervisor
from tests.support.cli import CLI
from tests.support.waiting import wait_for

T = TypeVar("T")

DEADLINE_S = 240.0

TINY = """
name = "tiny"
seed = 0
steps = {steps}
codec = "{codec}"
[model]
vocab_size = 259
d_model = 64
n_layers = {layers}
n_heads = 4
d_ff = 128
max_seq_len = 64
[stages]
num_stages = {stages}
[batch]
microbatches_per_step = 4
microbatch_size = 4
seq_len = 32
[optim]
warmup_steps = 2
total_steps = {steps}
[data]
max_bytes = 200000
"""

# A run for `protolearn demo --config` (the demo chooses stages and steps itself).
DEMO_TOML = """
name = "tiny"
steps = 100
[model]
d_model = 64
n_layers = 2
n_heads = 4
d_ff = 128
max_seq_len = 64
[batch]
microbatches_per_step = 4
microbatch_size = 4
seq_len = 32
[data]
max_bytes = 200000
"""


class Swarm(Supervisor):
    """A coordinator and nodes started through the CLI, logs under ``tmp``; :meth:`stop` ends them all."""

    def __init__(self, tmp: Path, config: Path) -> None:
        super().__init__(tmp)
        self.tmp = tmp
        self.config = config

    def start_coordinator(self, *extra: str) -> str:
        """Start ``coordinator start`` (``extra``: more of its options) and return the address it prints."""
        self.spawn("coord", *self.coordinator_args(self.config, self.tmp / "coord", "/ip4/127.0.0.1/tcp/0", *extra))
        return self.wait_address("coord")

    def wait_address(self, name: str) -> str:
        """The first line process ``name`` prints (a coordinator prints its address), within 90 s."""
        return self.wait_first_line(name, 90)

    def start_node(self, name: str, addr: str, *extra: str) -> subprocess.Popen:
        return self.spawn(name, *self.node_args(name, addr, *extra))

    def wait_nodes(self, names: list[str], timeout: float) -> None:
        """Every node in ``names`` exits 0 within ``timeout`` seconds."""
        deadline = time.monotonic() + timeout
        for n in names:
            try:
                rc = self.procs[n].wait(timeout=max(1.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                raise AssertionError(f"{n} did not finish in {timeout:.0f} s: {self.err(n)}{self._exited_early()}") from None
            assert rc == 0, f"{n} exited {rc}: {self.err(n)}"

    def _exited_early(self) -> str:
        """The processes that already exited with an error (not a test's SIGKILL), each with its error tail:
        often what a hang waited on."""
        failed = [(n, p.returncode) for n, p in self.procs.items() if (p.poll() or 0) > 0]
        return "".join(f"\n--- meanwhile {n} exited {rc}: {self.err(n)}" for n, rc in failed)


    def wait_alive(self, what: str, check: Callable[[], T], timeout: float, *names: str) -> T:
        """``check()``'s first truthy value within ``timeout``, failing at once if one of ``names`` exits."""
        def alive_then_check() -> T:
            for n in names:
                assert self.procs[n].poll() is None, f"{n} exited {self.procs[n].returncode} while waiting for {what}: {self.err(n)}"
            return check()

        return wait_for(what, alive_then_check, timeout, every=0.05)


def reference_losses(config: Path, steps: int, tmp: Path, *extra: str) -> list[float]:
    """The single-process reference trainer's loss at each step of the run ``config``."""
    log = tmp / f"ref{len(extra)}.jsonl"
    subprocess.run([*CLI, "train-local", "--config", str(config), "--steps", str(steps), "--threads", "1", "--log", str(log),
                    "--eval-every", "1000", *extra], check=True, capture_output=True, timeout=DEADLINE_S)
    return [d["loss"] for d in map(json.loads, log.read_text().splitlines()) if d.get("event") == "step"]
