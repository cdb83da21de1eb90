"""Per-client limits as plain data structures (pure policy: no sockets, time passed in).

`RateLimiter` is a token bucket per client; `Slots` counts things a client holds at once (connections,
pending WebRTC offers). Both forget a client as soon as it holds nothing (a full bucket is the same as
no bucket), so their size is bounded by the clients active now, not by every client ever seen.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass
class _Bucket:
    tokens: float
    updated: float


class RateLimiter:
    """`rate` requests per second per client, in bursts of up to `burst`."""

    def __init__(self, rate: float, burst: int) -> None:
        self._rate = rate
        self._burst = float(burst)
        self._buckets: dict[str, _Bucket] = {}

    def acquire(self, client: str, now: float) -> float:
        """Take one token for `client`: 0.0 when granted, otherwise the seconds until one is available."""
        self._forget_full(now)
        bucket = self._buckets.get(client)
        if bucket is None:
            bucket = self._buckets[client] = _Bucket(self._burst, now)
        else:
            bucket.tokens = min(self._burst, bucket.tokens + (now - bucket.updated) * self._rate)
            bucket.updated = now
        if bucket.tokens >= 1.0:
            bucket.tokens -= 1.0
            return 0.0
        return (1.0 - bucket.tokens) / self._rate

    def __len__(self) -> int:
        return len(self._buckets)

    def _forget_full(self, now: float) -> None:
        # Amortised: only scan when the table has grown well past a small working set.
        if len(self._buckets) < 1024:
            return
        refill_s = self._burst / self._rate
        for client in [c for c, b in self._buckets.items() if now - b.updated >= refill_s]:
            del self._buckets[client]


def retry_after(seconds: float) -> int:
    """A Retry-After value (whole seconds, at least 1)."""
    return max(1, math.ceil(seconds))


class Slots:
    """At most `limit` held at once per client."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self._held: dict[str, int] = {}

    def try_acquire(self, client: str) -> bool:
        held = self._held.get(client, 0)
        if held >= self.limit:
            return False
        self._held[client] = held + 1
        return True

    def release(self, client: str) -> None:
        held = self._held.get(client, 0) - 1
        if held > 0:
            self._held[client] = held
        else:
            self._held.pop(client, None)

    def held(self, client: str) -> int:
        return self._held.get(client, 0)

    def __len__(self) -> int:
        return len(self._held)
