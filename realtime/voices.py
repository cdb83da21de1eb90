"""The voice registry: named `VoicePrompt`s, one safetensors file each, in one directory.

`default` ships with the models (`<models>/voices/default.safetensors`) and cannot be deleted. Ids
are short slugs, so a voice id can never name a path outside the directory. Files are written
atomically (`VoicePrompt.save`), so a crash leaves either the old set or the new one, and every file
present at start is loaded again.
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass
from pathlib import Path

from engines.config import TOKEN_RATE_HZ
from engines.voice import VoicePrompt
from realtime.session import ServiceError

logger = logging.getLogger(__name__)

DEFAULT_VOICE = "default"
VOICE_SUFFIX = ".safetensors"
_VOICE_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9_-]{0,63}")


def check_voice_id(voice_id: str) -> str:
    """`voice_id` if it is a valid id (1–64 of letters, digits, '_' and '-', starting alphanumeric)."""
    if not _VOICE_ID.fullmatch(voice_id):
        raise ServiceError(
            "invalid_voice_id",
            "a voice id is 1 to 64 letters, digits, '_' or '-', starting with a letter or digit",
        )
    return voice_id


@dataclass(frozen=True)
class VoiceInfo:
    """What the API shows about a voice (never its transcript)."""

    voice_id: str
    prompt_seconds: float
    builtin: bool
    language: str  # ISO 639 code of its clip (cross-lingual synthesis for text in another)


class VoiceRegistry:
    """Voices by id, backed by `directory`; the built-in `default` may live in another directory."""

    def __init__(self, directory: Path, default_file: Path) -> None:
        self._directory = Path(directory)
        self._default_file = Path(default_file)
        self._voices: dict[str, VoicePrompt] = {}

    def load(self) -> None:
        """Read `default` and every stored voice; a voice file that does not load is skipped, logged."""
        if not self._default_file.is_file():
            raise FileNotFoundError(
                f"the default voice {self._default_file} is missing from the models directory"
            )
        self._voices = {DEFAULT_VOICE: VoicePrompt.load(self._default_file)}
        self._directory.mkdir(parents=True, exist_ok=True)
        for path in sorted(self._directory.glob(f"*{VOICE_SUFFIX}")):
            voice_id = path.name[: -len(VOICE_SUFFIX)]
            if voice_id == DEFAULT_VOICE or not _VOICE_ID.fullmatch(voice_id):
                continue
            try:
                self._voices[voice_id] = VoicePrompt.load(path)
            except ValueError as exc:
                logger.warning("skipping voice file %s: %s", path, exc)
        logger.info("%d voices loaded", len(self._voices))

    def __contains__(self, voice_id: str) -> bool:
        return voice_id in self._voices

    def get(self, voice_id: str) -> VoicePrompt:
        try:
            return self._voices[voice_id]
        except KeyError:
            raise ServiceError("voice_not_found", f"there is no voice {voice_id!r}", 404) from None

    def info(self, voice_id: str) -> VoiceInfo:
        prompt = self.get(voice_id)
        return VoiceInfo(voice_id, prompt.num_tokens / TOKEN_RATE_HZ, voice_id == DEFAULT_VOICE,
                         prompt.language)

    def list(self) -> list[VoiceInfo]:
        return [self.info(voice_id) for voice_id in sorted(self._voices)]

    def add(self, voice_id: str, prompt: VoicePrompt) -> VoiceInfo:
        """Store a new voice on disk, then make it available. Existing ids are refused."""
        check_voice_id(voice_id)
        if voice_id in self._voices:
            raise ServiceError("voice_exists", f"a voice {voice_id!r} already exists; delete it first", 409)
        prompt.save(self._path(voice_id))
        self._voices[voice_id] = prompt
        return self.info(voice_id)

    def remove(self, voice_id: str) -> None:
        check_voice_id(voice_id)
        if voice_id == DEFAULT_VOICE:
            raise ServiceError("voice_protected", "the default voice cannot be deleted", 403)
        self.get(voice_id)
        self._path(voice_id).unlink(missing_ok=True)
        del self._voices[voice_id]

    def _path(self, voice_id: str) -> Path:
        return self._directory / f"{voice_id}{VOICE_SUFFIX}"
