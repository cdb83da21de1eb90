"""Fixtures of the service's end-to-end tests (helpers in testing.py)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import pytest_asyncio
from testing import LiveServer, serve, service_config


@pytest_asyncio.fixture(scope="session", loop_scope="session")
async def live_server(
    tiny_models: Path, tmp_path_factory: pytest.TempPathFactory
) -> AsyncIterator[LiveServer]:
    """One server for the whole session (starting one costs seconds)."""
    async with serve(service_config(tiny_models, tmp_path_factory.mktemp("voices"))) as server:
        yield server
