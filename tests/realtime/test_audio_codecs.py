"""Resampling, tempo, sample encodings and streamed containers (realtime/audio.py)."""

from __future__ import annotations

import io

import av
import numpy as np
import pytest
import soundfile

from realtime.audio import (
    SUPPORTED_RATES,
    Resampler,
    TempoStretcher,
    decode_mulaw,
    encode_mulaw,
    encode_pcm_s16le,
    make_stream_encoder,
    to_pcm16,
)

RATE = 24000


def tone(seconds: float = 1.0, hz: float = 440.0) -> np.ndarray:
    t = np.arange(int(seconds * RATE)) / RATE
    return (0.5 * np.sin(2 * np.pi * hz * t)).astype(np.float32)


def in_pieces(process, flush, pcm: np.ndarray, size: int) -> np.ndarray:
    return np.concatenate([process(pcm[i : i + size]) for i in range(0, pcm.size, size)] + [flush()])


@pytest.mark.parametrize("rate", SUPPORTED_RATES)
def test_resampling_in_pieces_equals_resampling_whole(rate):
    pcm = tone()
    whole = Resampler(rate)
    expected = np.concatenate([whole.process(pcm), whole.flush()])
    pieces = Resampler(rate)
    got = in_pieces(pieces.process, pieces.flush, pcm, 1111)
    assert expected.size == got.size == rate
    np.testing.assert_allclose(got, expected, atol=1e-6)


def test_resampling_keeps_the_tone():
    out = Resampler(16000).process(tone(hz=1000.0))
    spectrum = np.abs(np.fft.rfft(out[2000:]))
    assert np.fft.rfftfreq(out[2000:].size, 1 / 16000)[spectrum.argmax()] == pytest.approx(1000, abs=5)


def test_unsupported_rate_is_refused():
    with pytest.raises(ValueError, match="unsupported sample rate"):
        Resampler(11025)


@pytest.mark.parametrize("speed", [0.25, 0.5, 1.5, 4.0])
def test_tempo_changes_duration_not_pitch(speed):
    stretcher = TempoStretcher(speed)
    out = in_pieces(stretcher.process, stretcher.flush, tone(2.0), 4800)
    assert out.size / RATE == pytest.approx(2.0 / speed, rel=0.05)
    body = out[out.size // 4 : 3 * out.size // 4]
    spectrum = np.abs(np.fft.rfft(body))
    assert np.fft.rfftfreq(body.size, 1 / RATE)[spectrum.argmax()] == pytest.approx(440, rel=0.03)


def test_pcm16_clips_and_is_little_endian():
    assert to_pcm16(np.array([2.0, -2.0, 0.5], np.float32)).tolist() == [32767, -32767, 16384]
    assert encode_pcm_s16le(np.array([0.5], np.float32)) == (16384).to_bytes(2, "little")


def test_mulaw_decodes_with_ffmpeg_and_round_trips_within_quantisation():
    pcm = np.linspace(-1, 1, 4001).astype(np.float32)
    data = encode_mulaw(pcm)
    assert len(data) == pcm.size
    decoder = av.CodecContext.create("pcm_mulaw", "r")
    decoder.sample_rate, decoder.layout = RATE, "mono"
    theirs = np.concatenate([f.to_ndarray().reshape(-1) for f in decoder.decode(av.Packet(data))]) / 32768.0
    np.testing.assert_array_equal(decode_mulaw(data), theirs.astype(np.float32))
    # µ-law keeps about 3 % relative precision (plus a small absolute floor).
    assert np.all(np.abs(decode_mulaw(data) - pcm) <= 0.035 * np.abs(pcm) + 2e-3)


def streamed(fmt: str, pcm: np.ndarray) -> bytes:
    encoder = make_stream_encoder(fmt)
    return b"".join(encoder.encode(pcm[i : i + 2400]) for i in range(0, pcm.size, 2400)) + encoder.finish()


@pytest.mark.parametrize("fmt", ["wav", "flac", "mp3", "opus"])
def test_streamed_containers_decode_to_the_audio(fmt):
    pcm = tone(1.0)
    with av.open(io.BytesIO(streamed(fmt, pcm))) as container:
        decoded = np.concatenate([f.to_ndarray().reshape(-1) for f in container.decode(audio=0)])
        rate = container.streams.audio[0].rate
    assert decoded.size / rate == pytest.approx(1.0, abs=0.08)
    if fmt in ("wav", "flac"):
        np.testing.assert_allclose(
            decoded.astype(np.float32) / (32768.0 if decoded.dtype == np.int16 else 1.0),
            to_pcm16(pcm) / 32768.0,
            atol=1e-4,
        )


def test_streamed_wav_header_comes_first_and_soundfile_reads_it():
    data = streamed("wav", tone(0.5))
    assert data[:4] == b"RIFF" and data[8:12] == b"WAVE"
    samples, rate = soundfile.read(io.BytesIO(data), dtype="int16")
    assert rate == RATE and samples.size == RATE // 2


def test_empty_wav_is_still_a_wav():
    encoder = make_stream_encoder("wav")
    samples, rate = soundfile.read(io.BytesIO(encoder.finish()))
    assert samples.size == 0 and rate == RATE
