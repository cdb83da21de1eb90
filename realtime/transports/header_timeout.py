"""uvicorn's HTTP protocol with a deadline on request headers.

uvicorn closes idle keep-alive connections but waits forever for the headers of a request that has
begun (or of the first request of a new connection), so a client sending a byte now and then holds a
connection, and its memory, indefinitely. This protocol closes a connection whose request headers are
not complete `header_timeout_s` after the connection opened or the request began.
"""

from __future__ import annotations

import asyncio

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol


class _HeaderDeadlineProtocol(HttpToolsProtocol):
    header_timeout_s = 10.0
    _header_deadline: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm_header_deadline()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm_header_deadline()
        super().connection_lost(exc)

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._arm_header_deadline()

    def on_headers_complete(self) -> None:
        self._disarm_header_deadline()
        super().on_headers_complete()

    def _arm_header_deadline(self) -> None:
        self._disarm_header_deadline()
        self._header_deadline = self.loop.call_later(self.header_timeout_s, self._headers_too_slow)

    def _disarm_header_deadline(self) -> None:
        if self._header_deadline is not None:
            self._header_deadline.cancel()
            self._header_deadline = None

    def _headers_too_slow(self) -> None:
        self._header_deadline = None
        if not self.transport.is_closing():
            self.transport.close()


def http_protocol(header_timeout_s: float) -> type[asyncio.Protocol]:
    """The HTTP protocol class uvicorn should serve with, closing slow headers after `header_timeout_s`."""
    return type("HeaderDeadlineProtocol", (_HeaderDeadlineProtocol,), {"header_timeout_s": header_timeout_s})
