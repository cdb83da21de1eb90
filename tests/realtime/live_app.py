"""The real app over the tiny synthetic models, served by uvicorn on a loopback port, for end-to-end tests."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path

import uvicorn
from starlette.applications import Starlette

from realtime.app import create_app
from realtime.cli import default_models_dir
from realtime.config import ServiceConfig, WebRTCConfig
from realtime.runtime import Runtime

LOOPBACK = "127.0.0.1"


@dataclass(frozen=True)
class LiveApp:
    base_url: str
    app: Starlette

    @property
    def runtime(self) -> Runtime:
        return self.app.state.runtime


def tiny_config(voices_dir: Path, webrtc: WebRTCConfig) -> ServiceConfig:
    """The tiny models (built once into the cache), uploads kept in ``voices_dir``, media on loopback."""
    return ServiceConfig(
        models_dir=default_models_dir("tiny"), voices_dir=voices_dir, host=LOOPBACK, webrtc=webrtc
    )


@asynccontextmanager
async def serve(config: ServiceConfig) -> AsyncIterator[LiveApp]:
    """Run the app (lifespan included) on ``config.host`` and a free port until the block ends."""
    app = create_app(config)
    server = uvicorn.Server(uvicorn.Config(app, host=config.host, port=0, log_level="warning"))
    task = asyncio.create_task(server.serve())
    while not server.started:
        if task.done():
            task.result()
            raise RuntimeError("uvicorn stopped before it started")
        await asyncio.sleep(0.02)
    port = server.servers[0].sockets[0].getsockname()[1]
    try:
        yield LiveApp(f"http://{config.host}:{port}", app)
    finally:
        server.should_exit = True
        await task
