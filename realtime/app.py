"""The ASGI application: every transport on one port, the runtime started and drained by the lifespan.

Routes: `/healthz` (the process is up), `/readyz` (engines loaded, accepting streams), `/metrics`
(Prometheus), the OpenAI-compatible HTTP API (transports/http.py), the agents' websockets
(transports/ws.py), WebRTC signalling (transports/webrtc.py) and the browser client (`web/`) at `/`.
"""

from __future__ import annotations

import contextlib
import logging
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import BaseRoute, Mount, Route
from starlette.staticfiles import StaticFiles

from realtime.config import ServiceConfig
from realtime.runtime import Runtime
from realtime.transports import cartesia_http, elevenlabs_http, http, ws
from realtime.transports.webrtc import WebRTCGateway

logger = logging.getLogger(__name__)

WEB_DIR = Path(__file__).resolve().parent.parent / "web"


def server_config(
    app: Starlette, config: ServiceConfig, *, port: int, host: str, log_level: str
) -> uvicorn.Config:
    """How uvicorn serves the app (the command line and the tests alike).

    Per-message deflate is off: PCM barely compresses, and deflating each audio frame cost the event
    loop about a millisecond per frame, which 64 streams starting together paid in series.
    """
    return uvicorn.Config(
        app,
        host=host,
        port=port,
        loop="uvloop" if sys.platform != "win32" else "asyncio",
        ws="websockets-sansio",
        ws_max_size=1 << 20,
        ws_per_message_deflate=False,
        lifespan="on",
        timeout_graceful_shutdown=int(config.drain_timeout_s) + 1,
        log_level=log_level,
    )


def create_app(config: ServiceConfig, runtime: Runtime | None = None) -> Starlette:
    """The service app. The runtime is created (not started) here; the lifespan starts and drains it."""
    runtime = runtime or Runtime(config)
    webrtc = WebRTCGateway(runtime, config.webrtc)

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        await runtime.start()
        try:
            yield
        finally:
            logger.info("shutting down: draining streams for up to %.1f s", config.drain_timeout_s)
            await webrtc.aclose()
            await runtime.stop(config.drain_timeout_s)

    async def healthz(request: Request) -> Response:
        return JSONResponse({"status": "ok"})

    async def readyz(request: Request) -> Response:
        if runtime.ready:
            return JSONResponse({"status": "ready"})
        return JSONResponse({"status": "starting"}, status_code=503)

    async def metrics(request: Request) -> Response:
        return Response(runtime.metrics.render(), media_type=runtime.metrics.content_type)

    routes: list[BaseRoute] = [
        Route("/healthz", healthz),
        Route("/readyz", readyz),
        Route("/metrics", metrics),
        *http.routes(runtime),
        *elevenlabs_http.routes(runtime),
        *cartesia_http.routes(runtime),
        *ws.routes(runtime),
        *webrtc.routes(),
    ]
    if (WEB_DIR / "index.html").is_file():
        routes.append(Mount("/", StaticFiles(directory=WEB_DIR, html=True), name="web"))
    app = Starlette(routes=routes, lifespan=lifespan)
    app.state.runtime = runtime
    return app
