"""What leaves a replica: one filter that every tensor it sends passes through on its way out.

The router hands :meth:`Outbound.tensor` each activation (``fwd``) and gradient (``bwd``) before it
encodes and signs it, and integrity each spot-check result it serves (``check=True``); the averager
gives the collective :attr:`Outbound.part_filter`, which the round applies to each part this replica
reduces before signing it. :meth:`Outbound.withholds` says, per step, whether this replica takes
leases and activations and then never answers (no ticket started, nothing sent on).

A node is built with one filter and its parts get it in their constructors. An honest node's is
:data:`PASS_THROUGH`: it sends everything as computed and withholds nothing. Tests and benchmarks
inject others (``node join --adversary``, :mod:`protolearn.node.adversary`) to check that the swarm
catches and expels a replica that lies, without a branch for that in the code that honest nodes run.
"""

from __future__ import annotations

import torch
from protolearn.protocol.collective import PartFilter


class Outbound:
    """The pass-through filter; a subclass overrides what it changes."""

    # Applied by the collective to each part this replica reduces; None: parts go as reduced.
    part_filter: PartFilter | None = None

    def tensor(self, t: torch.Tensor, step: int, ticket: int, direction: str, *, check: bool = False) -> torch.Tensor:
        """The tensor to send instead of ``t``: this replica's ``direction`` output of (step, ticket),
        on the pipeline or (``check``) as the result of a spot check it serves."""
        return t

    def withholds(self, step: int) -> bool:
        """Whether this replica takes work of ``step`` and never answers it."""
        return False


PASS_THROUGH = Outbound()
