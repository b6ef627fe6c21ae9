"""The replica-sync compression grammar: the one parser of ``[sync] compression`` strings.

How the replicas of a stage compress what they average (:mod:`protolearn.protocol.sync_compression`)::

    compression = "none" | "int8" | topk | powersgd
    topk        = "topk" [ ":" fraction ]     fraction: a float in (0, 1], default 0.01
    powersgd    = "powersgd" [ ":" rank ]     rank: an integer in 1..1024, default 4

``none`` averages the raw float32 gradients (the swarm then equals ``train-local``, I3). ``int8`` sends
every value as an int8 with one power-of-two scale per block; ``topk:F`` sends the fraction F of each
part's largest entries; both keep error feedback per replica. ``powersgd:R`` averages a rank-R
factorisation of every matrix gradient in two exact rounds.

This is not the boundary codec grammar (:mod:`protolearn.codec_spec`): a boundary codec encodes one
tensor that crosses a link, this compresses a replica's contribution to a collective round, so the two
have their own names and their own owners. It sits in the root package for the same reason: the run
config (``stages``) and the collective (``protocol``) both need it, and neither may import the other.
Pure: no torch, no trio, no libp2p. Every refusal is a one-line :class:`SyncSpecError`, also a
:class:`ValueError`, so a pydantic validator reports it as the field's value error.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from protolearn.errors import ConfigError
from protolearn.spec_grammar import split_spec

COMPRESSIONS = ("none", "int8", "topk", "powersgd")
DEFAULT_TOPK_FRACTION = 0.01
DEFAULT_POWERSGD_RANK = 4
MAX_POWERSGD_RANK = 1024
# A spec is short; a longer one is refused before it is parsed.
MAX_SPEC_CHARS = 32
_ALLOWED = (f"use one of {', '.join(COMPRESSIONS)} (or topk:F with 0 < F <= 1, e.g. topk:0.01, "
            f"or powersgd:R with R in 1..{MAX_POWERSGD_RANK}, e.g. powersgd:4)")


class SyncSpecError(ConfigError, ValueError):
    """A compression spec is not one of the known forms (a ValueError too, so pydantic validators accept it)."""


@dataclass(frozen=True)
class SyncCompression:
    """A parsed compression. ``str(spec)`` is its canonical form (``topk`` reads ``topk:0.01``)."""

    name: str
    fraction: float | None = None  # topk only
    rank: int | None = None  # powersgd only

    def __str__(self) -> str:
        if self.fraction is not None:
            return f"{self.name}:{self.fraction!r}"
        if self.rank is not None:
            return f"{self.name}:{self.rank}"
        return self.name

    @property
    def lossless(self) -> bool:
        return self.name == "none"


NONE = SyncCompression("none")


def parse_sync_compression(spec: object, *, field: str = "sync.compression") -> SyncCompression:
    """Parse ``none | int8 | topk[:F] | powersgd[:R]``; ``field`` names where the spec came from in the error."""
    name, sep, arg = split_spec(spec, field=field, names=COMPRESSIONS, with_argument=("topk", "powersgd"), max_chars=MAX_SPEC_CHARS,
                                allowed=_ALLOWED, error=SyncSpecError)
    if name == "topk":
        try:
            fraction = float(arg) if sep else DEFAULT_TOPK_FRACTION
        except ValueError:
            raise SyncSpecError(f"{field}={spec!r}: the fraction {arg!r} is not a number; {_ALLOWED}") from None
        if not (math.isfinite(fraction) and 0.0 < fraction <= 1.0):
            raise SyncSpecError(f"{field}={spec!r}: the fraction must be in (0, 1]; {_ALLOWED}")
        return SyncCompression("topk", fraction=fraction)
    if name == "powersgd":
        if sep and not (arg.isascii() and arg.isdigit()):
            raise SyncSpecError(f"{field}={spec!r}: the rank {arg!r} is not a positive integer; {_ALLOWED}")
        rank = int(arg) if sep else DEFAULT_POWERSGD_RANK
        if not 1 <= rank <= MAX_POWERSGD_RANK:
            raise SyncSpecError(f"{field}={spec!r}: the rank must be in 1..{MAX_POWERSGD_RANK}; {_ALLOWED}")
        return SyncCompression("powersgd", rank=rank)
    return SyncCompression(name)
