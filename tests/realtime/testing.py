"""Helpers for end-to-end tests of the service: a test configuration and a live server on loopback.

Test modules under tests/realtime import them (`from testing import serve, service_config`); the
fixtures built on them live in conftest.py. The real app runs under uvicorn on 127.0.0.1 with an
ephemeral port, in the test session's event loop; modules that share the session's server are marked
`pytestmark = pytest.mark.asyncio(loop_scope="session")`.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from pathlib import Path

import uvicorn

from engines.llm.base import SamplingParams
from realtime.app import create_app, server_config
from realtime.config import ServiceConfig, WebRTCConfig
from realtime.engine_loader import LoadedEngines, load_engines
from realtime.runtime import Runtime
from realtime.session import SpeechRequest

LOOPBACK = "127.0.0.1"


@dataclass
class LiveServer:
    """A running service: its base URLs and its runtime (for checking engine resources)."""

    config: ServiceConfig
    runtime: Runtime
    port: int

    @property
    def http_url(self) -> str:
        return f"http://{LOOPBACK}:{self.port}"

    @property
    def ws_url(self) -> str:
        return f"ws://{LOOPBACK}:{self.port}"


async def speak_samples(runtime: Runtime, seed: int, tokens: int) -> int:
    """Speak a short text through `runtime` for exactly `tokens` speech tokens; the samples heard."""
    request = SpeechRequest("Hello there.", sampling=SamplingParams(seed=seed, fixed_length=tokens))
    async with runtime.speak(request) as session:
        return sum([chunk.pcm.size async for chunk in session])


def service_config(models: Path, voices: Path, **overrides: object) -> ServiceConfig:
    """A small-footprint configuration over the tiny models; WebRTC gathers loopback candidates only
    (no other interface is bound or advertised) unless `webrtc` is overridden."""
    settings: dict[str, object] = {
        "max_streams": 4,
        "drain_timeout_s": 5.0,
        "max_text_chars": 2000,
        "webrtc": WebRTCConfig(host_addresses=(LOOPBACK,)),
    }
    settings.update(overrides)
    return ServiceConfig(models_dir=models, voices_dir=voices, **settings)  # type: ignore[arg-type]


@contextlib.asynccontextmanager
async def serve(
    config: ServiceConfig, loader: Callable[[ServiceConfig], LoadedEngines] = load_engines
) -> AsyncIterator[LiveServer]:
    """Run the app under uvicorn on 127.0.0.1 (port 0) until the block exits, then shut down gracefully.
    `loader` builds the engines (a test may size them differently from the configuration)."""
    runtime = Runtime(config, loader)
    app = create_app(config, runtime)
    server = uvicorn.Server(server_config(app, config, host=LOOPBACK, port=0, log_level="warning"))
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
