"""The event loop's lateness is measured: a callback that holds the loop shows up in the next timer."""

from __future__ import annotations

import asyncio
import time

import pytest

from realtime.loop_lag import watch_event_loop

pytestmark = pytest.mark.asyncio(loop_scope="session")


async def test_a_blocked_loop_shows_as_a_late_timer() -> None:
    lags: list[float] = []
    enough = asyncio.Event()

    def observe(lag: float) -> None:
        lags.append(lag)
        if len(lags) == 3:
            # A callback that holds the loop for 0.2 s, as blocking work on it would.
            asyncio.get_running_loop().call_soon(time.sleep, 0.2)
        if len(lags) == 5:
            enough.set()

    watcher = asyncio.create_task(watch_event_loop(observe, period_s=0.01))
    try:
        async with asyncio.timeout(10):
            await enough.wait()
    finally:
        watcher.cancel()
        with pytest.raises(asyncio.CancelledError):
            await watcher
    assert min(lags) >= 0
    assert max(lags[3:]) >= 0.15
