"""The codec spec grammar: the one parser of strings like ``int8`` or ``topk:0.05``.

A codec spec names an activation/gradient codec and its parameter::

    spec     = "none" | "fp16" | "bf16" | "int8" | topk | subspace
    topk     = "topk" [ ":" fraction ]          fraction: a float in (0, 1], default 0.05
    subspace = "subspace" [ ":" inner ]         inner: none | fp16 | bf16 | int8, default fp16

``subspace`` sends the coefficients of a boundary tensor in the run's fixed basis (``[subspace]`` in the
run config), themselves encoded with the ``inner`` codec.

It is spelled in two places, the run config's ``codec`` field (``protolearn.stages.config``) and every
tensor frame's ``codec`` field on the wire (``protolearn.protocol.codecs``), and both go through
:func:`parse_codec_spec` here, so a spec the config accepts is exactly one the codecs can run.

Why this module sits in the root package: the design card lets ``stages`` import only torch and
pydantic, and ``protocol`` neither ``stages`` nor the other way round, so neither package may hold
a grammar the other one needs. The root package (next to :mod:`protolearn.errors`, which both already
import) is the one place both can reach without a new edge between them. The module is pure: no
torch, no trio, no libp2p.

Every refusal is a one-line :class:`CodecSpecError` that names the field it came from
(``codec='zip' is unknown; …``). It is a :class:`ValueError` too, so a pydantic validator that lets it
through reports it as that field's value error.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from protolearn.errors import ConfigError
from protolearn.spec_grammar import split_spec

CODECS = ("none", "fp16", "bf16", "int8", "topk", "subspace")
DEFAULT_TOPK_FRACTION = 0.05
# The codecs ``subspace`` may encode its coefficients with, and the default one.
SUBSPACE_INNER = ("none", "fp16", "bf16", "int8")
DEFAULT_SUBSPACE_INNER = "fp16"
# Specs travel in every tensor frame; a longer one is refused before it is parsed.
MAX_SPEC_CHARS = 32
_ALLOWED = (
    f"use one of {', '.join(CODECS)} (or topk:F with 0 < F <= 1, e.g. topk:0.05, "
    f"or subspace:INNER with INNER one of {', '.join(SUBSPACE_INNER)})"
)


class CodecSpecError(ConfigError, ValueError):
    """A codec spec is not one of the known forms (a ValueError too, so pydantic validators accept it)."""


@dataclass(frozen=True)
class CodecSpec:
    """A parsed codec spec. ``str(spec)`` is its canonical wire name (``topk`` reads ``topk:0.05``,
    ``subspace`` reads ``subspace:fp16``)."""

    name: str
    fraction: float | None = None
    inner: str | None = None  # subspace only: the codec of the coefficients

    def __str__(self) -> str:
        if self.inner is not None:
            return f"{self.name}:{self.inner}"
        return f"{self.name}:{self.fraction!r}" if self.fraction is not None else self.name


def parse_codec_spec(spec: object, *, field: str = "codec") -> CodecSpec:
    """Parse ``none | fp16 | bf16 | int8 | topk | topk:<fraction in (0, 1]> | subspace | subspace:<inner>``.

    ``field`` names where the spec came from in the error (``codec``, ``frame codec``, …).
    """
    name, sep, arg = split_spec(spec, field=field, names=CODECS, with_argument=("topk", "subspace"), max_chars=MAX_SPEC_CHARS,
                                allowed=_ALLOWED, error=CodecSpecError)
    if name == "subspace":
        inner = arg if sep else DEFAULT_SUBSPACE_INNER
        if inner not in SUBSPACE_INNER:
            raise CodecSpecError(f"{field}={spec!r}: the subspace inner codec must be one of {', '.join(SUBSPACE_INNER)}")
        return CodecSpec(name, inner=inner)
    if name != "topk":
        return CodecSpec(name)
    if not sep:
        return CodecSpec(name, DEFAULT_TOPK_FRACTION)
    try:
        fraction = float(arg)
    except ValueError:
        fraction = math.nan
    if not 0.0 < fraction <= 1.0:  # also refuses NaN
        raise CodecSpecError(f"{field}={spec!r}: the topk fraction must be a number in (0, 1], e.g. topk:0.05")
    return CodecSpec(name, fraction)
