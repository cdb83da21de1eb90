"""Request bodies read with a size limit, for the transports that take JSON over HTTP."""

from __future__ import annotations

from starlette.requests import Request

from realtime.session import ServiceError


class BodyTooLarge(ServiceError):
    """A request body over the endpoint's limit (HTTP 413)."""

    def __init__(self, limit: int) -> None:
        super().__init__("body_too_large", f"the body is larger than {limit} bytes", 413)


async def read_body(request: Request, limit: int) -> bytes:
    """The whole body of `request`; raises `BodyTooLarge` once it declares or sends more than `limit`
    bytes, so an oversized body is never held in memory."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise BodyTooLarge(limit)
    body = bytearray()
    async for part in request.stream():
        body += part
        if len(body) > limit:
            raise BodyTooLarge(limit)
    return bytes(body)
