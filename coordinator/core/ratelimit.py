"""A per-peer token bucket over every request (sans-IO).

Each peer has a bucket of ``burst`` tokens refilled at ``rate`` per second; a request takes one
token or is refused. The table of buckets is bounded: when it is full, buckets that have refilled
completely (idle peers) are dropped first, then the oldest, so a flood of fresh peer IDs cannot grow
memory without bound.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class _Bucket:
    tokens: float
    at: float


class RateLimiter:
    def __init__(self, rate: float, burst: float, *, max_peers: int = 100_000) -> None:
        if rate <= 0 or burst < 1:
            raise ValueError(f"rate must be > 0 and burst >= 1, got rate={rate}, burst={burst}")
        self.rate = rate
        self.burst = burst
        self.max_peers = max_peers
        self._buckets: dict[str, _Bucket] = {}

    def allow(self, peer: str, now: float) -> bool:
        b = self._buckets.get(peer)
        if b is None:
            if len(self._buckets) >= self.max_peers:
                self._evict(now)
            b = _Bucket(self.burst, now)
            self._buckets[peer] = b
        else:
            b.tokens = min(self.burst, b.tokens + (now - b.at) * self.rate)
            b.at = now
        if b.tokens >= 1.0:
            b.tokens -= 1.0
            return True
        return False

    def _evict(self, now: float) -> None:
        full = [p for p, b in self._buckets.items() if b.tokens + (now - b.at) * self.rate >= self.burst]
        for p in full:
            del self._buckets[p]
        while len(self._buckets) >= self.max_peers:
            # dicts keep insertion order: the first key is the oldest bucket.
            del self._buckets[next(iter(self._buckets))]

    def __len__(self) -> int:
        return len(self._buckets)
