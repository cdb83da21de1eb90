"""The one error shape the engines raise for bad requests and inputs: a machine-readable `code` and a
sentence for a person. Transports turn it into their own error (HTTP status, websocket event)."""

from __future__ import annotations


class CodedError(Exception):
    """`code` names the problem for programs (`empty_text`, `context_too_long`, ...); `message` (also
    `str(error)`) is the sentence for people."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
