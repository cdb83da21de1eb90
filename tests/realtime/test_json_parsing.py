"""Messages as text frames (str, one shared decoder) and as bytes (HTTP bodies, json.loads) parse alike."""

from __future__ import annotations

import pytest

from realtime.validation import InvalidInput, parse_json

DOCUMENTS = [
    '{"type": "text", "text": "caf\\u00e9 ok", "speed": 1.25}',
    '{"n": NaN}',
    '{"n": -Infinity}',
    '{"n": 1e400}',
    '{"n": ' + "1" * 5000 + "}",
    '{"x": ' + "[" * 40 + "]" * 40 + "}",
    '{"x": ' + "[" * 100_000 + "]" * 100_000 + "}",
    '{"a": 1} trailing',
    "{oops",
    "",
]


def outcome(data: str | bytes) -> object:
    try:
        return parse_json(data)
    except InvalidInput as exc:
        return exc.code


@pytest.mark.parametrize("document", DOCUMENTS, ids=lambda d: d[:24])
def test_text_and_bytes_parse_alike(document: str) -> None:
    as_text, as_bytes = outcome(document), outcome(document.encode())
    assert as_text == as_bytes
    if document.startswith('{"type"'):
        assert as_text == {"type": "text", "text": "café ok", "speed": 1.25}
    else:
        assert as_text == "invalid_json"


def test_a_byte_order_mark_is_refused_in_text_as_json_loads_refuses_it() -> None:
    assert outcome("\ufeff{}") == "invalid_json"
    assert outcome("\ufeff{}".encode()) == {}  # bytes: json.loads reads UTF-8 with its mark
