"""CosyVoice2 token → mel flow: conformer encoder + causal UNet flow matching (MODEL_FACTS §6).

Streaming keeps no model caches (§6.3): every chunk re-encodes the prompt and all tokens so far and
re-solves the whole mel, then returns only the frames not returned before. Earlier frames come out the
same each time because the noise is fixed per absolute frame and attention is limited to static chunks
(25 tokens in the encoder, 50 frames in the estimator), counted from the prompt's first token; the
final chunk uses full attention, as the reference does. The stream's state is just its tokens.

Chunk grid: a non-final chunk's frames equal those of one chunk-masked pass over the whole utterance
only when the chunk ends on the 25-token grid, which is why the reference's first hop is 25 plus the
padding that completes the prompt's last grid chunk (§6.4). Other hops still work; frames of a grid
chunk split between two calls then see less of their chunk than they would offline.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from engines.config import MEL_BINS, FlowConfig
from engines.token2wav.cfm import ConditionalCFM
from engines.token2wav.conformer import chunk_attention_mask
from engines.token2wav.flow_base import ConformerFlow, FlowSpeaker, FlowStream
from engines.token2wav.unet import CausalConditionalDecoder, streaming_mask
from engines.voice import VoicePrompt

NOISE_FRAMES = 15000  # 300 s at 50 Hz: the reference's fixed noise buffer (seed 0)


@dataclass(frozen=True, eq=False)
class UNetSpeaker(FlowSpeaker):
    """A voice for the UNet flow: prompt tokens (N_p,), projected speaker vector spks (1, 80) and the
    prompt mel (1, 80, 2·N_p)."""

    tokens: torch.Tensor
    spks: torch.Tensor
    prompt_mel: torch.Tensor

    @property
    def prompt_frames(self) -> int:
        return self.prompt_mel.shape[2]

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in (self.tokens, self.spks, self.prompt_mel))


class UNetStream(FlowStream):
    """One utterance: its voice and the tokens whose frames were returned (lookahead tokens excluded)."""

    def __init__(self, speaker: UNetSpeaker) -> None:
        self.speaker = speaker
        self.tokens = speaker.tokens[:0]
        self.closed = False

    @property
    def nbytes(self) -> int:
        return 0 if self.closed else self.tokens.nbytes

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            del self.speaker, self.tokens


class UNetFlow(ConformerFlow):
    """`CausalMaskedDiffWithXvec` with the causal UNet estimator; state dict = CosyVoice2-0.5B `flow.pt`."""

    estimator_kind = "unet"

    def __init__(self, cfg: FlowConfig) -> None:
        super().__init__(cfg)
        estimator = CausalConditionalDecoder(cfg.unet)
        self.decoder = ConditionalCFM(estimator, cfg.n_timesteps, cfg.cfg_rate, NOISE_FRAMES)

    def _mel(
        self, speaker: UNetSpeaker, tokens: torch.Tensor, *, chunked: bool, lookahead: bool
    ) -> torch.Tensor:
        """Mel (1, 80, 2·n) of the n generated `tokens` after the prompt; with `lookahead` the last 3
        tokens are only PreLookahead's right context (n excludes them)."""
        all_tokens = torch.cat([speaker.tokens, tokens.to(self.device)])
        embedded = self._embed(all_tokens)
        context = None
        if lookahead:
            split = all_tokens.numel() - self.cfg.encoder.pre_lookahead
            embedded, context = embedded[:, :split], embedded[:, split:]
        n = embedded.shape[1]
        token_mask = None
        if chunked:
            token_mask = chunk_attention_mask(n, self.cfg.encoder.static_chunk_size, self.device)
        encoded, _ = self.encoder(embedded, torch.tensor([n], device=self.device), token_mask, context)
        mu = self._mu(encoded)
        cond = F.pad(speaker.prompt_mel, (0, mu.shape[2] - speaker.prompt_frames))
        frames = mu.shape[2]
        if chunked:
            mask = streaming_mask(self.cfg.unet, frames, self.device)
        else:
            mask = torch.ones(1, 1, frames, dtype=torch.bool, device=self.device)
        mel = self.decoder.solve(mu, mask, speaker.spks, cond)
        return mel[:, :, speaker.prompt_frames:]

    @torch.inference_mode()
    def prepare_speaker(self, voice: VoicePrompt) -> UNetSpeaker:
        spks = self._speaker_vector(voice.speaker_embedding)
        return UNetSpeaker(voice.speech_tokens.to(self.device), spks, self._prompt_mel(voice))

    def open_stream(self, speaker: FlowSpeaker) -> UNetStream:
        if not isinstance(speaker, UNetSpeaker):
            raise TypeError(f"UNetFlow needs a UNetSpeaker, got {type(speaker).__name__}")
        return UNetStream(speaker)

    @torch.inference_mode()
    def chunk(self, stream: FlowStream, tokens: torch.Tensor, last: bool) -> torch.Tensor:
        if not isinstance(stream, UNetStream) or stream.closed:
            raise ValueError("chunk() needs an open UNetStream")
        lookahead = self.cfg.encoder.pre_lookahead
        if not last and tokens.numel() <= lookahead:
            raise ValueError(f"a non-final chunk needs more than {lookahead} tokens, got {tokens.numel()}")
        done = self.cfg.token_mel_ratio * stream.tokens.numel()
        all_tokens = torch.cat([stream.tokens, tokens.to(self.device)])
        if all_tokens.numel() == 0:
            return torch.zeros(1, MEL_BINS, 0, device=self.device, dtype=self.dtype)
        # The final call sees everything with full attention; earlier ones are chunk-masked.
        mel = self._mel(stream.speaker, all_tokens, chunked=not last, lookahead=not last)
        stream.tokens = all_tokens if last else all_tokens[:-lookahead]
        return mel[:, :, done:]

    @torch.inference_mode()
    def offline(self, speaker: FlowSpeaker, tokens: torch.Tensor, chunked: bool = False) -> torch.Tensor:
        """Mel (1, 80, 2N) of N tokens in one pass (MODEL_FACTS §6.3, finalize).

        chunked: static-chunk attention instead of full attention — what every non-final streaming call
        computes (on the 25-token grid, a non-final chunk's frames equal this pass's frames).
        """
        if not isinstance(speaker, UNetSpeaker):
            raise TypeError(f"UNetFlow needs a UNetSpeaker, got {type(speaker).__name__}")
        return self._mel(speaker, tokens, chunked=chunked, lookahead=False)


def load_unet_flow(path: Path, cfg: FlowConfig, device: torch.device | str, dtype: torch.dtype) -> UNetFlow:
    """A UNetFlow with the weights of a CosyVoice2-0.5B `flow.pt`, strictly checked, in eval mode."""
    return UNetFlow.load(path, cfg, device, dtype)
