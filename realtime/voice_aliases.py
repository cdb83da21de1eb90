"""Voice aliases: names other APIs' clients send (OpenAI's `alloy`, `ash`, ...) resolved to our voices.

OpenAI clients only know OpenAI's voice names (Pipecat's service refuses any other), so each of them
speaks the voice the alias table names; a voice registered under the same name wins over its alias.
Only the OpenAI-shaped route (`POST /v1/audio/speech`) resolves them: every other API's clients send
our voice ids (or, for the vendor dialects, the vendor's ids), never OpenAI's names.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

OPENAI_VOICES = (
    "alloy", "ash", "ballad", "cedar", "coral", "echo", "fable", "marin", "nova", "onyx", "sage",
    "shimmer", "verse",
)
DEFAULT_VOICE_ALIASES: Mapping[str, str] = {name: "default" for name in OPENAI_VOICES}


def resolve_voice(name: str, exists: Callable[[str], bool], aliases: Mapping[str, str]) -> str:
    """`name` if such a voice exists, else the voice its alias names, else `name` (refused later)."""
    if exists(name) or name not in aliases:
        return name
    return aliases[name]


def parse_alias(text: str) -> tuple[str, str]:
    """`NAME=VOICE` (the CLI's `--voice-alias`) as a pair; ValueError otherwise."""
    name, sep, voice = text.partition("=")
    if not sep or not name.strip() or not voice.strip():
        raise ValueError(f"a voice alias is NAME=VOICE, got {text!r}")
    return name.strip(), voice.strip()
