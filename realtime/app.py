"""The ASGI application: every transport on one port, the runtime started and drained by the lifespan.

Routes: `/healthz` (the process is up), `/readyz` (engines loaded, accepting streams), `/metrics`
(Prometheus), the OpenAI-compatible HTTP API (transports/http.py), the agents' websockets
(transports/ws.py), WebRTC signalling (transports/webrtc.py) and the browser client (`web/`) at `/`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import sys
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine
from pathlib import Path
from types import FrameType
from typing import Any

import uvicorn
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.middleware.cors import CORSMiddleware
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response
from starlette.routing import BaseRoute, Mount, Route
from starlette.staticfiles import StaticFiles

from realtime.access import install_log_redaction, is_loopback
from realtime.config import ServiceConfig
from realtime.gc_pauses import GcPauses, start_objects_frozen
from realtime.loop_lag import watch_event_loop
from realtime.runtime import Runtime
from realtime.session import ServiceError
from realtime.transports import cartesia_http, elevenlabs_http, http, ws
from realtime.transports.guard import Guard
from realtime.transports.header_timeout import http_protocol
from realtime.transports.webrtc import WebRTCGateway

logger = logging.getLogger(__name__)

WEB_DIR = Path(__file__).resolve().parent.parent / "web"
# Paths whose errors take OpenAI's shape (the HTTP API; the web page keeps plain text).
API_PREFIX = "/v1/"
ALL_METHODS = {"GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS"}


def server_config(
    app: Starlette, config: ServiceConfig, *, port: int, host: str, log_level: str
) -> uvicorn.Config:
    """How uvicorn serves the app (the command line and the tests alike).

    Per-message deflate is off: PCM barely compresses, and deflating each audio frame cost the event
    loop about a millisecond per frame, which 64 streams starting together paid in series.
    """
    server = uvicorn.Config(
        app,
        host=host,
        port=port,
        loop="uvloop" if sys.platform != "win32" else "asyncio",
        http=http_protocol(config.limits.header_timeout_s),
        ws="websockets-sansio",
        ws_max_size=1 << 20,
        ws_per_message_deflate=False,
        lifespan="on",
        timeout_graceful_shutdown=int(config.drain_timeout_s) + 1,
        log_level=log_level,
    )
    # uvicorn's access and websocket log lines include query strings, where keys may travel.
    install_log_redaction()
    if config.access.open and not is_loopback(host):
        logger.warning(
            "NO API KEYS: the service on %s:%d is open to anyone who can reach it; start it with "
            "--api-key, --api-keys-file or $REALTIME_API_KEYS",
            host,
            port,
        )
    return server


def _method_not_allowed(routes: list[BaseRoute]) -> list[Route]:
    """For each API path, a route answering every method it does not serve: 405 in OpenAI's shape
    with `Allow` (the web page's mount at `/` would otherwise answer 404 to, say, a GET)."""
    allowed: dict[str, set[str]] = {}
    for route in routes:
        if isinstance(route, Route) and route.path.startswith(API_PREFIX) and route.methods:
            allowed.setdefault(route.path, set()).update(route.methods)

    def refuse(methods: set[str]) -> Callable[[Request], Awaitable[Response]]:
        allow = ", ".join(sorted(methods))

        async def endpoint(request: Request) -> Response:
            message = f"{request.method} is not allowed on {request.url.path}; use {allow}"
            error = ServiceError("method_not_allowed", message, 405)
            response = http.error_response(error)
            response.headers["Allow"] = allow
            return response

        return endpoint

    return [
        Route(path, refuse(methods), methods=sorted(ALL_METHODS - methods))
        for path, methods in allowed.items()
    ]


def create_app(config: ServiceConfig, runtime: Runtime | None = None) -> Starlette:
    """The service app. The runtime is created (not started) here; the lifespan starts and drains it."""
    runtime = runtime or Runtime(config)
    webrtc = WebRTCGateway(runtime, config.webrtc, config.limits.pending_offers_per_client)
    sockets = ws.WebSocketHub()
    runtime.metrics.track_connections(lambda: len(sockets), lambda: len(webrtc))
    gc_pauses = GcPauses()
    runtime.metrics.track_gc(gc_pauses)

    async def drain(timeout_s: float) -> None:
        """Before the server stops: not ready, new work refused, running utterances on every transport
        finish (websockets get their `done` and a 1001 close) for up to `timeout_s`; then the rest is
        cancelled."""
        logger.info("draining: running streams get up to %.1f s to finish", timeout_s)
        runtime.begin_drain()
        await sockets.drain()
        try:
            async with asyncio.timeout(timeout_s):
                await asyncio.gather(sockets.wait_closed(), webrtc.wait_idle(), runtime.wait_idle())
        except TimeoutError:
            logger.warning("drain timed out: cancelling what still runs")
        await sockets.abort()
        await webrtc.aclose()

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        loop_lag = asyncio.create_task(watch_event_loop(runtime.metrics.event_loop_lag.observe),
                                       name="event-loop-lag")
        try:
            await runtime.start()
            try:
                # Collections walk only what serving makes; the freeze's own collection is not a pause of it.
                with start_objects_frozen(), gc_pauses.watching():
                    yield
            finally:
                logger.info("shutting down: draining streams for up to %.1f s", config.drain_timeout_s)
                await webrtc.aclose()
                await runtime.stop(config.drain_timeout_s)
        finally:
            loop_lag.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await loop_lag

    async def healthz(request: Request) -> Response:
        return JSONResponse({"status": "ok"})

    async def readyz(request: Request) -> Response:
        if runtime.ready:  # warming_up: shapes not captured yet run eagerly (slower) until it ends
            return JSONResponse({"status": "ready", "warming_up": runtime.warming_up})
        return JSONResponse({"status": "draining" if runtime.draining else "starting"}, status_code=503)

    async def metrics(request: Request) -> Response:
        names = request.query_params.getlist("name[]")
        return Response(runtime.metrics.render(names), media_type=runtime.metrics.content_type)

    routes: list[BaseRoute] = [
        Route("/healthz", healthz),
        Route("/readyz", readyz),
        Route("/metrics", metrics),
        *http.routes(runtime),
        *elevenlabs_http.routes(runtime),
        *cartesia_http.routes(runtime),
        *ws.routes(runtime, sockets),
        *webrtc.routes(),
    ]
    routes.extend(_method_not_allowed(routes))
    if (WEB_DIR / "index.html").is_file():
        routes.append(Mount("/", StaticFiles(directory=WEB_DIR, html=True), name="web"))

    async def http_error(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, HTTPException)
        if not request.url.path.startswith(API_PREFIX):
            return PlainTextResponse(exc.detail, exc.status_code, headers=exc.headers)
        code = "not_found" if exc.status_code == 404 else "http_error"
        return http.error_response(ServiceError(code, f"{exc.detail}: {request.url.path}", exc.status_code))

    async def server_error(request: Request, exc: Exception) -> Response:
        # Starlette logs the traceback; the client gets OpenAI's shape and the count goes up.
        runtime.metrics.error("internal_error")
        return http.error_response(ServiceError("internal_error", "the server failed on this request", 500))

    middleware = [
        Middleware(
            CORSMiddleware,
            allow_origins=list(config.access.cors_origins),
            allow_methods=["GET", "POST", "DELETE"],
            allow_headers=["authorization", "content-type", "x-api-key", "xi-api-key", "cartesia-version"],
            max_age=600,
        ),
        Middleware(Guard, config=config),
    ]
    app = Starlette(
        routes=routes,
        lifespan=lifespan,
        middleware=middleware,
        exception_handlers={HTTPException: http_error, Exception: server_error},
    )
    app.state.runtime = runtime
    app.state.drain = drain
    return app


class DrainingServer(uvicorn.Server):
    """uvicorn, with the service's drain on SIGTERM/SIGINT before uvicorn's own shutdown.

    uvicorn alone stops accepting, cuts websockets with 1012 and cancels HTTP streams after its grace
    period, and only then runs the lifespan's shutdown; and it re-raises the signal, so the process
    dies by it. Here the first signal starts the app's `drain` (the server still answers: /readyz
    says draining, new work is refused), uvicorn's shutdown follows once it is over, and the process
    exits 0. A second SIGINT still forces uvicorn out.
    """

    def __init__(
        self,
        config: uvicorn.Config,
        drain: Callable[[float], Coroutine[Any, Any, None]],
        drain_timeout_s: float,
    ) -> None:
        super().__init__(config)
        self._drain = drain
        self._drain_timeout_s = drain_timeout_s
        self._drain_requested = False
        self._draining: asyncio.Task[None] | None = None

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if self._drain_requested or self.should_exit:
            super().handle_exit(sig, frame)
            return
        self._drain_requested = True  # the tick starts the drain (a signal handler must not await)

    async def on_tick(self, counter: int) -> bool:
        if self._drain_requested and self._draining is None:
            self._draining = asyncio.create_task(self._drain(self._drain_timeout_s))
        if self._draining is not None and self._draining.done():
            self.should_exit = True
        return await super().on_tick(counter)
