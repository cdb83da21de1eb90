"""HiFT's streaming state (MODEL_FACTS §5.6) and the batched vocoding of many streams' chunks.

`launch_vocode_streams` vocodes the chunks of several streams with one generator call per group of
equal shapes (HiFT's convolutions see both ways, so rows of other lengths are batched only as padded
final chunks, masked: hift.RowEnds), without waiting for the device.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple, Protocol

import torch
import torch.nn.functional as F
from torch import Tensor

from engines.token2wav.hift import HiFTGenerator, Vocoded
from engines.transfer import Download, upload


class HiFTStream:
    """Per-request vocoder state: chunks of mel in, final audio out (MODEL_FACTS §5.6).

    Each call vocodes [the last 8 mel frames of the previous call, the new frames], restores the
    previous call's last 3840 source samples over the re-synthesised frames, cross-fades the first 3840
    samples with the held-back speech tail under a Hamming window, and holds back the last 3840 samples
    unless `last`. Concatenating the outputs gives the utterance. As in the reference, every call starts
    its sine phases afresh at its first (cached) frame, so on voiced frames the excitation changes
    phase where the restored source ends, and only the first chunk's frames equal offline output.

    The noise comes from the stream's own generator on the vocoder's device, so a stream's audio does
    not depend on which streams share its batch. On the CPU, whose draws concatenate exactly, a seeded
    stream on unvoiced frames reproduces the offline output with the same seed everywhere but near the
    chunk joins (a CUDA generator rounds its offset per call, so there the noise differs from offline's).
    """

    def __init__(self, hift: HiFTGenerator, *, seed: int | None = None) -> None:
        cfg = hift.cfg
        if cfg.source_cache_samples != cfg.mel_cache_frames * hift.hop_samples:
            raise ValueError(f"source_cache_samples {cfg.source_cache_samples} must equal mel_cache_frames "
                             f"{cfg.mel_cache_frames} × {hift.hop_samples}")
        self._hift: HiFTGenerator | None = hift
        device = hift.stft_window.device
        # On the vocoder's device: batches of many streams draw their noise without host work.
        self._noise = torch.Generator(device)
        if seed is None:
            self._noise.seed()
        else:
            self._noise.manual_seed(seed)
        self._mel: Tensor | None = None
        self._source: Tensor | None = None
        self._speech_tail: Tensor | None = None

    @property
    def nbytes(self) -> int:
        cached = (self._mel, self._source, self._speech_tail)
        return sum(t.nbytes for t in cached if t is not None)

    @torch.inference_mode()
    def process(self, mel: Tensor, last: bool) -> Tensor:
        """mel (1, 80, F) → float32 (samples,) on the CPU; 480·F samples in total over the stream."""
        return vocode_streams([self], [mel], [last])[0]

    @property
    def generator(self) -> HiFTGenerator:
        """The vocoder this stream runs on; raises once the stream is closed."""
        if self._hift is None:
            raise RuntimeError("HiFTStream is closed")
        return self._hift

    def _cache(self) -> Tensor | None:
        """The source samples the next call restores, if any."""
        return self._source

    def _next_input(self, mel: Tensor, last: bool) -> _Input | None:
        """The cached frames and `mel` to vocode now, or None (and the stream closed) when there is
        nothing. Not yet joined: a batch joins its rows' caches and mels in one go."""
        cfg = self.generator.cfg
        cached = self._mel
        frames = mel.shape[2] + (0 if cached is None else cached.shape[2])
        if frames == 0:
            self.close()
            return None
        if not last and frames < cfg.mel_cache_frames:
            raise ValueError(f"a non-final chunk needs at least {cfg.mel_cache_frames} mel frames "
                             f"with the cache, got {frames}")
        return _Input(cached, mel)

    def _held_tail(self) -> Tensor:
        """The speech samples held back from the previous call (there was one)."""
        if self._speech_tail is None:
            raise RuntimeError("no speech held back: the stream has not vocoded a chunk")
        return self._speech_tail

    def _keep(self, mel: Tensor, source: Tensor, speech_tail: Tensor) -> None:
        """Hold the caches of a call that was not the last (one row each)."""
        self._mel, self._source, self._speech_tail = mel, source, speech_tail

    def close(self) -> None:
        """Drop the caches; later `process` calls raise. Idempotent."""
        self._hift = None
        self._mel = self._source = self._speech_tail = None


def _emit_rows(streams: Sequence[HiFTStream], lasts: Sequence[bool], mel: Tensor, out: Vocoded,
               speech_tails: Tensor | None) -> list[Tensor]:
    """The final audio of each row of one batched call (on the vocoder's device), all rows at once:
    the first `source_cache_samples` cross-faded with the row's held-back tail (`speech_tails`, one row
    each, None for first chunks) under the Hamming window; unless its stream's chunk is `last`, the row
    holds back its last samples and keeps its caches (the last mel frames and source samples)."""
    hift = streams[0].generator
    overlap, frames = hift.cfg.source_cache_samples, hift.cfg.mel_cache_frames
    speech = out.speech
    if speech_tails is not None:
        fade_in, fade_out = hift.crossfade.split(overlap)
        faded = speech[:, :overlap] * fade_in + speech_tails * fade_out
        speech = torch.cat([faded, speech[:, overlap:]], dim=1)
    audio: list[Tensor] = []
    if not all(lasts):
        # Copies: the caches outlive this call's batch tensors.
        mel_cache, source_cache = mel[:, :, -frames:].clone(), out.source[:, :, -overlap:].clone()
        tail_cache = speech[:, -overlap:].clone()
    for row, (stream, last) in enumerate(zip(streams, lasts, strict=True)):
        if last:
            stream.close()
            audio.append(speech[row])
            continue
        stream._keep(mel_cache[row : row + 1], source_cache[row : row + 1], tail_cache[row])
        audio.append(speech[row, :-overlap])
    return audio


class VocoderGraphs(Protocol):
    """Runs `HiFTGenerator.vocode_with_noise` from CUDA graphs where it can (vocoder_graphs)."""

    def final_bucket(self, frames: int, cached: int) -> int | None:
        """The mel frames (at least `frames`) that a final chunk of `frames` after `cached` source
        samples is right-padded to for a masked graph, or None to vocode it at its own length."""
        ...

    def vocode(self, mel: Tensor, cache_source: Tensor | None, noise: Tensor,
               frames: Tensor | None = None) -> Vocoded: ...


class _Input(NamedTuple):
    """One stream's vocoder input: its cached mel frames (None on its first call) and its new mel, in the
    flow's dtype."""

    cached: Tensor | None
    mel: Tensor

    @property
    def frames(self) -> int:
        return self.mel.shape[2] + (0 if self.cached is None else self.cached.shape[2])

    def joined(self) -> Tensor:
        return self.mel if self.cached is None else torch.cat([self.cached, self.mel], dim=2)


def _joined_rows(inputs: Sequence[_Input], dtype: torch.dtype) -> Tensor:
    """The rows' [cached, new] mels as one batch in `dtype`; the rows have equal cached and new lengths
    (one `_CallKey`): one concatenation of the caches, one of the mels, one join."""
    mels = torch.cat([row.mel for row in inputs])
    caches = [row.cached for row in inputs if row.cached is not None]
    if caches:
        mels = torch.cat([torch.cat(caches), mels], dim=2)  # cat promotes to the caches' float32
    return mels.to(dtype)


class HostAudio:
    """The audio of one `launch_vocode_streams` call on its way to the host (one copy for the batch):
    `wait()` returns float32 (samples,) CPU audio per stream, empty for streams that produced none."""

    def __init__(self, pieces: dict[int, Tensor], streams: int) -> None:
        self._order = sorted(pieces)
        self._sizes = [pieces[i].numel() for i in self._order]
        self._streams = streams
        joined = [pieces[i] for i in self._order]
        self._download = Download(torch.cat(joined).float()) if joined else None

    def wait(self) -> list[Tensor]:
        if self._download is None:
            return [torch.zeros(0) for _ in range(self._streams)]
        audio = dict(zip(self._order, self._download.wait().split(self._sizes), strict=True))
        return [audio[i] if i in audio else torch.zeros(0) for i in range(self._streams)]


def vocode_streams(
    streams: Sequence[HiFTStream], mels: Sequence[Tensor], lasts: Sequence[bool],
    graphs: VocoderGraphs | None = None,
) -> list[Tensor]:
    """`launch_vocode_streams`, waiting for its audio."""
    return launch_vocode_streams(streams, mels, lasts, graphs).wait()


class _CallKey(NamedTuple):
    """Rows that share one generator call: mel frames of the call, whether a source cache comes first,
    and whether the rows are right-padded to those frames (final chunks only)."""

    frames: int
    cached: bool
    padded: bool


@torch.inference_mode()
def launch_vocode_streams(
    streams: Sequence[HiFTStream], mels: Sequence[Tensor], lasts: Sequence[bool],
    graphs: VocoderGraphs | None = None,
) -> HostAudio:
    """`HiFTStream.process` for distinct streams of one generator, without waiting for the device: the
    streams' caches are updated as the work is queued, and the audio comes from `HostAudio.wait()`.

    Streams whose inputs have equal shapes (chunk length with the cached frames, and whether a source
    cache exists) share one batched generator call, from `graphs` where given; each row draws its noise
    from its own stream's generator, so every stream gets exactly what it would alone. With `graphs`,
    final chunks of lengths the graphs have no shape for are padded to the bucket they name and share
    its call (masked: each row's audio is its own).
    """
    if not len(streams) == len(mels) == len(lasts):
        raise ValueError(f"{len(streams)} streams, {len(mels)} mels, {len(lasts)} flags")
    pending: dict[int, _Input] = {}
    groups: dict[_CallKey, list[int]] = {}
    for index, (stream, mel, last) in enumerate(zip(streams, mels, lasts, strict=True)):
        mel_in = stream._next_input(mel.to(stream.generator.stft_window.device), last)
        if mel_in is None:
            continue
        pending[index] = mel_in
        cache = stream._cache()
        bucket = None
        if last and graphs is not None:
            bucket = graphs.final_bucket(mel_in.frames, 0 if cache is None else cache.shape[2])
        key = _CallKey(mel_in.frames if bucket is None else bucket, cache is not None, bucket is not None)
        groups.setdefault(key, []).append(index)
    speech: dict[int, Tensor] = {}
    for key, indices in groups.items():
        members = [streams[i] for i in indices]
        caches = [cache for s in members if (cache := s._cache()) is not None]
        source = torch.cat(caches) if caches else None
        hift = members[0].generator
        cached = 0 if source is None else source.shape[2]
        rows_frames: Tensor | None = None
        if key.padded:
            rows = [pending[i].joined() for i in indices]
            mel, noise, rows_frames = _padded_rows(hift, members, rows, key.frames, cached)
        else:
            mel = _joined_rows([pending[i] for i in indices], hift.input_dtype)
            samples = key.frames * hift.hop_samples - cached
            noise = hift.draw_noise([s._noise for s in members], len(members), samples, mel.device)
        if graphs is None:
            out = hift.vocode_with_noise(mel, source, noise)
        else:
            out = graphs.vocode(mel, source, noise, rows_frames)
        tails = None if source is None else torch.stack([s._held_tail() for s in members])
        rows_audio = _emit_rows(members, [lasts[i] for i in indices], mel, out, tails)
        if key.padded:
            rows_audio = [audio[: pending[i].frames * hift.hop_samples]
                          for i, audio in zip(indices, rows_audio, strict=True)]
        speech.update(zip(indices, rows_audio, strict=True))
    return HostAudio(speech, len(streams))


def _padded_rows(hift: HiFTGenerator, streams: Sequence[HiFTStream], mels: Sequence[Tensor], frames: int,
                 cached: int) -> tuple[Tensor, Tensor, Tensor]:
    """Final chunks right-padded to `frames`: the mel (zeros after each row's), each row's noise drawn at
    its own length (as an unpadded call draws it) and zero after, and the rows' frame counts (device)."""
    device = mels[0].device
    lengths = [mel.shape[2] for mel in mels]
    mel = torch.cat([F.pad(m, (0, frames - n)) for m, n in zip(mels, lengths, strict=True)])
    mel = mel.to(hift.input_dtype)
    samples = frames * hift.hop_samples - cached
    own_samples = [n * hift.hop_samples - cached for n in lengths]
    noise = torch.cat([F.pad(hift.draw_noise([s._noise], 1, own, device), (0, 0, 0, samples - own))
                       for s, own in zip(streams, own_samples, strict=True)])
    return mel, noise, upload(torch.tensor(lengths), device)
