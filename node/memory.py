"""How much memory a node offers its stage, and how much its process really uses.

A node tells the coordinator at join how much memory its stage may use (:func:`offered_memory`), and the
coordinator places it only in a stage whose estimated footprint (``stages/footprint.py``) fits:

- ``--max-memory SIZE`` (``8GB``, ``512MiB``: :func:`parse_size`) caps it;
- on CUDA it is the device's free memory (``torch.cuda.mem_get_info``), or the cap if that is lower;
- on the CPU without a cap it says nothing (0), which the coordinator reads as "unconstrained".

:class:`ResidentMemory` reads this process's resident set from ``/proc/self/status``, and resets its peak
through ``/proc/self/clear_refs`` (Linux), so the growth a stage causes can be checked against its estimate
(``tests/unit/test_footprint.py``).
"""

from __future__ import annotations

import re
from pathlib import Path

import torch

UNITS = {"b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12, "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([a-z]+)\s*$", re.IGNORECASE)


def parse_size(text: str) -> int:
    """``8GB`` → 8e9 bytes (KB/MB/GB/TB are powers of 1000, KiB/MiB/GiB/TiB of 1024); else ValueError."""
    m = _SIZE.match(text)
    unit = UNITS.get(m.group(2).lower()) if m else None
    if m is None or unit is None:
        raise ValueError(f"{text!r} is not a size; give a number and a unit, e.g. 8GB or 512MiB")
    size = int(float(m.group(1)) * unit)
    if size <= 0:
        raise ValueError(f"{text!r} is no memory at all; give the memory this node may use, e.g. 8GB")
    return size


def offered_memory(device: str, max_memory: int | None) -> int:
    """The bytes this node offers its stage on ``device`` (resolved); 0: not said (see the module docstring)."""
    dev = torch.device(device)
    free = int(torch.cuda.mem_get_info(dev)[0]) if dev.type == "cuda" else None
    if max_memory is None:
        return free or 0
    return max_memory if free is None else min(max_memory, free)


class ResidentMemory:
    """This process's resident memory: now, and its peak since :meth:`reset_peak` (Linux; 0 elsewhere)."""

    def __init__(self, status: Path = Path("/proc/self/status"), clear_refs: Path = Path("/proc/self/clear_refs")) -> None:
        self._status, self._clear = status, clear_refs

    def _read(self, key: str) -> int:
        try:
            for line in self._status.read_text().splitlines():
                if line.startswith(key):
                    return int(line.split()[1]) * 1024
        except (OSError, ValueError, IndexError):
            return 0
        return 0

    def now(self) -> int:
        return self._read("VmRSS:")

    def peak(self) -> int:
        return self._read("VmHWM:")

    def reset_peak(self) -> bool:
        """Make the peak the current resident size; False where the kernel does not allow it."""
        try:
            self._clear.write_text("5")
        except OSError:
            return False
        return True
