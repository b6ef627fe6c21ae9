"""A home internet link, sans-IO: the spec grammar, a token bucket per direction, and a delay line.

What it models. Each node has one access link, with an upload rate, a download rate and a one-way
propagation delay (plus, optionally, jitter). Every byte the node sends passes its **up** direction and
every byte it receives passes its **down** direction::

    sender --> [ up: token bucket at RATE, then DELAY ] --> the network --> [ down: RATE, DELAY ] --> receiver

A :class:`Direction` answers one question for a batch of ``n`` bytes offered at ``now``: when have
they left the bottleneck (``leave``: the token bucket, i.e. serialisation at the rate, FIFO behind
everything offered before) and when do they arrive at the far end (``arrive`` = ``leave`` + DELAY ±
JITTER, never before an earlier batch: TCP delivers in order, so jitter delays bytes but never
reorders them). The trio adapter (:mod:`protolearn.protocol.transport.link`) only waits for these
times; every decision is here, with ``now`` passed in, so the model runs under a fake clock in tests.

Where the delay is applied, and what that costs. A sender's bytes are scheduled when offered: they
leave after everything offered before them has left and their own serialisation, and arrive DELAY
later; the sender is held back only by a bounded send queue, so a pipelined stream pays DELAY once,
not per frame, and its throughput is the rate. A request/reply to an unshaped peer pays DELAY on the
way out (our up direction) and DELAY on the way back (our down direction): 2 × DELAY plus the
serialisation of both messages. Between two shaped nodes the delays add up, as two home links do: a
round trip costs 2 × (DELAY_a + DELAY_b).

What it does not model: loss and retransmission, a bottleneck shared by several nodes (each node's
link is its own; two nodes "in one house" do not compete), TCP slow start and congestion control
(the bytes run over loopback, where TCP's window opens at once), and queueing delay beyond the
bucket (there is no buffer limit that drops). The token bucket's depth (``burst``, 16 KiB) lets a
small message leave at once, as a kernel ``tbf`` with a small burst does.

Grammar (``parse_link``): ``RATE,DELAY[,JITTER]`` for a symmetric link, or
``up=RATE,down=RATE,DELAY[,JITTER]``. RATE is a number with ``bit``, ``kbit``, ``mbit`` or ``gbit``
(bits per second, as ``tc`` writes them); DELAY and JITTER a number with ``us``, ``ms`` or ``s``.
Examples: ``50mbit,40ms``; ``up=20mbit,down=100mbit,30ms,5ms``. Jitter is uniform in
[-JITTER, +JITTER] per batch, from a seeded generator (:attr:`LinkSpec.seed`), and may not exceed DELAY;
DELAY is at most 250 ms (:data:`MAX_DELAY_S`).
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass, field

from pydantic import BaseModel, ConfigDict, Field

from protolearn.errors import ConfigError

# A small message leaves an idle link at once (a kernel tbf with a burst of a few KiB does the same);
# a larger one waits for its bytes beyond this.
DEFAULT_BURST_BYTES = 16 * 1024
# Sanity bounds of the grammar. The transport has its own, higher floor for the rate (a slower link
# could not carry a large message within its whole-message deadline: TransportConfig checks it).
MIN_RATE_BITS = 1_000.0
MAX_RATE_BITS = 100e9
# A one-way delay (and a jitter) of at most this: a bulk-lane dial waits 4 x DELAY on the receiving side
# (transport/link.py), which must stay well inside the lane's 2 s connect timeout.
MAX_DELAY_S = 0.25

_RATE_UNITS = {"bit": 1.0, "kbit": 1e3, "mbit": 1e6, "gbit": 1e9}
_TIME_UNITS = {"us": 1e-6, "ms": 1e-3, "s": 1.0}
_NUMBER = r"(\d+(?:\.\d*)?|\.\d+)"
_RATE = re.compile(_NUMBER + r"\s*([a-z]+)$")
_TIME = re.compile(_NUMBER + r"\s*([a-z]+)$")
EXAMPLE = "50mbit,40ms or up=20mbit,down=100mbit,30ms,5ms"


class LinkSpec(BaseModel):
    """One node's access link. ``up_bits``/``down_bits`` in bits per second, times in seconds."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    up_bits: float = Field(ge=MIN_RATE_BITS, le=MAX_RATE_BITS)
    down_bits: float = Field(ge=MIN_RATE_BITS, le=MAX_RATE_BITS)
    delay_s: float = Field(ge=0, le=MAX_DELAY_S)
    jitter_s: float = Field(default=0.0, ge=0, le=MAX_DELAY_S)
    # Seeds the jitter; a node derives it from its name, so a rerun sees the same jitter.
    seed: int = 0
    burst_bytes: int = Field(default=DEFAULT_BURST_BYTES, gt=0)

    @property
    def up_bytes_per_s(self) -> float:
        return self.up_bits / 8

    @property
    def down_bytes_per_s(self) -> float:
        return self.down_bits / 8

    @property
    def text(self) -> str:
        """The spec in the grammar's form (what a user would type to get this link)."""
        tail = f"{_fmt_time(self.delay_s)}" + (f",{_fmt_time(self.jitter_s)}" if self.jitter_s else "")
        if self.up_bits == self.down_bits:
            return f"{_fmt_rate(self.up_bits)},{tail}"
        return f"up={_fmt_rate(self.up_bits)},down={_fmt_rate(self.down_bits)},{tail}"


def parse_link(text: str, *, seed: int = 0) -> LinkSpec:
    """Parse ``RATE,DELAY[,JITTER]`` or ``up=RATE,down=RATE,DELAY[,JITTER]``; ConfigError says what is wrong."""
    parts = [p.strip().lower() for p in text.split(",")]
    if any(not p for p in parts):
        raise ConfigError(f"link {text!r}: an empty field; write it like {EXAMPLE}")
    if "=" in parts[0]:
        rates = {}
        while parts and "=" in parts[0]:
            key, _, value = parts.pop(0).partition("=")
            if key not in ("up", "down") or key in rates:
                raise ConfigError(f"link {text!r}: {key!r}= is not up= or down= (or is given twice); write it like {EXAMPLE}")
            rates[key] = _rate(value, text)
        if set(rates) != {"up", "down"}:
            raise ConfigError(f"link {text!r}: the asymmetric form needs both up= and down=; write it like {EXAMPLE}")
        up, down = rates["up"], rates["down"]
    else:
        up = down = _rate(parts.pop(0), text)
    if not 1 <= len(parts) <= 2:
        raise ConfigError(f"link {text!r}: after the rate comes DELAY and an optional JITTER; write it like {EXAMPLE}")
    delay = _time(parts[0], text, "delay")
    jitter = _time(parts[1], text, "jitter") if len(parts) == 2 else 0.0
    if jitter > delay:
        raise ConfigError(f"link {text!r}: jitter {_fmt_time(jitter)} exceeds the delay {_fmt_time(delay)} (a delay never goes below 0)")
    return LinkSpec(up_bits=up, down_bits=down, delay_s=delay, jitter_s=jitter, seed=seed)


def _rate(value: str, text: str) -> float:
    m = _RATE.match(value)
    if m is None or m.group(2) not in _RATE_UNITS:
        hint = " (bytes per second are not accepted: use bits, e.g. 50mbit)" if m is not None and m.group(2).endswith("bps") else ""
        raise ConfigError(f"link {text!r}: rate {value!r} must be a number with bit, kbit, mbit or gbit{hint}; write it like {EXAMPLE}")
    bits = float(m.group(1)) * _RATE_UNITS[m.group(2)]
    if not MIN_RATE_BITS <= bits <= MAX_RATE_BITS:
        raise ConfigError(f"link {text!r}: rate {value!r} is outside {_fmt_rate(MIN_RATE_BITS)}..{_fmt_rate(MAX_RATE_BITS)}")
    return bits


def _time(value: str, text: str, what: str) -> float:
    m = _TIME.match(value)
    if m is None or m.group(2) not in _TIME_UNITS:
        raise ConfigError(f"link {text!r}: {what} {value!r} must be a number with us, ms or s; write it like {EXAMPLE}")
    seconds = float(m.group(1)) * _TIME_UNITS[m.group(2)]
    if seconds > MAX_DELAY_S:
        raise ConfigError(f"link {text!r}: {what} {value!r} exceeds {MAX_DELAY_S:g} s")
    return seconds


def _fmt_rate(bits: float) -> str:
    for unit in ("gbit", "mbit", "kbit"):
        scaled = bits / _RATE_UNITS[unit]
        if scaled >= 1 and scaled == round(scaled, 3):
            return f"{scaled:g}{unit}"
    return f"{bits:g}bit"


def _fmt_time(seconds: float) -> str:
    ms = seconds * 1e3
    return f"{ms:g}ms" if ms == round(ms, 3) else f"{seconds * 1e6:g}us"


def parse_links_file(text: str, *, where: str) -> list[LinkSpec | None]:
    """One profile per node, in node order: each line a SPEC or ``none`` (unshaped); ``#`` starts a comment."""
    specs: list[LinkSpec | None] = []
    for number, line in enumerate(text.splitlines(), 1):
        body = line.split("#", 1)[0].strip()
        if not body:
            continue
        try:
            specs.append(None if body.lower() == "none" else parse_link(body))
        except ConfigError as err:
            raise ConfigError(f"{where} line {number}: {err}") from None
    return specs


# -- the model ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class Passage:
    """When a batch of bytes has left the bottleneck, and when it reaches the far end."""

    leave: float
    arrive: float


class TokenBucket:
    """Tokens (bytes) refill at ``rate`` up to ``burst``; a batch of ``n`` bytes leaves once the bucket
    has paid for all of it, FIFO behind the batches reserved before it.

    :meth:`reserve` returns the time the batch's last byte has left. The bucket's state may run ahead
    of ``now`` (a batch reserved while earlier ones still serialise), so a later batch queues behind.
    """

    def __init__(self, rate: float, burst: float) -> None:
        if rate <= 0 or burst <= 0:
            raise ValueError(f"rate ({rate}) and burst ({burst}) must be positive")
        self.rate = rate
        self.burst = burst
        self._level = burst  # tokens at time self._t
        self._t = float("-inf")

    def reserve(self, n: int, now: float) -> float:
        t = max(now, self._t)
        level = self.burst if self._t == float("-inf") else min(self.burst, self._level + (t - self._t) * self.rate)
        if n <= level:
            self._level, self._t = level - n, t
            return t
        leave = t + (n - level) / self.rate
        self._level, self._t = 0.0, leave
        return leave


class DelayLine:
    """A one-way delay of ``delay`` ± uniform ``jitter`` (seeded) that never reorders what it carries."""

    def __init__(self, delay: float, jitter: float, seed: int) -> None:
        self.delay = delay
        self.jitter = jitter
        self._rng = random.Random(seed)
        self._last = float("-inf")

    def arrive(self, leave: float) -> float:
        sample = self.delay + (self.jitter * (2 * self._rng.random() - 1) if self.jitter else 0.0)
        self._last = max(self._last, leave + max(0.0, sample))
        return self._last


@dataclass
class DirectionStats:
    """What passed one direction, on the model's clock: the test and the benchmarks read these."""

    bytes: int = 0
    batches: int = 0
    first_at: float | None = None  # when the first batch was offered
    last_leave: float = 0.0  # when the last batch had left the bottleneck
    last_arrive: float = 0.0
    serialisation_s: float = 0.0  # sum of n / rate: the time the bytes alone need at the rate

    def as_dict(self) -> dict[str, float | int | None]:
        return {"bytes": self.bytes, "batches": self.batches, "first_at": self.first_at, "last_leave": self.last_leave,
                "last_arrive": self.last_arrive, "serialisation_s": self.serialisation_s}


@dataclass
class Direction:
    """One direction of a link: its bucket, then its delay line."""

    bucket: TokenBucket
    line: DelayLine
    stats: DirectionStats = field(default_factory=DirectionStats)

    def send(self, n: int, now: float) -> Passage:
        """Offer ``n`` bytes at ``now``: when they have left, and when they arrive."""
        leave = self.bucket.reserve(n, now)
        arrive = self.line.arrive(leave)
        s = self.stats
        if s.first_at is None:
            s.first_at = now
        s.bytes += n
        s.batches += 1
        s.last_leave, s.last_arrive = leave, arrive
        s.serialisation_s += n / self.bucket.rate
        return Passage(leave, arrive)


class Link:
    """A node's access link: :attr:`up` for what it sends, :attr:`down` for what it receives."""

    def __init__(self, spec: LinkSpec) -> None:
        self.spec = spec
        # Separate generators per direction (derived from the one seed), so one direction's traffic
        # does not change the other's jitter.
        self.up = Direction(TokenBucket(spec.up_bytes_per_s, spec.burst_bytes), DelayLine(spec.delay_s, spec.jitter_s, spec.seed * 2))
        self.down = Direction(TokenBucket(spec.down_bytes_per_s, spec.burst_bytes), DelayLine(spec.delay_s, spec.jitter_s, spec.seed * 2 + 1))


__all__ = [
    "DEFAULT_BURST_BYTES", "DelayLine", "Direction", "DirectionStats", "Link", "LinkSpec", "Passage", "TokenBucket",
    "parse_link", "parse_links_file",
]
