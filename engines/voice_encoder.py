"""Reference clip + transcript → `VoicePrompt`, with the two ONNX front-end models (MODEL_FACTS §2).

The speech tokenizer (S3Tokenizer v2) turns the 16 kHz Whisper log-mel into 25 Hz speech tokens; CAMPPlus
turns the 16 kHz Kaldi fbank into a 192-d speaker vector; the 24 kHz flow mel becomes the prompt mel.
Tokens and mel are cropped to n = min(mel_frames // 2, tokens) tokens and 2n frames (§2.3).
Inputs are fed by position, as the reference does, so either model's tensor names may differ.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnxruntime
import torch

from engines.audio_features import (
    FLOW_SAMPLE_RATE,
    MAX_DECODE_RATE,
    MIN_DECODE_RATE,
    WHISPER_SAMPLE_RATE,
    AudioDecodeError,
    AudioTooLong,
    UnsupportedSampleRate,
    campplus_features,
    decode_audio,
    flow_mel,
    whisper_log_mel,
)
from engines.config import SPEAKER_EMBED_DIM, SPEECH_CODEBOOK, TOKEN_MEL_RATIO
from engines.errors import CodedError
from engines.resample import resample
from engines.voice import VoicePrompt

logger = logging.getLogger(__name__)

CUDA_PROVIDER = "CUDAExecutionProvider"
CPU_PROVIDER = "CPUExecutionProvider"


class VoiceError(CodedError, ValueError):
    """A reference clip or transcript that cannot make a voice; `code` is machine readable:
    `invalid_audio`, `unsupported_sample_rate`, `silent_audio`, `audio_too_short`, `audio_too_long`,
    `empty_transcript`."""


@dataclass(frozen=True)
class VoiceLimits:
    """What a usable reference clip looks like. The speech tokenizer takes at most 30 s in one call."""

    min_seconds: float = 1.0
    max_seconds: float = 30.0
    silence_rms: float = 1e-3  # about -60 dBFS

    def __post_init__(self) -> None:
        if not 0 < self.min_seconds < self.max_seconds <= 30.0:
            raise ValueError(f"need 0 < min_seconds < max_seconds <= 30, got {self.min_seconds}, "
                             f"{self.max_seconds}")
        if self.silence_rms < 0:
            raise ValueError(f"silence_rms must be >= 0, got {self.silence_rms}")


def onnx_providers(device: str = "auto") -> list[str]:
    """Execution providers for `device` ('auto': CUDA when onnxruntime has it, else CPU; 'cpu'; 'cuda')."""
    if device not in ("auto", "cpu", "cuda"):
        raise ValueError(f"device must be 'auto', 'cpu' or 'cuda', got {device!r}")
    available = onnxruntime.get_available_providers()
    if device == "cuda" and CUDA_PROVIDER not in available:
        raise RuntimeError(f"onnxruntime has no CUDA provider here (available: {available})")
    if device != "cpu" and CUDA_PROVIDER in available:
        return [CUDA_PROVIDER, CPU_PROVIDER]
    return [CPU_PROVIDER]


def open_session(path: Path, device: str = "auto", num_threads: int = 1) -> onnxruntime.InferenceSession:
    options = onnxruntime.SessionOptions()
    options.graph_optimization_level = onnxruntime.GraphOptimizationLevel.ORT_ENABLE_ALL
    options.intra_op_num_threads = num_threads
    return onnxruntime.InferenceSession(str(path), sess_options=options, providers=onnx_providers(device))


class VoiceEncoder:
    """Computes voice prompts with the speech-tokenizer and CAMPPlus ONNX models. Thread-safe
    (onnxruntime sessions may be run concurrently); CPU-bound, so call it off the event loop."""

    def __init__(
        self,
        speech_tokenizer_onnx: Path,
        campplus_onnx: Path,
        device: str = "auto",
        limits: VoiceLimits | None = None,
        num_threads: int = 1,
    ) -> None:
        for path in (speech_tokenizer_onnx, campplus_onnx):
            if not Path(path).is_file():
                raise FileNotFoundError(f"ONNX model {path} does not exist")
        self._tokenizer = open_session(Path(speech_tokenizer_onnx), device, num_threads)
        self._campplus = open_session(Path(campplus_onnx), device, num_threads)
        self.limits = limits or VoiceLimits()
        logger.info("voice encoder on %s", self._tokenizer.get_providers()[0])

    def encode(
        self, audio: bytes | Path | np.ndarray, transcript: str, sample_rate: int | None = None
    ) -> VoicePrompt:
        """The voice prompt of a clip (encoded bytes, a file, or float samples with `sample_rate`)."""
        text = transcript.strip()
        if not text:
            raise VoiceError("empty_transcript", "the transcript of the reference clip is empty")
        samples, rate = self._load(audio, sample_rate, self.limits.max_seconds)
        self._validate(samples, rate)
        try:
            audio_16k = resample(samples, rate, WHISPER_SAMPLE_RATE)
            audio_24k = resample(samples, rate, FLOW_SAMPLE_RATE)
        except ValueError as exc:  # a rate sharing too small a factor with 16 and 24 kHz
            raise VoiceError("unsupported_sample_rate", str(exc)) from exc
        tokens = self.speech_tokens(audio_16k)
        embedding = self.speaker_embedding(audio_16k)
        mel = flow_mel(audio_24k)
        n = min(mel.shape[0] // TOKEN_MEL_RATIO, tokens.numel())
        if n == 0:
            raise VoiceError("audio_too_short", "the clip yields no speech tokens")
        return VoicePrompt(
            prompt_text=text,
            speech_tokens=tokens[:n].clone(),
            speaker_embedding=embedding,
            prompt_mel=mel[: TOKEN_MEL_RATIO * n].clone(),
        )

    def speech_tokens(self, audio_16k: np.ndarray) -> torch.Tensor:
        """int64 (≈ N / 640,) 25 Hz speech tokens of 16 kHz audio (one ONNX call, ≤ 30 s)."""
        feats = whisper_log_mel(audio_16k)[None].numpy()
        inputs = self._tokenizer.get_inputs()
        lengths = np.array([feats.shape[2]], dtype=np.int32)
        (tokens, *_) = self._tokenizer.run(None, {inputs[0].name: feats, inputs[1].name: lengths})
        tokens = torch.from_numpy(np.asarray(tokens).reshape(-1).astype(np.int64))
        if tokens.numel() and not (int(tokens.min()) >= 0 and int(tokens.max()) < SPEECH_CODEBOOK):
            raise RuntimeError(f"speech tokenizer produced ids outside [0, {SPEECH_CODEBOOK})")
        return tokens

    def speaker_embedding(self, audio_16k: np.ndarray) -> torch.Tensor:
        """float32 (192,) CAMPPlus x-vector of 16 kHz audio (not normalised)."""
        feats = campplus_features(audio_16k)[None].numpy()
        (embedding, *_) = self._campplus.run(None, {self._campplus.get_inputs()[0].name: feats})
        embedding = torch.from_numpy(np.asarray(embedding, dtype=np.float32).reshape(-1).copy())
        if embedding.numel() != SPEAKER_EMBED_DIM:
            raise RuntimeError(f"CAMPPlus produced {embedding.numel()} values, expected {SPEAKER_EMBED_DIM}")
        return embedding

    @staticmethod
    def _load(
        audio: bytes | Path | np.ndarray, sample_rate: int | None, max_seconds: float
    ) -> tuple[np.ndarray, int]:
        """Samples and rate of the clip; encoded audio is decoded only up to `max_seconds`."""
        if isinstance(audio, np.ndarray):
            if sample_rate is None or sample_rate <= 0:
                raise ValueError("sample_rate is required (and positive) for raw samples")
            samples = audio.astype(np.float32)
            if samples.ndim == 2:  # (frames, channels)
                samples = samples.mean(axis=1)
            if samples.ndim != 1:
                raise VoiceError("invalid_audio", f"samples must be 1-D or (frames, channels), got "
                                                  f"{audio.shape}")
            return samples, sample_rate
        try:
            return decode_audio(audio, max_seconds=max_seconds)
        except AudioTooLong:
            raise VoiceError("audio_too_long", f"the clip lasts more than {max_seconds:g} s; at most "
                                               f"{max_seconds:g} s is allowed") from None
        except UnsupportedSampleRate as exc:
            raise VoiceError("unsupported_sample_rate", str(exc)) from None
        except (AudioDecodeError, OSError) as exc:
            raise VoiceError("invalid_audio", str(exc)) from exc

    def _validate(self, samples: np.ndarray, rate: int) -> None:
        if not MIN_DECODE_RATE <= rate <= MAX_DECODE_RATE:
            raise VoiceError("unsupported_sample_rate", str(UnsupportedSampleRate(rate)))
        if not np.all(np.isfinite(samples)):
            raise VoiceError("invalid_audio", "audio contains NaN or infinite samples")
        seconds = samples.size / rate
        if seconds < self.limits.min_seconds:
            raise VoiceError("audio_too_short", f"the clip lasts {seconds:.2f} s; at least "
                                                f"{self.limits.min_seconds:g} s is needed")
        if seconds > self.limits.max_seconds:
            raise VoiceError("audio_too_long", f"the clip lasts {seconds:.2f} s; at most "
                                               f"{self.limits.max_seconds:g} s is allowed")
        rms = float(np.sqrt(np.mean(np.square(samples, dtype=np.float64))))
        if rms < self.limits.silence_rms:
            raise VoiceError("silent_audio", f"the clip is silent (RMS {rms:.1e})")
