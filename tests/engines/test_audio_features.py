"""Audio decoding, resampling and the three feature front ends, against independent formulas."""

from __future__ import annotations

import io
import math

import av
import numpy as np
import pytest
import soundfile
import torch

from engines.audio_features import (
    AudioDecodeError,
    campplus_features,
    decode_audio,
    flow_mel,
    hz_to_mel_slaney,
    kaldi_fbank,
    kaldi_mel_banks,
    mel_to_hz_slaney,
    slaney_mel_filterbank,
    whisper_log_mel,
)


def _sine(freq: float, seconds: float, rate: int, amplitude: float = 0.5) -> np.ndarray:
    return (amplitude * np.sin(2 * np.pi * freq * np.arange(int(seconds * rate)) / rate)).astype(np.float32)


def _chirp_with_noise(seconds: float, rate: int) -> np.ndarray:
    t = np.arange(int(seconds * rate)) / rate
    rng = np.random.default_rng(1)
    chirp = 0.3 * np.sin(2 * np.pi * (200 + 300 * t) * t)
    return (chirp + 0.05 * rng.standard_normal(t.size)).astype(np.float32)


def _peak_frequency(samples: np.ndarray, rate: int) -> float:
    spectrum = np.abs(np.fft.rfft(samples * np.hanning(samples.size)))
    return float(np.fft.rfftfreq(samples.size, 1 / rate)[spectrum.argmax()])


# --- filterbanks ---------------------------------------------------------------------------------


def test_slaney_mel_scale_is_linear_then_logarithmic() -> None:
    assert hz_to_mel_slaney(np.array(500.0)) == pytest.approx(7.5)  # 3 mels per 200 Hz below 1 kHz
    assert hz_to_mel_slaney(np.array(1000.0)) == pytest.approx(15.0)
    assert hz_to_mel_slaney(np.array(6400.0)) == pytest.approx(15.0 + 27.0)  # 27 mels per factor 6.4
    hz = np.array([0.0, 123.0, 999.0, 1000.0, 4321.0, 12000.0])
    np.testing.assert_allclose(mel_to_hz_slaney(hz_to_mel_slaney(hz)), hz, rtol=1e-9, atol=1e-9)


@pytest.mark.parametrize(
    ("rate", "n_fft", "n_mels", "fmax"), [(16000, 400, 128, 8000.0), (24000, 1920, 80, 8000.0)]
)
def test_slaney_filterbank_triangles(rate: int, n_fft: int, n_mels: int, fmax: float) -> None:
    bank = slaney_mel_filterbank(rate, n_fft, n_mels, 0.0, fmax)
    assert bank.shape == (n_mels, n_fft // 2 + 1)
    assert (bank >= 0).all()
    bin_hz = rate / n_fft
    freqs = np.arange(n_fft // 2 + 1) * bin_hz
    edges = mel_to_hz_slaney(np.linspace(0.0, hz_to_mel_slaney(np.array(fmax)), n_mels + 2))
    for m in range(n_mels):
        support = freqs[bank[m] > 0]
        assert support.min() > edges[m] - 1e-6 and support.max() < edges[m + 2] + 1e-6
        if edges[m + 2] - edges[m] > 8 * bin_hz:  # well-sampled: unit area in Hz, peak at the centre
            assert bank[m].sum() * bin_hz == pytest.approx(1.0, rel=0.02)
            assert abs(freqs[bank[m].argmax()] - edges[m + 1]) <= bin_hz
    assert (bank[:, freqs > fmax] == 0).all()


def test_kaldi_mel_banks_are_unit_peak_htk_triangles() -> None:
    banks = kaldi_mel_banks(80, 512, 16000, 20.0, 8000.0)
    assert banks.shape == (80, 257)
    assert (banks[:, -1] == 0).all()  # Kaldi never uses the Nyquist bin
    freqs = np.arange(257) * 16000 / 512
    assert (banks[:, freqs < 20.0] == 0).all()
    assert banks.max() <= 1.0 and banks.max() > 0.99
    # Equally spaced half-overlapping triangles on the HTK mel axis sum to 1 between the outer centres.
    mel = 1127 * np.log1p(freqs / 700)
    low, high = 1127 * np.log1p(20 / 700), 1127 * np.log1p(8000 / 700)
    step = (high - low) / 81
    inside = (mel > low + step) & (mel < high - step) & (freqs < 8000)
    np.testing.assert_allclose(banks[:, inside].sum(axis=0), 1.0, atol=1e-5)


# --- Whisper log-mel -----------------------------------------------------------------------------


def _whisper_reference(audio: np.ndarray) -> np.ndarray:
    """Whisper log-mel with numpy's FFT over explicitly built frames."""
    n_fft, hop = 400, 160
    padded = np.pad(audio.astype(np.float64), n_fft // 2, mode="reflect")
    window = 0.5 - 0.5 * np.cos(2 * np.pi * np.arange(n_fft) / n_fft)  # periodic Hann
    count = 1 + (padded.size - n_fft) // hop
    frames = np.stack([padded[i * hop:i * hop + n_fft] * window for i in range(count)])
    power = (np.abs(np.fft.rfft(frames, axis=1)) ** 2)[:-1].T
    log_mel = np.log10(np.maximum(slaney_mel_filterbank(16000, 400, 128, 0.0, 8000.0) @ power, 1e-10))
    log_mel = np.maximum(log_mel, log_mel.max() - 8.0)
    return (log_mel + 4.0) / 4.0


@pytest.mark.parametrize("samples", [16000, 16159, 24321])
def test_whisper_log_mel_matches_the_reference_and_frame_count(samples: int) -> None:
    audio = _chirp_with_noise(samples / 16000, 16000)[:samples]
    mel = whisper_log_mel(audio)
    assert mel.shape == (128, samples // 160)
    np.testing.assert_allclose(mel.numpy(), _whisper_reference(audio), atol=2e-4)
    assert float(mel.max() - mel.min()) <= 2.0 + 1e-6  # floor at max − 8 in log10, scaled by 1/4


def test_whisper_log_mel_of_a_sine_peaks_in_the_matching_band() -> None:
    mel = whisper_log_mel(_sine(1000.0, 1.0, 16000))
    bank = slaney_mel_filterbank(16000, 400, 128, 0.0, 8000.0)
    expected_band = bank[:, 25].argmax()  # the 1 kHz FFT bin (400 / 16000 · 1000)
    assert abs(int(mel.mean(dim=1).argmax()) - int(expected_band)) <= 1


# --- Kaldi fbank (CAMPPlus) ----------------------------------------------------------------------


def _kaldi_reference(audio: np.ndarray) -> np.ndarray:
    """Kaldi fbank computed frame by frame in float64."""
    window = np.hanning(400) ** 0.85  # Povey window: symmetric Hann to the power 0.85
    banks = kaldi_mel_banks(80, 512, 16000, 20.0, 8000.0).astype(np.float64)
    rows = []
    for start in range(0, audio.size - 400 + 1, 160):
        frame = audio[start:start + 400].astype(np.float64)
        frame = frame - frame.mean()
        emphasised = frame.copy()
        emphasised[1:] -= 0.97 * frame[:-1]
        emphasised[0] -= 0.97 * frame[0]
        spectrum = np.fft.rfft(emphasised * window, n=512)
        energies = banks @ (spectrum.real**2 + spectrum.imag**2)
        rows.append(np.log(np.maximum(energies, np.finfo(np.float32).eps)))
    return np.stack(rows)


@pytest.mark.parametrize("samples", [400, 16000, 16399, 20001])
def test_kaldi_fbank_matches_the_frame_by_frame_reference(samples: int) -> None:
    audio = _chirp_with_noise(2.0, 16000)[:samples]
    feats = kaldi_fbank(audio)
    assert feats.shape == (1 + (samples - 400) // 160, 80)
    np.testing.assert_allclose(feats.numpy(), _kaldi_reference(audio), atol=2e-3, rtol=1e-4)


def test_kaldi_fbank_needs_one_window() -> None:
    with pytest.raises(ValueError):
        kaldi_fbank(np.zeros(399, dtype=np.float32))


def test_campplus_features_are_mean_normalised_per_bin() -> None:
    audio = _chirp_with_noise(2.0, 16000)
    feats = campplus_features(audio)
    np.testing.assert_allclose(feats.mean(dim=0).numpy(), 0.0, atol=1e-4)
    raw = kaldi_fbank(audio)
    np.testing.assert_allclose((raw - feats).std(dim=0).numpy(), 0.0, atol=1e-4)  # a per-bin offset only


# --- 24 kHz flow mel ------------------------------------------------------------------------------


@pytest.mark.parametrize("samples", [24000, 24479, 24480, 50000])
def test_flow_mel_frame_count_and_reference(samples: int) -> None:
    audio = _chirp_with_noise(samples / 24000 + 0.1, 24000)[:samples]
    mel = flow_mel(audio)
    assert mel.shape == (samples // 480, 80)
    padded = np.pad(audio.astype(np.float64), 720, mode="reflect")
    window = 0.5 - 0.5 * np.cos(2 * np.pi * np.arange(1920) / 1920)
    bank = slaney_mel_filterbank(24000, 1920, 80, 0.0, 8000.0).astype(np.float64)
    for index in (0, mel.shape[0] // 2, mel.shape[0] - 1):
        spectrum = np.fft.rfft(padded[index * 480:index * 480 + 1920] * window)
        expected = np.log(np.maximum(bank @ np.sqrt(np.abs(spectrum) ** 2 + 1e-9), 1e-5))
        np.testing.assert_allclose(mel[index].numpy(), expected, atol=1e-3)


def test_flow_mel_of_a_sine_peaks_in_the_matching_band() -> None:
    mel = flow_mel(_sine(440.0, 1.0, 24000))
    bank = slaney_mel_filterbank(24000, 1920, 80, 0.0, 8000.0)
    assert int(mel.mean(dim=0).argmax()) == int(bank[:, round(440 / 12.5)].argmax())
    assert float(mel.min()) >= math.log(1e-5) - 1e-6


# --- decoding ----------------------------------------------------------------------------------------


def _wav_bytes(samples: np.ndarray, rate: int, subtype: str = "PCM_16", fmt: str = "WAV") -> bytes:
    buffer = io.BytesIO()
    soundfile.write(buffer, samples, rate, subtype=subtype, format=fmt)
    return buffer.getvalue()


def _av_bytes(samples: np.ndarray, rate: int, container: str, codec: str) -> bytes:
    buffer = io.BytesIO()
    with av.open(buffer, "w", format=container) as output:
        stream = output.add_stream(codec, rate=rate)
        stream.layout = "mono"
        frame = av.AudioFrame.from_ndarray(samples[None], format="flt", layout="mono")
        frame.sample_rate = rate
        for packet in [*stream.encode(frame), *stream.encode(None)]:
            output.mux(packet)
    return buffer.getvalue()


def test_decode_wav_averages_channels(tmp_path) -> None:
    left, right = _sine(440.0, 0.5, 16000, 0.4), _sine(440.0, 0.5, 16000, 0.2)
    data = _wav_bytes(np.stack([left, right], axis=1), 16000, subtype="FLOAT")
    samples, rate = decode_audio(data)
    assert rate == 16000 and samples.dtype == np.float32 and samples.ndim == 1
    np.testing.assert_allclose(samples, (left + right) / 2, atol=1e-6)
    path = tmp_path / "clip.flac"
    soundfile.write(path, left, 16000, format="FLAC")
    from_file, _ = decode_audio(path)
    np.testing.assert_allclose(from_file, left, atol=1e-4)


@pytest.mark.parametrize(("container", "codec"), [("webm", "libopus"), ("mp3", "mp3"), ("ipod", "aac")])
def test_decode_compressed_formats(container: str, codec: str) -> None:
    data = _av_bytes(_sine(440.0, 1.0, 48000), 48000, container, codec)
    samples, rate = decode_audio(data)
    assert rate == 48000
    assert abs(samples.size - 48000) < 4096  # codec padding/priming only
    assert abs(_peak_frequency(samples, rate) - 440.0) <= 3.0


@pytest.mark.parametrize("data", [b"", b"not audio at all" * 64, bytes(range(256)) * 8])
def test_decode_rejects_non_audio(data: bytes) -> None:
    with pytest.raises(AudioDecodeError):
        decode_audio(data)


def test_features_reject_multichannel_input() -> None:
    with pytest.raises(ValueError):
        flow_mel(torch.zeros(2, 24000))
