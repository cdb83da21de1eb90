"""CUDA graphs for HiFT (`HiFTGenerator.vocode_with_noise`): one per chunk shape, and one per bucket of
lengths for final chunks (masked). The graphs' mechanics (shared pool and arena, capture on first use,
pause and seal, stand-ins) are `graphs.ShapeGraphs`'.

Batches pad to a bucket with rows nobody reads, and chunk lengths are exact for the lengths the chunk
schedule produces. Final chunks, whose lengths are whatever a segment leaves, are right-padded to a bucket
of lengths and masked inside HiFT (its convolutions see both ways: each layer's output is zeroed past each
row's end, as its zero padding would be), so each row's audio is its own. A chunk shape without its graph
runs in one of more rows (`stand_in`); other calls run eagerly.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Iterable
from dataclasses import dataclass

import torch

from engines.cuda_graphs import capture_graph, measured_conv_plans
from engines.token2wav.batching import round_up
from engines.token2wav.graphs import CapturedGraph, ShapeGraphs, TensorSource
from engines.token2wav.hift import HiFTGenerator, Vocoded

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class VocodeShape:
    """One HiFT call: rows (bucketed), mel frames and source samples cached from the previous call, and
    whether rows are right-padded final chunks (masked, with each row's frames as an input)."""

    batch: int
    frames: int
    cached: int
    padded: bool = False


@dataclass(frozen=True)
class _VocoderInputs:
    mel: torch.Tensor
    cache: torch.Tensor | None  # source samples
    noise: torch.Tensor
    frames: torch.Tensor | None  # (batch,) int64, padded shapes only


# Mel frames (the 8 cached ones included) that final chunks are padded to: a last chunk carries whatever
# is left of its segment, any length up to a hop (400 tokens: 808 frames), and eagerly each new length
# costs ~0.1 s of host time (cuDNN plans) and every call ~20 ms of launches.
# Padding wastes at most a quarter of a call's frames (~10 % on average); each bucket is ~7 graphs,
# ~0.1 s of start-up each on an H100.
FINAL_CHUNK_FRAMES = (16, 32, 48, 64, 80, 96, 128, 160, 192, 256, 320, 384, 448, 512, 640, 816)
# Rows of a final-chunk graph: more final chunks in one call run as parts of this many. Finals are one per
# utterance and seldom meet in numbers outside a bench whose streams all start together; HiFT's device
# time grows with rows × frames, so parts cost about what one larger graph would, while every row
# bucket above this adds ~19 graphs to every start (76 took 8.0 s of an H100 restart, docs/benchmarks.md,
# eighteenth session; mostly cuDNN's plan per new shape).
FINAL_CHUNK_MAX_ROWS = 8


@dataclass(frozen=True)
class FinalChunkBuckets:
    """The final-chunk graphs a `GraphedVocoder` keeps: `frames` buckets (sorted) at the row buckets of
    `batches` up to `max_rows` rows and `max_row_frames` rows × frames."""

    frames: tuple[int, ...]
    batches: tuple[int, ...]
    max_row_frames: int
    max_rows: int = FINAL_CHUNK_MAX_ROWS

    def bucket(self, frames: int) -> int | None:
        """The frames a final chunk of `frames` is padded to (None: longer than every bucket)."""
        return next((bucket for bucket in self.frames if bucket >= frames), None)

    def batches_for(self, frames: int) -> list[int]:
        """The row buckets of the graphs `frames` long."""
        return [batch for batch in self.batches
                if batch <= self.max_rows and batch * frames <= self.max_row_frames]

    def parts(self, rows: int, frames: int) -> list[int] | None:
        """The row counts, in order, of the graphs that `rows` padded chunks of `frames` run in: the
        largest bucket that fits the rows left each time (None: no graph has these frames)."""
        buckets, parts = self.batches_for(frames), []
        while rows > 0:
            part = max((b for b in buckets if b <= rows), default=None)
            if part is None:
                return None
            parts.append(part)
            rows -= part
        return parts


class GraphedVocoder(ShapeGraphs[VocodeShape, _VocoderInputs, Vocoded]):
    """`HiFTGenerator.vocode_with_noise` from CUDA graphs for chunk shapes in `chunks`, eager otherwise.

    chunks: (mel frames, cached source samples) pairs to serve from graphs, e.g. a first chunk of 30
    frames without cache and later chunks of 8 + 50 frames after a 3840-sample cache; batches: row
    buckets. Final chunks of other lengths are padded to the next of `final_frames` and run from masked
    graphs of at most `max_final_rows` rows and `max_row_frames` rows × frames (default: that of the
    largest chunk graph, so their shared pool does not grow), in parts of exactly a row bucket each.
    Graphs are captured on first use
    (or by `capture`, before `seal`); outputs are returned as copies.
    """

    def __init__(
        self, hift: HiFTGenerator, chunks: Iterable[tuple[int, int]], batches: tuple[int, ...],
        final_frames: tuple[int, ...] = FINAL_CHUNK_FRAMES, max_row_frames: int | None = None,
        max_final_rows: int = FINAL_CHUNK_MAX_ROWS,
    ) -> None:
        super().__init__(hift.stft_window.device)
        self.hift = hift
        self.chunks = frozenset(chunks)
        self.batches = batches
        row_frames = (max(batches) * max(frames for frames, _ in self.chunks)
                      if max_row_frames is None else max_row_frames)
        self.finals = FinalChunkBuckets(tuple(sorted(final_frames)), batches, row_frames, max_final_rows)
        # Every graph within rows × frames ≤ max_row_frames views these at their final size from the
        # start: the warm-up meets chunk shapes before the final ones, whose noise after no cache is
        # longer than a chunk graph's, and a grown buffer would mean capturing the earlier graphs again.
        rows = max(batches)
        frames = -(-row_frames // rows)
        # The longest noise (no cache), the longest cache.
        self.reserve(VocodeShape(rows, frames, cached, True) for cached in (0, hift.cfg.source_cache_samples))

    def _holds(self, captured: VocodeShape, shape: VocodeShape) -> bool:
        # Rows only: frames and cache are the audio's own (padded final chunks run in exact row parts).
        return (not captured.padded and not shape.padded and captured.batch >= shape.batch
                and (captured.frames, captured.cached) == (shape.frames, shape.cached))

    def _static_buffers(self, shape: VocodeShape, view: TensorSource) -> None:
        for name, (size, dtype) in self._buffer_specs(shape).items():
            view(name, size, dtype)

    def _buffer_specs(self, shape: VocodeShape) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        """The static inputs and outputs of a graph of `shape`: arena name → (size, dtype)."""
        hift, b, f32 = self.hift, shape.batch, torch.float32
        samples = shape.frames * hift.hop_samples
        specs = {"mel": ((b, hift.cfg.in_channels, shape.frames), f32),
                 "noise": ((b, samples - shape.cached, hift.num_harmonics), f32),
                 "speech": ((b, samples), f32),
                 "source": ((b, 1, samples), f32)}
        if shape.cached:
            specs["cache_source"] = ((b, 1, shape.cached), f32)
        if shape.padded:
            specs["frames"] = ((b,), torch.int64)
        return specs

    def final_bucket(self, frames: int, cached: int) -> int | None:
        if (frames, cached) in self.chunks:
            return None
        return self.finals.bucket(frames)

    def final_shapes(self, cached: int, max_frames: int | None = None) -> list[VocodeShape]:
        """The padded final-chunk shapes after `cached` source samples (up to `max_frames`) that graphs
        serve: what the warm-up captures."""
        finals = self.finals
        if not finals.frames:
            return []
        least = cached // self.hift.hop_samples
        most = finals.frames[-1] if max_frames is None else max_frames
        shapes = [VocodeShape(batch, frames, cached, padded=True)
                  for frames in finals.frames if least < frames <= most
                  for batch in finals.batches_for(frames)]
        # Largest first: a capture's working memory then fits in the blocks the pool already holds.
        return sorted(shapes, key=lambda shape: shape.batch * shape.frames, reverse=True)

    def vocode(self, mel: torch.Tensor, cache_source: torch.Tensor | None, noise: torch.Tensor,
               frames: torch.Tensor | None = None) -> Vocoded:
        rows, _, length = mel.shape
        cached = 0 if cache_source is None else cache_source.shape[2]
        batch = round_up(rows, self.batches)
        if frames is not None:
            if batch != rows or rows not in self.finals.batches_for(length):
                return self._vocode_in_parts(mel, cache_source, noise, frames)
            batch = rows
        elif batch is None or (length, cached) not in self.chunks:
            return self.hift.vocode_with_noise(mel, cache_source, noise)
        shape = VocodeShape(batch, length, cached, padded=frames is not None)
        if frames is None:
            shape = self.stand_in(shape)
        if not self.covers(shape):
            return self.hift.vocode_with_noise(mel, cache_source, noise, frames)
        inputs = self.buffers(shape)
        inputs.mel[:rows].copy_(mel)
        inputs.noise[:rows].copy_(noise)
        if inputs.cache is not None and cache_source is not None:
            inputs.cache[:rows].copy_(cache_source)
        if inputs.frames is not None and frames is not None:
            inputs.frames[:rows].copy_(frames)
        out = self.run(shape)
        return Vocoded(out.speech[:rows].clone(), out.source[:rows].clone())

    def _vocode_in_parts(self, mel: torch.Tensor, cache_source: torch.Tensor | None, noise: torch.Tensor,
                         frames: torch.Tensor) -> Vocoded:
        """Padded rows in parts of exactly a final graph's row bucket each (the largest that fits the rows
        left; 13 rows: 8 + 4 + 1), so no graph computes padding rows (eagerly where no bucket fits)."""
        rows, _, length = mel.shape
        sizes = self.finals.parts(rows, length)
        if sizes is None:
            return self.hift.vocode_with_noise(mel, cache_source, noise, frames)
        ends = list(itertools.accumulate(sizes))
        parts = [slice(end - size, end) for end, size in zip(ends, sizes, strict=True)]
        outs = [self.vocode(mel[rows_of], None if cache_source is None else cache_source[rows_of],
                            noise[rows_of], frames[rows_of])
                for rows_of in parts]
        return Vocoded(torch.cat([o.speech for o in outs]), torch.cat([o.source for o in outs]))

    @torch.inference_mode()
    def _capture(self, shape: VocodeShape) -> CapturedGraph[_VocoderInputs, Vocoded]:
        """In inference mode, as every call runs (launch_vocode_streams): the warm-up run then keeps no
        autograd history alive through the static outputs, and the arena's tensors are of one kind."""
        hift = self.hift
        views = {name: self._arena.view(name, *spec) for name, spec in self._buffer_specs(shape).items()}
        mel, noise = views["mel"], views["noise"]
        cache, frames = views.get("cache_source"), views.get("frames")
        if frames is not None:
            # Rows past a call's own keep old values: every value written is a whole row's frame count.
            frames.fill_(shape.frames)
        out = Vocoded(views["speech"], views["source"])

        def run() -> None:
            result = hift.vocode_with_noise(mel, cache, noise, frames)
            for target, value in zip(out, result, strict=True):
                target.copy_(value)

        def warm_up_measuring_plans() -> None:
            with measured_conv_plans():
                run()

        # A half decoder's chunk graphs run the plans cuDNN measures fastest: its heuristics chose a 62 ms
        # plan for 64 float16 rows of a first chunk, which measured plans run in 6 ms. In float32 their
        # picks are within 3 % of the measured ones, and measuring every graph's plans took the warm-up
        # from 45 to 132 s (docs/benchmarks.md, thirty-sixth session).
        measure = hift.decoder_dtype != hift.input_dtype and not shape.padded
        graph = capture_graph(run, self._pool, self._stream,
                              warmup=warm_up_measuring_plans if measure else None)
        logger.info("captured HiFT graph %s", shape)
        return CapturedGraph(graph, _VocoderInputs(mel, cache, noise, frames), out)
