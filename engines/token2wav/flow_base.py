"""The interface a token → mel flow implements (Step-Audio2 DiT or CosyVoice2 UNet).

A flow turns 25 Hz speech tokens into 50 Hz, 80-bin log-mel frames (two per token), conditioned on a
voice. `torch_backend.TorchToken2Wav` drives any flow through this interface and vocodes its mel.
`ConformerFlow` holds the encoder front end and checkpoint loading that both flows share.

Chunk protocol (MODEL_FACTS §8): a non-final chunk carries its new tokens followed by 3 lookahead tokens
(handed again as the first 3 tokens of the next chunk) and yields 2·(N − 3) frames; the final chunk
carries every remaining token and yields 2·N frames. Concatenating the chunks' mel gives the utterance.
"""

from __future__ import annotations

import abc
from pathlib import Path
from typing import ClassVar, Literal, Self

import torch
import torch.nn.functional as F
from torch import nn

from engines.checkpoints import load_checkpoint, load_strict
from engines.config import FlowConfig
from engines.token2wav.base import SpeakerState
from engines.token2wav.conformer import UpsampleConformerEncoder
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


class ConformerFlow(FlowModel):
    """The front end both flows share (`CausalMaskedDiffWithXvec`): token embedding, upsample conformer
    encoder projected to mu, and the speaker vector's projection; parameter names are those of the
    released `flow.pt` files. Subclasses add `decoder`, the CFM around their estimator."""

    estimator_kind: ClassVar[Literal["dit", "unet"]]

    def __init__(self, cfg: FlowConfig) -> None:
        super().__init__()
        if cfg.estimator_kind != self.estimator_kind:
            raise ValueError(f"{type(self).__name__} needs estimator_kind {self.estimator_kind!r}, "
                             f"got {cfg.estimator_kind!r}")
        self.cfg = cfg
        self.input_embedding = nn.Embedding(cfg.vocab_size, cfg.input_size)
        self.spk_embed_affine_layer = nn.Linear(cfg.spk_embed_dim, cfg.output_size)
        self.encoder = UpsampleConformerEncoder(cfg.encoder)
        self.encoder_proj = nn.Linear(cfg.encoder.d_model, cfg.output_size)

    @classmethod
    def load(cls, path: Path, cfg: FlowConfig, device: torch.device | str, dtype: torch.dtype) -> Self:
        """The flow with the weights of a `flow.pt`, strictly checked, in eval mode."""
        with torch.device(device):
            flow = cls(cfg)
        load_strict(flow, load_checkpoint(Path(path)), str(path))
        return flow.to(device=device, dtype=dtype).eval()

    def _speaker_vector(self, embedding: torch.Tensor) -> torch.Tensor:
        """spks (1, 80) of an x-vector (192,): normalised in float32, then projected."""
        unit = F.normalize(embedding.to(self.device, torch.float32)[None], dim=1)
        return self.spk_embed_affine_layer(unit.to(self.dtype))

    def _prompt_mel(self, voice: VoicePrompt) -> torch.Tensor:
        """The voice's prompt mel as (1, 80, L_p) on the flow's device and dtype."""
        return voice.prompt_mel.to(self.device, self.dtype).T[None]

    def _embed(self, tokens: torch.Tensor) -> torch.Tensor:
        """(1, N, input_size) embeddings of tokens (N,); negative (padding) ids read row 0."""
        return self.input_embedding(tokens.to(self.device).clamp_min(0))[None]

    def _mu(self, encoded: torch.Tensor) -> torch.Tensor:
        """The encoder's output (B, T, d_model) → mu (B, 80, T)."""
        return self.encoder_proj(encoded).transpose(1, 2)
