"""The interface a token → mel flow implements (Step-Audio2 DiT or CosyVoice2 UNet).

A flow turns 25 Hz speech tokens into 50 Hz, 80-bin log-mel frames (two per token), conditioned on a
voice. `torch_backend.TorchToken2Wav` drives any flow through this interface and vocodes its mel.

Chunk protocol (MODEL_FACTS §8): a non-final chunk carries its new tokens followed by 3 lookahead tokens
(handed again as the first 3 tokens of the next chunk) and yields 2·(N − 3) frames; the final chunk
carries every remaining token and yields 2·N frames. Concatenating the chunks' mel gives the utterance.
"""

from __future__ import annotations

import abc

import torch
from torch import nn

from engines.token2wav.base import SpeakerState
from engines.voice import VoicePrompt


class FlowSpeaker(SpeakerState):
    """Per-voice flow state, computed once and shared read-only by every stream of that voice."""


class FlowStream(abc.ABC):
    """Per-utterance flow state; owned by one request and dropped by `close()`."""

    @property
    @abc.abstractmethod
    def nbytes(self) -> int:
        """Device memory held by this stream alone (shared speaker tensors excluded)."""

    @abc.abstractmethod
    def close(self) -> None:
        """Drop the stream's tensors now; the stream cannot be used afterwards. Idempotent."""


class FlowModel(nn.Module, abc.ABC):
    """Token → mel flow matching; every method runs without autograd on the module's device."""

    @abc.abstractmethod
    def prepare_speaker(self, voice: VoicePrompt) -> FlowSpeaker:
        """Everything about `voice` the flow needs, computed once."""

    @abc.abstractmethod
    def open_stream(self, speaker: FlowSpeaker) -> FlowStream:
        """A new utterance in that voice."""

    @abc.abstractmethod
    def chunk(self, stream: FlowStream, tokens: torch.Tensor, last: bool) -> torch.Tensor:
        """Mel (1, 80, F) of one chunk; `tokens` int64 (N,) per the chunk protocol above.

        F = 2·(N − 3) for a non-final chunk and 2·N for the last one.
        """

    @abc.abstractmethod
    def offline(self, speaker: FlowSpeaker, tokens: torch.Tensor) -> torch.Tensor:
        """Mel (1, 80, 2N) of a whole utterance of N tokens at once (no streaming)."""

    @property
    def device(self) -> torch.device:
        return next(self.parameters()).device

    @property
    def dtype(self) -> torch.dtype:
        return next(self.parameters()).dtype
