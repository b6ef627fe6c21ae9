"""What a collective round asks its adapter to do: the actions its events return.

:class:`~protolearn.protocol.collective.round.CollectiveRound` never does IO. Each event returns a list
of these, in order, for the adapter to carry out: :class:`Send` a part or a fin, :class:`Probe` a peer,
log a :class:`Rejected` message, and finally exactly one :class:`Done` or :class:`Failed`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

import torch

from protolearn.protocol.reducer_check import ReducerFault
from protolearn.protocol.statements import SignedStatement

Phase = Literal["scatter", "gather", "fin"]


@dataclass(frozen=True)
class Send:
    """Deliver ``data`` (part ``part`` of ``phase``; None for fin) to ``peer``; report back with
    :meth:`~.round.CollectiveRound.delivered` or :meth:`~.round.CollectiveRound.peer_failed`. A gather or
    fin carries its ``signer``, ``digest`` and ``signature`` (see :class:`~.header.PartHeader`)."""

    peer: str
    phase: Phase
    part: int
    data: torch.Tensor | None
    contributors: tuple[str, ...] = ()
    signer: str = ""
    digest: bytes = b""
    signature: bytes = b""
    inputs: bytes = b""
    vetoed: bytes = b""


@dataclass(frozen=True)
class Probe:
    """Check that ``peer`` is alive (open a stream, get an answer); report failure with ``peer_failed``."""

    peer: str


@dataclass(frozen=True)
class Rejected:
    """An incoming part was refused; the adapter logs it with the peer and the reason."""

    peer: str
    reason: str


@dataclass(frozen=True)
class Done:
    """The round finished: ``result`` is bit-identical on every honest survivor and sums exactly
    ``contributors``. ``digest`` is its result hash and ``signature`` this replica's signed fin of it."""

    result: torch.Tensor
    contributors: list[str] = field(default_factory=list)
    excluded: list[str] = field(default_factory=list)
    reason: str = "all parts gathered"
    digest: bytes = b""
    signature: bytes = b""


@dataclass(frozen=True)
class Failed:
    """The round cannot finish: ``missing`` peers did not deliver, or the replicas disagreed. When a peer
    signed two different stories, ``evidence`` holds both statements (checkable by a third party). When
    this replica vetoed a part its reducer got wrong, ``reducer_faults`` proves it
    (:func:`~protolearn.protocol.reducer_check.verify_reducer_fault`)."""

    missing: list[str]
    reason: str
    evidence: tuple[SignedStatement, ...] = ()
    reducer_faults: tuple[ReducerFault, ...] = ()


Action = Send | Probe | Rejected | Done | Failed
