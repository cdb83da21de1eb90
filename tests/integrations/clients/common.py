"""What every client script shares: the LLM-like text it streams, argument parsing and the result line.

Client scripts run in a client environment (its own Python, not ours): they import only the standard
library, this module and the client package they exercise.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections.abc import Iterator
from typing import Any

# One agent turn: two sentences, then a third that an interruption cuts off.
TURN = "Hello there, it is sunny today. Shall we walk to the park? It is a fine day to be outside."


def llm_tokens(text: str = TURN) -> Iterator[str]:
    """`text` as an LLM streams it: word-sized pieces, each carrying the space before it."""
    yield from re.findall(r"\s*\S+", text)


def parse_args(*modes: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    parser.add_argument("--http-url", required=True, help="the server's base URL, http://127.0.0.1:PORT")
    parser.add_argument("--mode", choices=modes, default=modes[0])
    parser.add_argument("--sample-rate", type=int, default=None)
    parser.add_argument("--interrupt", action="store_true", help="stop mid-utterance")
    parser.add_argument("--voice", default="default")
    parser.add_argument("--api-key", default="not-checked", help="the key the client is configured with")
    return parser.parse_args()


def report(**result: Any) -> None:
    """The result line the test reads (the last line on stdout)."""
    sys.stdout.write(json.dumps(result) + "\n")
    sys.stdout.flush()
