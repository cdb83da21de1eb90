"""A zero-shot voice: the prompt features computed once from a reference clip and its transcript."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from engines.config import MEL_BINS, SPEAKER_EMBED_DIM, TOKEN_MEL_RATIO
from engines.normalize import detect_language

VOICE_FORMAT_VERSION = 1


@dataclass(frozen=True)
class VoicePrompt:
    """Prompt features of one voice.

    speech_tokens: int64 (N,) 25 Hz speech tokens of the reference clip.
    speaker_embedding: float32 (192,) CAMPPlus x-vector (not normalised).
    prompt_mel: float32 (2N, 80) log-mel at 24 kHz, 50 Hz, exactly two frames per token.
    prompt_text: the transcript of the reference clip.
    language: the clip's language code (ISO 639-1, `en`); detected from the transcript when not given
        (`engines.normalize.detect_language`, the reference front end's rule). A request in another
        language is spoken cross-lingually.
    """

    prompt_text: str
    speech_tokens: torch.Tensor
    speaker_embedding: torch.Tensor
    prompt_mel: torch.Tensor
    language: str = ""

    def __post_init__(self) -> None:
        if not self.language:
            object.__setattr__(self, "language", detect_language(self.prompt_text))
        if self.speech_tokens.dim() != 1 or self.speech_tokens.dtype != torch.int64:
            raise ValueError(f"speech_tokens must be int64 (N,), got {self.speech_tokens.dtype} "
                             f"{tuple(self.speech_tokens.shape)}")
        if tuple(self.speaker_embedding.shape) != (SPEAKER_EMBED_DIM,):
            raise ValueError(f"speaker_embedding must be ({SPEAKER_EMBED_DIM},), "
                             f"got {tuple(self.speaker_embedding.shape)}")
        expected = (TOKEN_MEL_RATIO * self.speech_tokens.numel(), MEL_BINS)
        if tuple(self.prompt_mel.shape) != expected:
            raise ValueError(f"prompt_mel must be {expected} for {self.speech_tokens.numel()} tokens, "
                             f"got {tuple(self.prompt_mel.shape)}")

    @property
    def num_tokens(self) -> int:
        return int(self.speech_tokens.numel())

    def save(self, path: Path) -> None:
        """Write atomically (temporary file + rename) so a crash never leaves half a voice."""
        path = Path(path)
        tmp = path.with_name(path.name + ".tmp")
        tensors = {
            "speech_tokens": self.speech_tokens.contiguous(),
            "speaker_embedding": self.speaker_embedding.float().contiguous(),
            "prompt_mel": self.prompt_mel.float().contiguous(),
        }
        metadata = {"prompt_text": self.prompt_text, "language": self.language,
                    "version": json.dumps(VOICE_FORMAT_VERSION)}
        save_file(tensors, str(tmp), metadata=metadata)
        tmp.replace(path)

    @staticmethod
    def load(path: Path) -> VoicePrompt:
        from safetensors import safe_open

        path = Path(path)
        try:
            with safe_open(str(path), framework="pt") as f:
                metadata = f.metadata() or {}
            tensors = load_file(str(path))
            return VoicePrompt(
                prompt_text=metadata["prompt_text"],
                speech_tokens=tensors["speech_tokens"],
                speaker_embedding=tensors["speaker_embedding"],
                prompt_mel=tensors["prompt_mel"],
                language=metadata.get("language", ""),  # files written before it: detected again
            )
        except (KeyError, ValueError, OSError, RuntimeError) as exc:
            raise ValueError(f"{path} is not a valid voice file: {exc}") from exc
