"""Token2Wav in PyTorch: any `FlowModel` (DiT or UNet) followed by the HiFT vocoder.

Each stream pairs the flow's stream (its caches) with a `HiFTStream` (mel/source cache and cross-fade,
MODEL_FACTS §5.6); a chunk runs the flow on its tokens and vocodes the mel it returns. The flow runs in
the requested dtype, HiFT in fp32 as in the reference. After its last chunk a stream frees its tensors.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import torch

from engines.config import ModelPaths, configs_for_models_dir
from engines.token2wav.base import ChunkJob, SpeakerState, Token2Wav, Token2WavStream
from engines.token2wav.flow_base import FlowModel, FlowSpeaker, FlowStream
from engines.token2wav.flow_dit import load_dit_flow
from engines.token2wav.hift import HiFTGenerator, HiFTStream, load_hift
from engines.voice import VoicePrompt

FlowVariant = Literal["dit", "unet"]


@dataclass(frozen=True, eq=False)
class TorchSpeaker(SpeakerState):
    """The flow's per-voice state (HiFT needs none)."""

    flow: FlowSpeaker

    @property
    def nbytes(self) -> int:
        return self.flow.nbytes


class TorchStream(Token2WavStream):
    """One utterance: the flow's stream and the vocoder's stream."""

    def __init__(self, flow: FlowStream, vocoder: HiFTStream) -> None:
        self.flow = flow
        self.vocoder = vocoder

    @property
    def nbytes(self) -> int:
        return self.flow.nbytes + self.vocoder.nbytes

    def close(self) -> None:
        self.flow.close()
        self.vocoder.close()


class TorchToken2Wav(Token2Wav):
    """`flow` and `hift` on the same device; `vocoder_seed` fixes HiFT's noise (None: fresh per stream)."""

    def __init__(self, flow: FlowModel, hift: HiFTGenerator, name: str = "torch",
                 vocoder_seed: int | None = None) -> None:
        self.flow = flow.eval()
        self.hift = hift.eval()
        self.name = name
        self.vocoder_seed = vocoder_seed

    @staticmethod
    def from_models_dir(
        models_dir: Path,
        variant: FlowVariant,
        device: torch.device | str,
        dtype: torch.dtype = torch.float32,
    ) -> TorchToken2Wav:
        """Load the `variant` flow of a models directory with its HiFT (Step-Audio2's for the DiT flow,
        CosyVoice2's for the UNet flow); the architecture comes from the directory's manifest."""
        paths = ModelPaths(Path(models_dir))
        configs = configs_for_models_dir(paths.root)
        flow: FlowModel
        if variant == "dit":
            flow = load_dit_flow(paths.dit_flow, configs.dit_flow, device, dtype)
            hift_path = paths.hift
        elif variant == "unet":
            # Imported here: the UNet flow is optional for DiT deployments.
            from engines.token2wav.flow_unet import load_unet_flow

            flow = load_unet_flow(paths.unet_flow, configs.unet_flow, device, dtype)
            hift_path = paths.cosyvoice2_hift
        else:
            raise ValueError(f"unknown flow variant {variant!r}; expected 'dit' or 'unet'")
        return TorchToken2Wav(flow, load_hift(hift_path, configs.hift, device), name=f"torch-{variant}")

    @property
    def device(self) -> torch.device:
        return self.flow.device

    def prepare_speaker(self, voice: VoicePrompt) -> TorchSpeaker:
        return TorchSpeaker(self.flow.prepare_speaker(voice))

    def open_stream(self, speaker: SpeakerState) -> TorchStream:
        if not isinstance(speaker, TorchSpeaker):
            raise TypeError(f"{self.name} needs a TorchSpeaker, got {type(speaker).__name__}")
        return TorchStream(self.flow.open_stream(speaker.flow), HiFTStream(self.hift, seed=self.vocoder_seed))

    def run_chunk(self, job: ChunkJob) -> torch.Tensor:
        stream = job.stream
        if not isinstance(stream, TorchStream):
            raise TypeError(f"{self.name} needs a TorchStream, got {type(stream).__name__}")
        mel = self.flow.chunk(stream.flow, job.tokens, job.last)
        audio = stream.vocoder.process(mel, job.last)
        if job.last:
            stream.close()
        return audio

    @torch.inference_mode()
    def offline(self, speaker: SpeakerState, tokens: torch.Tensor) -> torch.Tensor:
        if not isinstance(speaker, TorchSpeaker):
            raise TypeError(f"{self.name} needs a TorchSpeaker, got {type(speaker).__name__}")
        if tokens.numel() == 0:
            return torch.zeros(0)
        mel = self.flow.offline(speaker.flow, tokens).float()
        generator = None if self.vocoder_seed is None else torch.Generator().manual_seed(self.vocoder_seed)
        speech, _ = self.hift(mel, generator=generator)
        return speech[0].float().cpu()
