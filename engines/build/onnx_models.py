"""Stand-ins for the speech tokenizer and CAMPPlus ONNX files of a synthetic models directory.

They honour the real input/output contracts (MODEL_FACTS §2.1–2.2) with dynamic time axes and are
deterministic functions of the input features, so different clips give different voices:
- speech tokenizer: feats (1, 128, T) float32 + feats_length (1,) int32 → indices (1, ceil(T / 4)) int64
  in [0, 6561): each 4-frame average is projected to 8 values quantised to {0, 1, 2} (an FSQ-like 3^8 code);
- CAMPPlus: input (1, T, 80) float32 → (1, 192) float32: a fixed linear map of the per-bin mean and
  standard deviation over time.
"""

from __future__ import annotations

import math
import warnings
from pathlib import Path

import torch
from torch import nn

from engines.audio_features import FBANK_BINS, WHISPER_MELS
from engines.config import SPEAKER_EMBED_DIM, SPEECH_CODEBOOK

FSQ_DIGITS = round(math.log(SPEECH_CODEBOOK, 3))  # 3^8 codes
FRAMES_PER_TOKEN = 4
OPSET = 17


class SyntheticSpeechTokenizer(nn.Module):
    projection: torch.Tensor
    place_values: torch.Tensor

    def __init__(self, seed: int) -> None:
        super().__init__()
        generator = torch.Generator().manual_seed(seed)
        projection = torch.randn(FSQ_DIGITS, WHISPER_MELS, generator=generator) * (4.0 / WHISPER_MELS**0.5)
        self.register_buffer("projection", projection)
        self.register_buffer("place_values", 3 ** torch.arange(FSQ_DIGITS, dtype=torch.int64))

    def forward(self, feats: torch.Tensor, feats_length: torch.Tensor) -> torch.Tensor:
        frames = torch.arange(feats.shape[2], device=feats.device)
        feats = feats * (frames[None, None, :] < feats_length[:, None, None]).to(feats.dtype)
        pooled = nn.functional.avg_pool1d(feats, FRAMES_PER_TOKEN, FRAMES_PER_TOKEN, ceil_mode=True)
        centred = pooled - pooled.mean(dim=1, keepdim=True)  # spectral shape, not loudness
        scores = torch.einsum("dm,bmt->btd", self.projection, centred)
        digits = torch.clamp(torch.round(scores) + 1, 0, 2).to(torch.int64)
        return (digits * self.place_values).sum(dim=-1)


class SyntheticCampPlus(nn.Module):
    def __init__(self, seed: int) -> None:
        super().__init__()
        generator = torch.Generator().manual_seed(seed)
        self.proj = nn.Linear(2 * FBANK_BINS, SPEAKER_EMBED_DIM)
        with torch.no_grad():
            self.proj.weight.copy_(torch.randn(self.proj.weight.shape, generator=generator) * 0.2)
            self.proj.bias.zero_()

    def forward(self, feats: torch.Tensor) -> torch.Tensor:
        mean = feats.mean(dim=1)
        std = torch.sqrt(torch.clamp((feats * feats).mean(dim=1) - mean * mean, min=1e-8))
        return self.proj(torch.cat([mean, std], dim=-1))


def _export(module: nn.Module, args: tuple[torch.Tensor, ...], path: Path, input_names: list[str],
            output_names: list[str], dynamic_axes: dict[str, dict[int, str]]) -> None:
    with warnings.catch_warnings():
        # The TorchScript exporter is deprecated but needs no onnxscript, which is not a dependency.
        warnings.simplefilter("ignore", DeprecationWarning)
        torch.onnx.export(
            module.eval(), args, str(path), dynamo=False, opset_version=OPSET, input_names=input_names,
            output_names=output_names, dynamic_axes=dynamic_axes,
        )


def export_speech_tokenizer(path: Path, seed: int) -> None:
    frames = 40
    _export(
        SyntheticSpeechTokenizer(seed),
        (torch.randn(1, WHISPER_MELS, frames), torch.tensor([frames], dtype=torch.int32)),
        path,
        input_names=["feats", "feats_length"],
        output_names=["indices"],
        dynamic_axes={"feats": {0: "batch", 2: "frames"}, "feats_length": {0: "batch"},
                      "indices": {0: "batch", 1: "tokens"}},
    )


def export_campplus(path: Path, seed: int) -> None:
    _export(
        SyntheticCampPlus(seed),
        (torch.randn(1, 50, FBANK_BINS),),
        path,
        input_names=["input"],
        output_names=["embedding"],
        dynamic_axes={"input": {0: "batch", 1: "frames"}, "embedding": {0: "batch"}},
    )
