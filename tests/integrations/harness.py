"""Types and helpers the integration tests share with their fixtures (conftest.py)."""

from __future__ import annotations

import sys
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import httpx

# The live-server helpers are shared with tests/realtime (whose directory is on sys.path only once one
# of its modules is collected).
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "realtime"))
from testing import LiveServer  # noqa: E402

# `await run_client(env, "script.py", *args)` → the script's JSON result line.
ClientRunner = Callable[..., Awaitable[dict[str, Any]]]
# `await slots_freed()` returns once /metrics shows nothing synthesising.
SlotsFreed = Callable[[], Awaitable[None]]


async def metric_value(server: LiveServer, name: str) -> float:
    """One unlabelled sample of the server's /metrics."""
    async with httpx.AsyncClient() as client:
        response = await client.get(f"{server.http_url}/metrics")
    response.raise_for_status()
    for line in response.text.splitlines():
        if line.startswith(f"{name} "):
            return float(line.split()[1])
    raise AssertionError(f"/metrics has no sample {name}")
