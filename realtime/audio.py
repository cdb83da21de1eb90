"""Audio conversions at the service's edges: resampling, tempo, sample encodings and containers.

Everything the engines produce is float32 mono at 24000 Hz. Streaming converters here keep state
between calls (filter history, codec frames), so chunk joins are seamless: feeding an utterance in
pieces gives the same audio as feeding it whole. Codec work is synchronous; transports run the heavy
encoders (Opus, MP3, FLAC) in an executor.
"""

from __future__ import annotations

import abc
import enum
import fractions
import io
import struct

import av
import av.filter
import numpy as np
from av.audio.fifo import AudioFifo
from av.audio.stream import AudioStream

from engines.config import SAMPLE_RATE
from engines.resample import KAISER_BEST, SincResampler

SUPPORTED_RATES = (8000, 16000, 22050, 24000, 32000, 44100, 48000)
_TIME_BASE = fractions.Fraction(1, SAMPLE_RATE)


class Encoding(enum.Enum):
    """Audio encodings of the websocket protocols: raw samples (one chunk decodes on its own) and the
    compressed streams (MP3 frames, Ogg Opus pages) whose chunks are consecutive pieces of one file."""

    PCM_S16LE = "pcm_s16le"
    PCM_F32LE = "pcm_f32le"
    MULAW = "mulaw"
    ALAW = "alaw"
    MP3 = "mp3"
    OPUS = "opus"


RAW_ENCODINGS = (Encoding.PCM_S16LE, Encoding.PCM_F32LE, Encoding.MULAW, Encoding.ALAW)


def _frame(pcm: np.ndarray, rate: int) -> av.AudioFrame:
    frame = av.AudioFrame.from_ndarray(
        np.ascontiguousarray(pcm, dtype=np.float32).reshape(1, -1), format="flt", layout="mono"
    )
    frame.sample_rate = rate
    frame.time_base = fractions.Fraction(1, rate)
    return frame


def _frames_to_array(frames: list[av.AudioFrame]) -> np.ndarray:
    if not frames:
        return np.zeros(0, dtype=np.float32)
    return np.concatenate([f.to_ndarray().reshape(-1) for f in frames]).astype(np.float32, copy=False)


class Resampler:
    """Stateful 24 kHz → `rate` float32 resampler for one stream (identity at 24 kHz).

    A Kaiser-windowed sinc (torchaudio's `kaiser_best` constants): within 0.05 dB up to 0.9 × the
    output Nyquist and aliases below −140 dB, where the reference's Hann kernel (used on the voice path,
    where fidelity to the reference matters) lets an 8.2 kHz tone fold into 16 kHz output at −8 dB.
    Pure numpy state (a few hundred samples of history), nothing to close.
    """

    def __init__(self, rate: int) -> None:
        if rate not in SUPPORTED_RATES:
            raise ValueError(
                f"unsupported sample rate {rate}; supported: {', '.join(map(str, SUPPORTED_RATES))}"
            )
        self.rate = rate
        self._resampler = SincResampler(SAMPLE_RATE, rate, KAISER_BEST)

    def process(self, pcm: np.ndarray) -> np.ndarray:
        return self._resampler.process(pcm)

    def flush(self) -> np.ndarray:
        """The samples still inside the filter; the resampler is finished afterwards."""
        return self._resampler.flush()


# Speech speeds the service offers (a request's `speed`); atempo handles them in at most two stages.
MIN_SPEED = 0.25
MAX_SPEED = 4.0


class TempoStretcher:
    """Stateful speed change without a pitch change (ffmpeg `atempo`), for 24 kHz float32 audio."""

    def __init__(self, speed: float) -> None:
        if not MIN_SPEED <= speed <= MAX_SPEED:
            raise ValueError(f"speed must be in [{MIN_SPEED}, {MAX_SPEED:g}], got {speed}")
        # One atempo stage handles factors >= 0.5; slower speeds chain two.
        factors = [speed] if speed >= 0.5 else [0.5, speed / 0.5]
        self._graph = av.filter.Graph()
        node = self._graph.add_abuffer(
            format="flt", sample_rate=SAMPLE_RATE, layout="mono", time_base=_TIME_BASE
        )
        source = node
        for factor in factors:
            stage = self._graph.add("atempo", f"{factor:.6f}")
            node.link_to(stage)
            node = stage
        sink = self._graph.add("abuffersink")
        node.link_to(sink)
        self._graph.configure()
        self._source = source
        self._pts = 0

    def process(self, pcm: np.ndarray) -> np.ndarray:
        if pcm.size == 0:
            return np.zeros(0, dtype=np.float32)
        frame = _frame(pcm, SAMPLE_RATE)
        frame.pts = self._pts
        self._pts += pcm.size
        self._graph.push(frame)
        return self._pull()

    def flush(self) -> np.ndarray:
        self._graph.push(None)
        return self._pull()

    def _pull(self) -> np.ndarray:
        frames: list[av.AudioFrame] = []
        while True:
            try:
                frame = self._graph.pull()
            except (av.BlockingIOError, av.EOFError):
                break
            if isinstance(frame, av.AudioFrame):
                frames.append(frame)
        return _frames_to_array(frames)


def to_pcm16(pcm: np.ndarray) -> np.ndarray:
    """float32 in [-1, 1] → int16 (clipped)."""
    return (np.clip(pcm, -1.0, 1.0) * 32767.0).round().astype(np.int16)


def encode_pcm_s16le(pcm: np.ndarray) -> bytes:
    return to_pcm16(pcm).astype("<i2").tobytes()


_MULAW_BIAS = 33  # in the 14-bit domain G.711 works in
_MULAW_CLIP = 8159


def encode_mulaw(pcm: np.ndarray) -> bytes:
    """G.711 µ-law bytes of float32 samples (the classic segment-search encoder of g711.c)."""
    samples = to_pcm16(pcm).astype(np.int32) >> 2
    negative = samples < 0
    magnitude = np.minimum(np.where(negative, -samples, samples), _MULAW_CLIP) + _MULAW_BIAS
    segment = np.maximum(np.floor(np.log2(magnitude)).astype(np.int32) - 5, 0)
    code = np.where(segment > 7, 0x7F, (segment << 4) | ((magnitude >> (segment + 1)) & 0x0F))
    return (code ^ np.where(negative, 0x7F, 0xFF)).astype(np.uint8).tobytes()


def decode_mulaw(data: bytes) -> np.ndarray:
    """G.711 µ-law bytes → float32 samples (the inverse of `encode_mulaw`, up to quantisation)."""
    codes = ~np.frombuffer(data, dtype=np.uint8).astype(np.int32) & 0xFF
    # 16-bit domain: the 14-bit bias times four.
    magnitude = ((((codes & 0x0F) << 3) + 4 * _MULAW_BIAS) << ((codes >> 4) & 0x07)) - 4 * _MULAW_BIAS
    return (np.where(codes & 0x80, -magnitude, magnitude) / 32768.0).astype(np.float32)


def encode_alaw(pcm: np.ndarray) -> bytes:
    """G.711 A-law bytes of float32 samples (segment search on the 13-bit magnitude, as g711.c)."""
    samples = to_pcm16(pcm).astype(np.int32) >> 3
    negative = samples < 0
    magnitude = np.minimum(np.where(negative, -samples - 1, samples), 0xFFF)
    segment = np.maximum(np.floor(np.log2(np.maximum(magnitude, 1))).astype(np.int32) - 4, 0)
    mantissa = np.where(segment == 0, magnitude >> 1, magnitude >> segment) & 0x0F
    code = (segment << 4) | mantissa
    return (code ^ np.where(negative, 0x55, 0xD5)).astype(np.uint8).tobytes()


def encode_samples(pcm: np.ndarray, encoding: Encoding) -> bytes:
    """Raw samples in one of `RAW_ENCODINGS` (the compressed ones need a `chunk_encoder`)."""
    if encoding is Encoding.PCM_S16LE:
        return encode_pcm_s16le(pcm)
    if encoding is Encoding.PCM_F32LE:
        return np.clip(pcm, -1.0, 1.0).astype("<f4").tobytes()
    if encoding is Encoding.MULAW:
        return encode_mulaw(pcm)
    if encoding is Encoding.ALAW:
        return encode_alaw(pcm)
    raise ValueError(f"{encoding.value} is not a raw sample encoding")


class StreamEncoder(abc.ABC):
    """24 kHz float32 chunks → the bytes of one streamed file, available as soon as encoded."""

    content_type: str

    @abc.abstractmethod
    def encode(self, pcm: np.ndarray) -> bytes: ...

    @abc.abstractmethod
    def finish(self) -> bytes:
        """Whatever the codec still holds, and the container's trailer."""


class PcmStreamEncoder(StreamEncoder):
    """Headerless 24 kHz signed 16-bit little-endian mono."""

    content_type = "audio/pcm"

    def encode(self, pcm: np.ndarray) -> bytes:
        return encode_pcm_s16le(pcm)

    def finish(self) -> bytes:
        return b""


def wav_header(sample_rate: int, data_bytes: int | None = None) -> bytes:
    """A 16-bit mono WAV header; `data_bytes=None` (length unknown, streaming) writes 0xFFFFFFFF sizes."""
    data_size = 0xFFFFFFFF if data_bytes is None else data_bytes
    riff_size = 0xFFFFFFFF if data_bytes is None else 36 + data_bytes
    return (
        b"RIFF"
        + struct.pack("<I", riff_size)
        + b"WAVE"
        + b"fmt "
        + struct.pack("<IHHIIHH", 16, 1, 1, sample_rate, sample_rate * 2, 2, 16)
        + b"data"
        + struct.pack("<I", data_size)
    )


class WavStreamEncoder(StreamEncoder):
    """A WAV header with unknown sizes first, then 16-bit PCM as it comes (how streamed WAV works)."""

    content_type = "audio/wav"

    def __init__(self) -> None:
        self._header_sent = False

    def encode(self, pcm: np.ndarray) -> bytes:
        head = b"" if self._header_sent else wav_header(SAMPLE_RATE)
        self._header_sent = True
        return head + encode_pcm_s16le(pcm)

    def finish(self) -> bytes:
        return b"" if self._header_sent else wav_header(SAMPLE_RATE, 0)


class _Sink:
    """A write-only, non-seekable file for the muxer: containers that would seek back stay streamable."""

    def __init__(self) -> None:
        self._buffer = io.BytesIO()

    def write(self, data: bytes) -> int:
        return self._buffer.write(data)

    def take(self) -> bytes:
        data = self._buffer.getvalue()
        self._buffer = io.BytesIO()
        return data


class CodecStreamEncoder(StreamEncoder):
    """Opus (in Ogg), MP3 or FLAC through libav, muxed incrementally. Input: float32 mono at
    `sample_rate` (24 kHz unless the caller resampled); `bit_rate` in bits/s, or the codec's default."""

    _FORMATS = {
        "opus": ("ogg", "libopus", "audio/ogg"),
        "mp3": ("mp3", "libmp3lame", "audio/mpeg"),
        "flac": ("flac", "flac", "audio/flac"),
    }

    def __init__(self, kind: str, sample_rate: int = SAMPLE_RATE, bit_rate: int | None = None) -> None:
        if kind not in self._FORMATS:
            raise ValueError(f"unknown codec format {kind!r}; expected one of {sorted(self._FORMATS)}")
        container_format, codec, self.content_type = self._FORMATS[kind]
        self.kind = kind
        self._rate = sample_rate
        self._sink = _Sink()
        # MP3 without an ID3 tag or Xing frame: bare frames, so streams concatenate into one valid stream.
        # Ogg pages of one packet each: a streamed chunk is not held back for a fuller page.
        options = (
            {"id3v2_version": "0", "write_xing": "0"}
            if kind == "mp3"
            else {"page_duration": "20000"}
            if kind == "opus"
            else {}
        )
        self._container = av.open(self._sink, mode="w", format=container_format, options=options)
        stream = self._container.add_stream(codec, rate=sample_rate, layout="mono")
        assert isinstance(stream, AudioStream)
        if bit_rate is not None:
            stream.codec_context.bit_rate = bit_rate
        self._stream = stream
        # Opening the codec now fixes its sample format and frame size (samples per encoded frame).
        self._container.start_encoding()
        context = self._stream.codec_context
        self._resampler = av.AudioResampler(format=context.format.name, layout="mono", rate=sample_rate)
        self._fifo = AudioFifo()
        self._frame_size = context.frame_size or sample_rate // 50
        self._pts = 0

    def encode(self, pcm: np.ndarray) -> bytes:
        if pcm.size:
            frame = _frame(pcm, self._rate)
            frame.pts = self._pts
            self._pts += pcm.size
            for converted in self._resampler.resample(frame):
                self._fifo.write(converted)
            self._drain_fifo(partial=False)
        return self._sink.take()

    def pad_frame(self) -> bytes:
        """Silence up to the next whole codec frame and one frame more, so every sample so far is encoded
        and muxed (the codec's look-ahead and the muxer each hold back one frame); the stream goes on."""
        missing = -self._fifo.samples % self._frame_size + self._frame_size
        return self.encode(np.zeros(missing, dtype=np.float32))

    def finish(self) -> bytes:
        for converted in self._resampler.resample(None):
            self._fifo.write(converted)
        self._drain_fifo(partial=True)
        self._mux(None)
        self._container.close()
        return self._sink.take()

    def _drain_fifo(self, partial: bool) -> None:
        """Encode whole codec frames; with `partial`, also the short last one."""
        while self._fifo.samples >= self._frame_size or (partial and self._fifo.samples):
            frame = self._fifo.read(min(self._frame_size, self._fifo.samples))
            if frame is not None:
                self._mux(frame)

    def _mux(self, frame: av.AudioFrame | None) -> None:
        for packet in self._stream.encode(frame):
            self._container.mux(packet)


class RawChunkEncoder(StreamEncoder):
    """Raw samples in one of `RAW_ENCODINGS`; nothing is held back."""

    def __init__(self, encoding: Encoding) -> None:
        self._encoding = encoding
        self.content_type = "audio/pcm"

    def encode(self, pcm: np.ndarray) -> bytes:
        return encode_samples(pcm, self._encoding)

    def finish(self) -> bytes:
        return b""


def chunk_encoder(encoding: Encoding, sample_rate: int, bit_rate: int | None = None) -> StreamEncoder:
    """The encoder of one utterance's chunks: float32 mono at `sample_rate` in, `encoding` out."""
    if encoding is Encoding.MP3:
        return CodecStreamEncoder("mp3", sample_rate, bit_rate)
    if encoding is Encoding.OPUS:
        return CodecStreamEncoder("opus", sample_rate, bit_rate)
    return RawChunkEncoder(encoding)


def make_stream_encoder(response_format: str) -> StreamEncoder:
    """The encoder of an OpenAI `response_format` (pcm, wav, opus, mp3, flac)."""
    if response_format == "pcm":
        return PcmStreamEncoder()
    if response_format == "wav":
        return WavStreamEncoder()
    return CodecStreamEncoder(response_format)
