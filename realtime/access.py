"""Who is asking, and may they: API keys, the credential each client dialect sends, web origins.

Pure policy over headers and query strings (no sockets). Credentials are accepted the way each API's
own clients send them, on every route (a client is not refused for using another dialect's carrier):

- `Authorization: Bearer <key>` (OpenAI SDKs; Cartesia's newer SDKs; the native websocket);
- `X-API-Key: <key>` header or `?api_key=<key>` (Cartesia's SDKs, Pipecat and LiveKit plugins: the
  query parameter on websockets, the header over HTTP);
- `xi-api-key: <key>` header or `?xi_api_key=` / `?authorization=` (ElevenLabs' SDK and plugins); on
  the ElevenLabs websockets the first message may carry `xi_api_key` or `authorization` instead
  (transports/ws.py).

A principal is what limits and voice ownership are keyed by: `key:<hash prefix>` for a key (the key
itself is never stored, shown or logged), `ip:<address>` when the service is open.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import os
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

KEYS_ENV = "REALTIME_API_KEYS"
OPERATOR = "operator"
QUERY_KEY_PARAMS = ("api_key", "xi_api_key", "authorization")
_HEADER_KEY_NAMES = ("x-api-key", "xi-api-key")
_LOOPBACK_HOSTS = ("127.0.0.1", "::1", "localhost")


def key_id(key: str) -> str:
    """The principal of `key`: a short hash, safe to store and log."""
    return "key:" + hashlib.sha256(key.encode()).hexdigest()[:16]


def read_keys(keys: Iterable[str] = (), keys_file: Path | None = None, env: Mapping[str, str] | None = None
              ) -> tuple[str, ...]:
    """Keys from the command line, a file (one per line, `#` comments) and `$REALTIME_API_KEYS`
    (comma-separated), in that order, without duplicates."""
    found = [k.strip() for k in keys]
    if keys_file is not None:
        for line in Path(keys_file).read_text().splitlines():
            line = line.split("#", 1)[0].strip()
            if line:
                found.append(line)
    environment = os.environ if env is None else env
    found.extend(k.strip() for k in environment.get(KEYS_ENV, "").split(","))
    return tuple(dict.fromkeys(k for k in found if k))


def presented_key(headers: Mapping[str, str], query: Mapping[str, str]) -> str | None:
    """The API key a request carries, in any of the dialects' places; None when it carries none."""
    authorization = headers.get("authorization")
    if authorization:
        scheme, _, value = authorization.partition(" ")
        return value.strip() if scheme.lower() == "bearer" else authorization.strip()
    for name in _HEADER_KEY_NAMES:
        if headers.get(name):
            return headers[name].strip()
    for name in QUERY_KEY_PARAMS:
        value = query.get(name, "")
        if value:
            scheme, _, rest = value.partition(" ")
            return rest.strip() if scheme.lower() == "bearer" else value.strip()
    return None


class ApiKeys:
    """The accepted keys; compares in constant time and maps a key to its principal."""

    def __init__(self, keys: Iterable[str]) -> None:
        self._digests = {hashlib.sha256(k.encode()).digest(): key_id(k) for k in keys}

    @property
    def required(self) -> bool:
        return bool(self._digests)

    def principal(self, key: str) -> str | None:
        """The principal of a presented key, or None when it is not accepted."""
        digest = hashlib.sha256(key.encode()).digest()
        found = None
        for known, principal in self._digests.items():
            if hmac.compare_digest(known, digest):
                found = principal
        return found


@dataclass(frozen=True)
class OriginPolicy:
    """Which browser origins may call the service: its own, plus `allowed` (`*` for any)."""

    allowed: tuple[str, ...] = ()

    def allows(self, origin: str | None, host: str | None) -> bool:
        """Whether a request with this `Origin` header reaching this `Host` may proceed. Requests
        without an Origin are not from a browser page (SDKs, curl) and are not the concern here."""
        if origin is None:
            return True
        if "*" in self.allowed or origin.rstrip("/") in self.allowed:
            return True
        parts = urlsplit(origin)
        return host is not None and parts.scheme in ("http", "https") and parts.netloc.lower() == host.lower()


def is_loopback(host: str) -> bool:
    return host in _LOOPBACK_HOSTS or host.startswith("127.")


_SECRET_IN_QUERY = re.compile(
    r"((?:^|[?&])(?:" + "|".join(QUERY_KEY_PARAMS) + r")=)[^&\s\"]*", re.IGNORECASE
)


def redact(text: str) -> str:
    """`text` with the values of credential query parameters replaced by `***`."""
    return _SECRET_IN_QUERY.sub(r"\1***", text)


class RedactKeys(logging.Filter):
    """Blanks API keys out of uvicorn's access and websocket log lines, which include query strings."""

    def filter(self, record: logging.LogRecord) -> bool:
        if isinstance(record.args, tuple):
            record.args = tuple(redact(a) if isinstance(a, str) else a for a in record.args)
        if isinstance(record.msg, str):
            record.msg = redact(record.msg)
        return True


def install_log_redaction() -> None:
    """Redact keys from every uvicorn logger that prints request paths (idempotent)."""
    for name in ("uvicorn.access", "uvicorn.error"):
        logger = logging.getLogger(name)
        if not any(isinstance(f, RedactKeys) for f in logger.filters):
            logger.addFilter(RedactKeys())
