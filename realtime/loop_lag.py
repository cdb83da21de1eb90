"""How late the event loop runs its callbacks: every transport, session and engine hand-off goes through
it, so its lateness adds to every stream's first audio. A timer set every `period_s` observes how much
after its due time it ran (`realtime_event_loop_lag_seconds` on /metrics; `realtime bench` reports it per
level)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

PERIOD_S = 0.05


async def watch_event_loop(observe: Callable[[float], None], period_s: float = PERIOD_S,
                           clock: Callable[[], float] = time.perf_counter) -> None:
    """Observe each timer's lateness in seconds until cancelled."""
    while True:
        due = clock() + period_s
        await asyncio.sleep(period_s)
        observe(max(0.0, clock() - due))
