"""The gate in front of every API route: Origin check, API key, rate and connection limits, body timeout.

An ASGI middleware over the router, for HTTP requests and websocket handshakes on the API prefixes
(`/v1/`, `/cartesia/`); `/healthz`, `/readyz`, `/metrics` and the web page pass untouched. In order:

1. a browser `Origin` that is neither the service's own nor allowed → 403 `origin_not_allowed`;
2. with API keys configured, a missing or unknown key → 401 `missing_api_key` / `invalid_api_key`
   (an ElevenLabs websocket without a key in its handshake may still send it in its first message);
3. more requests than the client's token bucket holds → 429 `rate_limited` with Retry-After;
4. more websockets and HTTP requests in progress at once than allowed → 429 `too_many_connections`.

Refusals use the error shape of the API the route belongs to (OpenAI's, Cartesia's, ElevenLabs' or the
native websocket's); a refused websocket gets the HTTP status and body instead of the upgrade. The
client's principal (`access.py`) is left in `scope["state"]["principal"]` for the routes (voice
ownership, pending WebRTC offers). A request body that stalls longer than `body_timeout_s` between
pieces is answered 408 `body_timeout`.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any
from urllib.parse import parse_qsl

from realtime.access import ApiKeys, OriginPolicy, presented_key
from realtime.config import ServiceConfig
from realtime.limits import RateLimiter, Slots, retry_after

logger = logging.getLogger(__name__)

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

API_PREFIXES = ("/v1/", "/cartesia/")
ELEVENLABS_WS_SUFFIXES = ("/stream-input", "/multi-stream-input")
_TITLES = {401: "Unauthorized", 403: "Forbidden", 408: "Request Timeout", 429: "Too Many Requests"}


class Refusal(Exception):
    """Why the gate refuses a request: an HTTP status, a code and a sentence."""

    def __init__(self, status: int, code: str, message: str, retry_after_s: int | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.code = code
        self.message = message
        self.retry_after_s = retry_after_s


def dialect_of(path: str) -> str:
    """Which API's error shape a path answers in: `cartesia`, `elevenlabs`, `native` or `openai`."""
    if path.startswith("/cartesia/"):
        return "cartesia"
    if path.startswith("/v1/text-to-speech/"):
        return "elevenlabs"
    if path == "/v1/ws":
        return "native"
    return "openai"


def error_body(dialect: str, refusal: Refusal) -> dict[str, Any]:
    """The JSON body of a refusal in `dialect`'s error shape."""
    if dialect == "cartesia":
        title = _TITLES.get(refusal.status, "Error")
        return {"error_code": refusal.code, "title": title, "message": refusal.message}
    if dialect == "elevenlabs":
        return {"detail": {"status": refusal.code, "message": refusal.message}}
    if dialect == "native":
        return {"type": "error", "context_id": None, "code": refusal.code, "message": refusal.message}
    kind = "rate_limit_error" if refusal.status == 429 else "invalid_request_error"
    return {"error": {"message": refusal.message, "type": kind, "param": None, "code": refusal.code}}


def _headers(scope: Scope) -> dict[str, str]:
    return {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope.get("headers", [])}


class Guard:
    """The ASGI middleware (see the module docstring); owns the rate buckets and connection counts."""

    def __init__(
        self, app: ASGIApp, config: ServiceConfig, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self._app = app
        self._keys = ApiKeys(config.access.api_keys)
        self._origins = OriginPolicy(config.access.cors_origins)
        self._limits = config.limits
        self._rate = RateLimiter(config.limits.requests_per_s, config.limits.request_burst)
        self._connections = Slots(config.limits.connections_per_client)
        self._clock = clock

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] not in ("http", "websocket") or not scope["path"].startswith(API_PREFIXES):
            await self._app(scope, receive, send)
            return
        dialect = dialect_of(scope["path"])
        try:
            principal = self._admit(scope)
        except Refusal as refusal:
            await self._refuse(scope, receive, send, dialect, refusal)
            return
        try:
            self._count(principal)
        except Refusal as refusal:
            await self._refuse(scope, receive, send, dialect, refusal)
            return
        scope.setdefault("state", {})["principal"] = principal
        try:
            if scope["type"] == "http":
                await self._serve_http(scope, receive, send, dialect)
            else:
                await self._app(scope, receive, send)
        finally:
            self._connections.release(principal)

    async def _serve_http(self, scope: Scope, receive: Receive, send: Send, dialect: str) -> None:
        started = False

        async def tracking_send(message: Message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self._app(scope, self._timed_body(receive), tracking_send)
        except BodyTimeout as exc:
            logger.info("request body of %s stalled: closing", scope["path"])
            if not started:
                await self._refuse(scope, receive, send, dialect, exc.refusal)

    def _admit(self, scope: Scope) -> str:
        """The request's principal, or the Refusal of its origin or credentials."""
        headers = _headers(scope)
        if not self._origins.allows(headers.get("origin"), headers.get("host")):
            raise Refusal(403, "origin_not_allowed", "requests from this web origin are not allowed")
        if not self._keys.required:
            client = scope.get("client")
            return f"ip:{client[0]}" if client else "ip:unknown"
        query = dict(parse_qsl(scope.get("query_string", b"").decode("latin-1")))
        key = presented_key(headers, query)
        if key is None:
            if scope["type"] == "websocket" and scope["path"].endswith(ELEVENLABS_WS_SUFFIXES):
                # ElevenLabs clients may authenticate in the first message; transports/ws.py checks it.
                scope.setdefault("state", {})["auth_pending"] = True
                client = scope.get("client")
                return f"ip:{client[0]}" if client else "ip:unknown"
            raise Refusal(401, "missing_api_key", "an API key is required; see docs/reliability.md")
        principal = self._keys.principal(key)
        if principal is None:
            raise Refusal(401, "invalid_api_key", "the API key is not valid")
        return principal

    def _count(self, principal: str) -> None:
        wait_s = self._rate.acquire(principal, self._clock())
        if wait_s > 0:
            raise Refusal(
                429,
                "rate_limited",
                f"more than {self._limits.requests_per_s:g} requests per second; slow down",
                retry_after(wait_s),
            )
        if not self._connections.try_acquire(principal):
            raise Refusal(
                429,
                "too_many_connections",
                f"at most {self._connections.limit} connections and requests at once per client",
                1,
            )

    def _timed_body(self, receive: Receive) -> Receive:
        """`receive` that gives up on a body whose next piece takes longer than `body_timeout_s`."""
        body_done = False

        async def timed() -> Message:
            nonlocal body_done
            if body_done:
                return await receive()
            try:
                async with asyncio.timeout(self._limits.body_timeout_s):
                    message = await receive()
            except TimeoutError:
                raise BodyTimeout(self._limits.body_timeout_s) from None
            if message["type"] != "http.request" or not message.get("more_body", False):
                body_done = True
            return message

        return timed

    async def _refuse(
        self, scope: Scope, receive: Receive, send: Send, dialect: str, refusal: Refusal
    ) -> None:
        logger.info("refused %s %s: %s", scope["type"], scope["path"], refusal.code)
        body = json.dumps(error_body(dialect, refusal)).encode()
        headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
        if refusal.retry_after_s is not None:
            headers.append((b"retry-after", str(refusal.retry_after_s).encode()))
        if scope["type"] == "http":
            await send({"type": "http.response.start", "status": refusal.status, "headers": headers})
            await send({"type": "http.response.body", "body": body})
            return
        await receive()  # websocket.connect
        if "websocket.http.response" in scope.get("extensions", {}):
            start = {"type": "websocket.http.response.start", "status": refusal.status, "headers": headers}
            await send(start)
            await send({"type": "websocket.http.response.body", "body": body})
        else:
            await send({"type": "websocket.close", "code": 1008})


class BodyTimeout(Exception):
    """A request body that stopped arriving; the route's error handler answers 408."""

    def __init__(self, timeout_s: float) -> None:
        super().__init__(f"the request body stalled for more than {timeout_s:g} s")
        self.refusal = Refusal(408, "body_timeout", str(self))
