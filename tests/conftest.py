"""Shared fixtures: the tiny synthetic models (built once per test session) and a live server on loopback.

End-to-end tests run the real app under uvicorn on 127.0.0.1 with an ephemeral port, in the test
session's event loop; mark such modules `pytestmark = pytest.mark.asyncio(loop_scope="session")`.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import pytest
import pytest_asyncio

if TYPE_CHECKING:  # the service is imported lazily so engine-only test runs do not load it
    from realtime.config import ServiceConfig
    from realtime.runtime import Runtime


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A models directory with random tiny weights in the released layout (with a `default` voice)."""
    from engines.build.synthetic import build_random

    return build_random(tmp_path_factory.mktemp("models") / "tiny", "tiny")


@dataclass
class LiveServer:
    """A running service: its base URLs and its runtime (for checking engine resources)."""

    config: ServiceConfig
    runtime: Runtime
    port: int

    @property
    def http_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def ws_url(self) -> str:
        return f"ws://127.0.0.1:{self.port}"


@contextlib.asynccontextmanager
async def serve(config: ServiceConfig) -> AsyncIterator[LiveServer]:
    """Run the app under uvicorn on 127.0.0.1 (port 0) until the block exits, then shut down gracefully."""
    import uvicorn

    from realtime.app import create_app
    from realtime.runtime import Runtime

    runtime = Runtime(config)
    server = uvicorn.Server(
        uvicorn.Config(
            create_app(config, runtime),
            host="127.0.0.1",
            port=0,
            ws="websockets-sansio",
            lifespan="on",
            log_level="warning",
            timeout_graceful_shutdown=int(config.drain_timeout_s) + 1,
        )
    )
    task = asyncio.create_task(server.serve(sockets=None))
    while not server.started:
        if task.done():
            task.result()
            raise RuntimeError("uvicorn stopped before it started")
        await asyncio.sleep(0.05)
    port = server.servers[0].sockets[0].getsockname()[1]
    try:
        yield LiveServer(config, runtime, port)
    finally:
        server.should_exit = True
        await task


def service_config(models: Path, voices: Path, **overrides: object) -> ServiceConfig:
    """A small-footprint configuration over the tiny models for tests."""
    from realtime.config import ServiceConfig

    settings: dict[str, object] = {"max_streams": 4, "drain_timeout_s": 5.0, "max_text_chars": 2000}
    settings.update(overrides)
    return ServiceConfig(models_dir=models, voices_dir=voices, **settings)  # type: ignore[arg-type]


@pytest_asyncio.fixture(scope="session", loop_scope="session")
async def live_server(
    tiny_models: Path, tmp_path_factory: pytest.TempPathFactory
) -> AsyncIterator[LiveServer]:
    """One server for the whole session (starting one costs seconds)."""
    async with serve(service_config(tiny_models, tmp_path_factory.mktemp("voices"))) as server:
        yield server


@pytest.fixture
def eventually() -> Callable[[Callable[[], bool]], Awaitable[None]]:
    """Await until `condition()` holds (engines free resources on their own threads); fails after 20 s."""

    async def wait(condition: Callable[[], bool], timeout_s: float = 20.0) -> None:
        async with asyncio.timeout(timeout_s):
            # The state lives on engine threads, which signal nothing to the loop: poll it.
            while not condition():  # noqa: ASYNC110
                await asyncio.sleep(0.02)

    return wait
