"""Checks every transport makes at its edge, before anything reaches a session or an engine.

JSON is parsed with bounded nesting and finite numbers only; numbers must be finite and within their
field's range (a 400-digit integer is refused here, not by a float conversion or a tensor later); text
must be valid Unicode (a lone surrogate such as "\\ud800" cannot be encoded as UTF-8). Each transport
turns an `InvalidInput` into its own error shape (an OpenAI error body, a websocket error event, a
data-channel error) naming the field.
"""

from __future__ import annotations

import json
import math
from typing import Any

from engines.errors import CodedError
from realtime.audio import MAX_SPEED, MIN_SPEED

MAX_JSON_DEPTH = 32
# Seeds are 64-bit on every engine; lengths beyond ~7 minutes of speech are not a test fixture.
MAX_SEED = 2**63 - 1
MAX_FIXED_LENGTH = 10_000


class InvalidInput(CodedError):
    """A field (or a whole message) no transport can accept; `field` names it where there is one."""

    def __init__(self, code: str, message: str, field: str | None = None) -> None:
        super().__init__(code, message)
        self.field = field


def _finite_float(literal: str) -> float:
    value = float(literal)
    if not math.isfinite(value):
        raise InvalidInput("invalid_json", f"the number {literal[:32]} is out of range")
    return value


def _no_constant(name: str) -> Any:
    raise InvalidInput("invalid_json", f"{name} is not a number JSON allows")


def _depth(value: Any) -> int:
    """How deeply containers nest in a parsed JSON value (iteratively: no recursion limit)."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, dict):
            item = list(item.values())
        if isinstance(item, list):
            deepest = max(deepest, depth)
            stack.extend((child, depth + 1) for child in item if isinstance(child, dict | list))
    return deepest


# One decoder for every message (json.loads builds one per call when given hooks). Bytes go through
# json.loads, which also detects their encoding.
_DECODER = json.JSONDecoder(parse_float=_finite_float, parse_constant=_no_constant)


def parse_json(data: str | bytes) -> Any:
    """A JSON document with finite numbers and at most `MAX_JSON_DEPTH` levels of nesting."""
    try:
        if isinstance(data, str):
            value = _DECODER.decode(data)
        else:
            value = json.loads(data, parse_float=_finite_float, parse_constant=_no_constant)
    except json.JSONDecodeError as exc:
        message = f"the message is not valid JSON ({exc.msg} at {exc.pos})"
        raise InvalidInput("invalid_json", message) from None
    except RecursionError:
        raise InvalidInput("invalid_json", f"JSON may nest at most {MAX_JSON_DEPTH} levels") from None
    except (UnicodeDecodeError, ValueError):  # bad UTF-8; an integer of more than 4300 digits
        raise InvalidInput("invalid_json", "the message is not valid JSON") from None
    if _depth(value) > MAX_JSON_DEPTH:
        raise InvalidInput("invalid_json", f"JSON may nest at most {MAX_JSON_DEPTH} levels")
    return value


def number(value: Any, field: str, low: float, high: float, range_code: str = "out_of_range") -> float:
    """`value` as a float if it is a JSON number (not a bool) in [low, high]; `range_code` is the
    error's code when it is out of range."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise InvalidInput("invalid_type", f"'{field}' must be a number", field)
    if not low <= value <= high:  # exact for any int, false for NaN
        raise InvalidInput(range_code, f"'{field}' must be between {low:g} and {high:g}", field)
    return float(value)


def integer(value: Any, field: str, low: int, high: int) -> int:
    """`value` if it is a JSON integer (not a bool) in [low, high]."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidInput("invalid_type", f"'{field}' must be an integer", field)
    if not low <= value <= high:
        raise InvalidInput("out_of_range", f"'{field}' must be an integer from {low} to {high}", field)
    return value


def speed(value: Any, field: str = "speed") -> float:
    return number(value, field, MIN_SPEED, MAX_SPEED, "invalid_speed")


def seed(value: Any, field: str = "seed") -> int | None:
    return None if value is None else integer(value, field, 0, MAX_SEED)


def fixed_length(value: Any, field: str = "fixed_length") -> int | None:
    return None if value is None else integer(value, field, 1, MAX_FIXED_LENGTH)


def is_valid_text(text: str) -> bool:
    """Whether `text` is valid Unicode (encodable as UTF-8: no lone surrogates)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def text(value: Any, field: str) -> str:
    """`value` if it is a string of valid Unicode."""
    if not isinstance(value, str):
        raise InvalidInput("invalid_type", f"'{field}' must be a string", field)
    if not is_valid_text(value):
        message = f"'{field}' is not valid Unicode (it holds a lone surrogate)"
        raise InvalidInput("invalid_text", message, field)
    return value
