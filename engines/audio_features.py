"""Audio decoding and the three feature front ends of the prompt path (MODEL_FACTS §2.1–2.3).

- `whisper_log_mel`: 16 kHz → (128, T) log-mel for the speech tokenizer, T = N // 160.
- `kaldi_fbank` / `campplus_features`: 16 kHz → (T, 80) Kaldi log fbank for CAMPPlus,
  T = 1 + (N − 400) // 160, mean-normalised per utterance.
- `flow_mel`: 24 kHz → (T, 80) natural-log mel for the flow prompt, T = N // 480.

Pure numpy/torch (no torchaudio/librosa); filterbanks are computed here from their published formulas.
Clips reach these rates through `engines.resample` (torchaudio's default sinc kernel, as the reference).
"""

from __future__ import annotations

import io
import math
from functools import cache
from pathlib import Path

import numpy as np
import torch

WHISPER_SAMPLE_RATE = 16000
WHISPER_N_FFT = 400
WHISPER_HOP = 160
WHISPER_MELS = 128

FBANK_BINS = 80
FBANK_WINDOW = 400  # 25 ms at 16 kHz
FBANK_SHIFT = 160  # 10 ms
FBANK_FFT = 512
FBANK_LOW_HZ = 20.0
FBANK_PREEMPHASIS = 0.97

FLOW_SAMPLE_RATE = 24000
FLOW_N_FFT = 1920
FLOW_HOP = 480
FLOW_MELS = 80
FLOW_FMAX = 8000.0


# Sample rates a reference clip may have; outside them a file is refused before any sample is decoded.
MIN_DECODE_RATE = 8000
MAX_DECODE_RATE = 384000
_DECODE_BLOCK_FRAMES = 1 << 16


class AudioDecodeError(ValueError):
    """Bytes or a file that no available decoder reads as audio."""


class AudioTooLong(AudioDecodeError):
    """Audio longer than the caller's limit; decoding stopped there."""

    def __init__(self, max_seconds: float) -> None:
        super().__init__(f"the audio is longer than {max_seconds:g} s")
        self.max_seconds = max_seconds


def decode_audio(source: bytes | Path | str, max_seconds: float | None = None) -> tuple[np.ndarray, int]:
    """Decode a file path or encoded bytes to (mono float32 samples in [-1, 1], sample rate).

    WAV/FLAC/OGG-Vorbis go through libsndfile; anything else (mp3, opus, webm, m4a, …) through
    PyAV/FFmpeg. Channels are averaged. Decoding is streamed block by block: with `max_seconds`, it
    stops with `AudioTooLong` as soon as the audio passes that length, so a small file that expands to
    hours of audio costs no more memory than `max_seconds` of it. Sample rates outside
    [MIN_DECODE_RATE, MAX_DECODE_RATE] are refused before decoding.
    """
    data = source if isinstance(source, bytes) else Path(source).read_bytes()
    if not data:
        raise AudioDecodeError("audio is empty (0 bytes)")
    try:
        return _decode_soundfile(data, max_seconds)
    except AudioDecodeError:
        raise
    except (RuntimeError, TypeError, ValueError):
        pass  # libsndfile does not know this container: try FFmpeg.
    try:
        return _decode_av(data, max_seconds)
    except AudioDecodeError:
        raise
    except Exception as exc:  # PyAV raises a family of FFmpeg errors with no common base besides Exception.
        raise AudioDecodeError(f"not a readable audio file: {exc}") from exc


class UnsupportedSampleRate(AudioDecodeError):
    """Audio at a sample rate outside [MIN_DECODE_RATE, MAX_DECODE_RATE]."""

    def __init__(self, rate: int) -> None:
        super().__init__(
            f"sample rate {rate} Hz is not supported; use {MIN_DECODE_RATE} to {MAX_DECODE_RATE} Hz"
        )


def _check_rate(rate: int) -> None:
    if not MIN_DECODE_RATE <= rate <= MAX_DECODE_RATE:
        raise UnsupportedSampleRate(rate)


class _Collector:
    """Mono blocks gathered until `max_samples` would be passed."""

    def __init__(self, rate: int, max_seconds: float | None) -> None:
        self.rate = rate
        self._max_seconds = max_seconds
        self._max_samples = None if max_seconds is None else math.floor(max_seconds * rate)
        self._blocks: list[np.ndarray] = []
        self._count = 0

    def add(self, mono: np.ndarray) -> None:
        self._count += mono.size
        if self._max_samples is not None and self._count > self._max_samples:
            assert self._max_seconds is not None
            raise AudioTooLong(self._max_seconds)
        self._blocks.append(mono.astype(np.float32, copy=False))

    def samples(self) -> np.ndarray:
        if not self._blocks:
            raise AudioDecodeError("the audio stream holds no samples")
        return np.concatenate(self._blocks)


def _decode_soundfile(data: bytes, max_seconds: float | None) -> tuple[np.ndarray, int]:
    import soundfile

    with soundfile.SoundFile(io.BytesIO(data)) as sound:
        rate = int(sound.samplerate)
        _check_rate(rate)
        collector = _Collector(rate, max_seconds)
        for block in sound.blocks(_DECODE_BLOCK_FRAMES, dtype="float32", always_2d=True):
            collector.add(block.mean(axis=1))
    return collector.samples(), rate


def _decode_av(data: bytes, max_seconds: float | None) -> tuple[np.ndarray, int]:
    import av

    with av.open(io.BytesIO(data), mode="r") as container:
        if not container.streams.audio:
            raise AudioDecodeError("no audio stream in the file")
        stream = container.streams.audio[0]
        rate = int(stream.rate)
        _check_rate(rate)
        collector = _Collector(rate, max_seconds)
        resampler = av.AudioResampler(format="fltp", layout="mono", rate=rate)
        for frame in container.decode(stream):
            for out in resampler.resample(frame):
                collector.add(out.to_ndarray().reshape(-1))
        for out in resampler.resample(None):
            collector.add(out.to_ndarray().reshape(-1))
    return collector.samples(), rate


def hz_to_mel_slaney(hz: np.ndarray | float) -> np.ndarray:
    """Slaney's auditory-toolbox mel scale: linear below 1 kHz, logarithmic above."""
    hz = np.asarray(hz, dtype=np.float64)
    f_sp, min_log_hz = 200.0 / 3, 1000.0
    min_log_mel, log_step = min_log_hz / f_sp, math.log(6.4) / 27.0
    linear = hz / f_sp
    logarithmic = min_log_mel + np.log(np.maximum(hz, min_log_hz) / min_log_hz) / log_step
    return np.where(hz >= min_log_hz, logarithmic, linear)


def mel_to_hz_slaney(mel: np.ndarray | float) -> np.ndarray:
    mel = np.asarray(mel, dtype=np.float64)
    f_sp, min_log_hz = 200.0 / 3, 1000.0
    min_log_mel, log_step = min_log_hz / f_sp, math.log(6.4) / 27.0
    linear = mel * f_sp
    logarithmic = min_log_hz * np.exp(log_step * (np.maximum(mel, min_log_mel) - min_log_mel))
    return np.where(mel >= min_log_mel, logarithmic, linear)


@cache
def slaney_mel_filterbank(sample_rate: int, n_fft: int, n_mels: int, fmin: float, fmax: float) -> np.ndarray:
    """(n_mels, n_fft // 2 + 1) triangles equally spaced on the Slaney mel scale, each scaled to unit
    area in Hz (librosa's `mel(..., htk=False, norm="slaney")`)."""
    fft_hz = np.linspace(0.0, sample_rate / 2, n_fft // 2 + 1)
    edges_hz = mel_to_hz_slaney(np.linspace(hz_to_mel_slaney(fmin), hz_to_mel_slaney(fmax), n_mels + 2))
    widths = np.diff(edges_hz)
    left, right = edges_hz[:-2, None], edges_hz[2:, None]
    rising = (fft_hz[None, :] - left) / widths[:-1, None]
    falling = (right - fft_hz[None, :]) / widths[1:, None]
    weights = np.maximum(0.0, np.minimum(rising, falling)) * (2.0 / (right - left))
    weights = weights.astype(np.float32)
    weights.setflags(write=False)  # cached and shared: callers copy before use
    return weights


def _as_tensor(samples: np.ndarray | torch.Tensor) -> torch.Tensor:
    tensor = torch.as_tensor(samples, dtype=torch.float32)
    if tensor.dim() != 1:
        raise ValueError(f"expected mono 1-D samples, got shape {tuple(tensor.shape)}")
    return tensor


def whisper_log_mel(samples_16k: np.ndarray | torch.Tensor) -> torch.Tensor:
    """Whisper log-mel (128, N // 160) of 16 kHz audio, scaled to roughly [-1, 1] (S3Tokenizer input)."""
    audio = _as_tensor(samples_16k)
    if audio.numel() <= WHISPER_N_FFT // 2:
        raise ValueError(f"need more than {WHISPER_N_FFT // 2} samples, got {audio.numel()}")
    window = torch.hann_window(WHISPER_N_FFT, periodic=True)
    spectrum = torch.stft(
        audio, WHISPER_N_FFT, WHISPER_HOP, window=window, center=True, pad_mode="reflect", return_complex=True
    )
    power = spectrum[:, :-1].abs() ** 2  # Whisper drops the last frame
    filters = torch.tensor(
        slaney_mel_filterbank(WHISPER_SAMPLE_RATE, WHISPER_N_FFT, WHISPER_MELS, 0.0, WHISPER_SAMPLE_RATE / 2)
    )
    log_mel = torch.clamp(filters @ power, min=1e-10).log10()
    log_mel = torch.maximum(log_mel, log_mel.max() - 8.0)
    return (log_mel + 4.0) / 4.0


def kaldi_mel_hz_to_mel(hz: np.ndarray | float) -> np.ndarray:
    """Kaldi's (HTK) mel scale: 1127 · ln(1 + f / 700)."""
    return 1127.0 * np.log1p(np.asarray(hz, dtype=np.float64) / 700.0)


@cache
def kaldi_mel_banks(n_bins: int, n_fft: int, sample_rate: int, low_hz: float, high_hz: float) -> np.ndarray:
    """(n_bins, n_fft // 2 + 1) Kaldi triangles: equally spaced on the HTK mel scale, unnormalised, peak 1,
    evaluated at the FFT bin frequencies (the Nyquist column is always zero, as in Kaldi)."""
    mel_low, mel_high = kaldi_mel_hz_to_mel(low_hz), kaldi_mel_hz_to_mel(high_hz)
    step = (mel_high - mel_low) / (n_bins + 1)
    left = mel_low + step * np.arange(n_bins)[:, None]
    centre, right = left + step, left + 2 * step
    bin_mel = kaldi_mel_hz_to_mel(np.arange(n_fft // 2) * sample_rate / n_fft)[None, :]
    rising = (bin_mel - left) / (centre - left)
    falling = (right - bin_mel) / (right - centre)
    banks = np.maximum(0.0, np.minimum(rising, falling))
    banks = np.pad(banks, ((0, 0), (0, 1))).astype(np.float32)
    banks.setflags(write=False)  # cached and shared: callers copy before use
    return banks


def kaldi_fbank(samples_16k: np.ndarray | torch.Tensor) -> torch.Tensor:
    """Kaldi log mel fbank (1 + (N − 400) // 160, 80) with Kaldi's defaults and dither 0.

    Per frame: remove DC, pre-emphasise (0.97, first sample against itself), Povey window, zero-pad to
    512, power spectrum, 80 HTK-mel triangles from 20 Hz to Nyquist, natural log floored at float eps.
    """
    audio = _as_tensor(samples_16k)
    if audio.numel() < FBANK_WINDOW:
        raise ValueError(f"need at least {FBANK_WINDOW} samples, got {audio.numel()}")
    frames = audio.unfold(0, FBANK_WINDOW, FBANK_SHIFT)
    frames = frames - frames.mean(dim=1, keepdim=True)
    previous = torch.cat([frames[:, :1], frames[:, :-1]], dim=1)
    frames = frames - FBANK_PREEMPHASIS * previous
    frames = frames * torch.hann_window(FBANK_WINDOW, periodic=False).pow(0.85)
    power = torch.fft.rfft(frames, n=FBANK_FFT).abs() ** 2
    banks = torch.tensor(
        kaldi_mel_banks(FBANK_BINS, FBANK_FFT, WHISPER_SAMPLE_RATE, FBANK_LOW_HZ, WHISPER_SAMPLE_RATE / 2)
    )
    energies = power @ banks.T
    return torch.clamp(energies, min=torch.finfo(torch.float32).eps).log()


def campplus_features(samples_16k: np.ndarray | torch.Tensor) -> torch.Tensor:
    """CAMPPlus input (T, 80): Kaldi fbank minus its mean over time (no variance normalisation)."""
    feats = kaldi_fbank(samples_16k)
    return feats - feats.mean(dim=0, keepdim=True)


def flow_mel(samples_24k: np.ndarray | torch.Tensor) -> torch.Tensor:
    """The flow's prompt mel (N // 480, 80) of 24 kHz audio: magnitude STFT, 80 Slaney mels up to 8 kHz,
    natural log floored at 1e-5."""
    audio = _as_tensor(samples_24k)
    pad = (FLOW_N_FFT - FLOW_HOP) // 2
    if audio.numel() <= pad:
        raise ValueError(f"need more than {pad} samples, got {audio.numel()}")
    padded = torch.nn.functional.pad(audio[None, None], (pad, pad), mode="reflect")[0, 0]
    spectrum = torch.stft(
        padded, FLOW_N_FFT, FLOW_HOP, window=torch.hann_window(FLOW_N_FFT, periodic=True),
        center=False, return_complex=True,
    )
    magnitude = torch.sqrt(spectrum.real**2 + spectrum.imag**2 + 1e-9)
    filters = torch.tensor(slaney_mel_filterbank(FLOW_SAMPLE_RATE, FLOW_N_FFT, FLOW_MELS, 0.0, FLOW_FMAX))
    mel = filters @ magnitude
    return torch.clamp(mel, min=1e-5).log().T.contiguous()
