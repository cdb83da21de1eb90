"""Padded batches of ragged rows: the helpers and the bucketing policy behind `run_chunks`.

Streams' chunks differ in length and their caches in size. A batch lays them out so that one padded
computation serves all rows exactly:
- chunk frames are right-padded: real frames first, so causal convs never read padding, and each row's
  new conv context is gathered at its real end (`frames_before`);
- cached history is left-padded: real frames end where the chunk starts, so relative distances between
  a row's chunk and its history are those of the row alone (the conformer's relative positions);
- padded keys are masked (`span_mask`), padded queries produce rows nobody reads.

`Buckets` rounds shapes up to a few sizes so that CUDA graphs (graphs.py) can be captured ahead of time.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch


def frame_index(ends: torch.Tensor, count: int) -> torch.Tensor:
    """(B, count) int64: positions [ends − count, ends) per row; ends (B,) int64 ≥ count."""
    return ends[:, None] + torch.arange(-count, 0, device=ends.device)


def frames_before(h: torch.Tensor, ends: torch.Tensor, count: int) -> torch.Tensor:
    """Frames [ends − count, ends) of every row of h (B, C, T); ends (B,) int64 ≥ count. → (B, C, count)."""
    return h.gather(2, frame_index(ends, count)[:, None, :].expand(-1, h.shape[1], -1))


def span_mask(history: int, chunk: int, history_lengths: torch.Tensor, chunk_lengths: torch.Tensor,
              ) -> torch.Tensor:
    """Bool (B, history + chunk): the keys of rows laid out as [left-padded history, right-padded chunk].

    Row i's real keys are the contiguous span [history − history_lengths[i], history + chunk_lengths[i]).
    """
    position = torch.arange(history + chunk, device=history_lengths.device)
    return (position >= history - history_lengths[:, None]) & (position < history + chunk_lengths[:, None])


def round_up(value: int, sizes: Sequence[int]) -> int | None:
    """The smallest of the ascending `sizes` ≥ value, or None when value exceeds them all."""
    index = bisect.bisect_left(sizes, value)
    return sizes[index] if index < len(sizes) else None


@dataclass(frozen=True)
class SolveShape:
    """The padded shape of one batched CFM solve: rows, chunk frames, own-cache frames, prompt frames,
    and the own-cache frames kept after the chunk."""

    batch: int
    frames: int
    own_frames: int
    prompt_frames: int
    kept_frames: int


@dataclass(frozen=True)
class EncodeShape:
    """One batched encoder call: rows, tokens encoded per row (its lookahead comes on top), cached
    tokens per row (left-padded history)."""

    batch: int
    tokens: int
    history: int


@dataclass(frozen=True)
class Buckets:
    """Shapes rounded up for CUDA graphs; a dimension beyond its largest size runs eagerly at its exact size.

    batch: row counts; frames: chunk mel frames (2 per token: 30 = the first 15-token hop, 50, 100, …);
    prompt_frames: the summed prompt frames of a batch's voices; own_frames: a row's cached generated
    frames (0 for first chunks; 30 after a first chunk, which a bucket of 32 spares padding to 100:
    second-chunk calls 7–9 % shorter on an H100; at most R = 100 under the "prompt_recent" rule, L_p + R
    under the reference's, 1600 for a 30 s prompt), also the frames kept after a chunk (at most own +
    chunk);
    history_tokens: the encoder's cached tokens per row (prompt and own, never trimmed: at most 2048
    through the LLM's context; with a 200-token chunk that stays within the position table's 2500).
    """

    batch: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64)
    frames: tuple[int, ...] = (30, 50, 100, 200, 400)
    prompt_frames: tuple[int, ...] = (256, 512, 1024, 2048, 4096)
    own_frames: tuple[int, ...] = (32, 100, 200, 400, 800, 1600)
    history_tokens: tuple[int, ...] = (128, 256, 512, 1024, 2048)

    def shape(self, exact: SolveShape) -> SolveShape | None:
        """The bucket holding `exact`, or None when a dimension is beyond every bucket."""
        batch = round_up(exact.batch, self.batch)
        frames = round_up(exact.frames, self.frames)
        prompt = round_up(exact.prompt_frames, self.prompt_frames)
        own = 0 if exact.own_frames == 0 else round_up(exact.own_frames, self.own_frames)
        kept = round_up(exact.kept_frames, self.own_frames)
        if batch is None or frames is None or prompt is None or own is None or kept is None:
            return None
        return SolveShape(batch, frames, own, prompt, min(kept, own + frames))

    def encode_shape(self, exact: EncodeShape, stride: int) -> EncodeShape | None:
        """The bucket holding an encoder call (tokens round with the frames: `stride` frames per token),
        or None when a dimension is beyond every bucket."""
        batch = round_up(exact.batch, self.batch)
        frames = round_up(stride * exact.tokens, self.frames)
        history = round_up(exact.history, self.history_tokens)
        if batch is None or frames is None or history is None or frames % stride:
            return None
        return EncodeShape(batch, frames // stride, history)


@dataclass(frozen=True)
class RowSpec:
    """What batch planning needs to know about one chunk: its mel frames, its voice's prompt, and the
    own-cache frames its solve reads and keeps (`SolveShape.own_frames` / `kept_frames` of the row)."""

    frames: int
    voice: int  # index of the row's voice among the distinct voices of the call
    prompt_frames: int
    own_frames: int = 0
    kept_frames: int = 0


def plan_batches(rows: Sequence[RowSpec], buckets: Buckets,
                 fits: Callable[[SolveShape], bool] | None = None) -> list[list[int]]:
    """Row indices grouped into batches: equal frame bucket, at most the largest batch bucket, voices
    whose prompts fit the largest prompt bucket side by side, and (with `fits`) a padded solve shape
    that `fits` accepts (a memory cap: `solve_memory.SolveMemory.fits`; a row alone always runs).

    Chunks of very different lengths are not mixed: padding a 15-token first chunk to a 200-token later
    one would multiply its cost, while separate batches cost one more graph replay. Within a frame
    bucket rows go by own-cache length (stable), so that rows of similar caches share a batch and a
    cap on long caches splits off only those. Then shorter first chunks fill the padding rows of a batch
    of longer chunks where they leave its padded shape as it is (`_fill_first_chunk_padding`).
    """
    by_frames: dict[int, list[int]] = {}
    for index, row in enumerate(rows):
        key = round_up(row.frames, buckets.frames) or row.frames
        by_frames.setdefault(key, []).append(index)
    batches: list[list[int]] = []
    max_batch, max_prompt = buckets.batch[-1], buckets.prompt_frames[-1]
    for indices in by_frames.values():
        batch: list[int] = []
        voices: set[int] = set()
        prompt = 0
        for index in sorted(indices, key=lambda i: rows[i].own_frames):
            row = rows[index]
            extra = 0 if row.voice in voices else row.prompt_frames
            if batch and (len(batch) == max_batch or prompt + extra > max_prompt
                          or (fits is not None and not fits(_padded([rows[i] for i in batch] + [row],
                                                                     prompt + extra, buckets)))):
                batches.append(batch)
                batch, voices, prompt, extra = [], set(), 0, row.prompt_frames
            batch.append(index)
            voices.add(row.voice)
            prompt += extra
        batches.append(batch)
    return _fill_first_chunk_padding(rows, batches, buckets)


def _fill_first_chunk_padding(rows: Sequence[RowSpec], batches: list[list[int]],
                              buckets: Buckets) -> list[list[int]]:
    """Move rows of first chunks (nothing cached yet) into the padding rows of a batch of longer chunks,
    while its padded shape stays what it was: its solve graph computes those rows anyway, and the rows' own
    batch gets smaller or goes (a burst of streams with 10- and 15-token first chunks: one 64-row solve,
    not a 48-row one padded to 64 and a 16-row one). Only first chunks: their encoder history is their
    voice's prompt, which a batch holding that voice reaches already (its padded shape counts each voice's
    prompt), while a later chunk could lengthen the batch's encoder history. And only into a batch of at
    most twice their frames: an eager solve (no graph) computes every row at the batch's frames."""
    def prompt_of(batch: Sequence[int]) -> int:
        return sum({rows[i].voice: rows[i].prompt_frames for i in batch}.values())

    def frames_of(batch: Sequence[int]) -> int:
        return max(rows[i].frames for i in batch)

    ordered = sorted(batches, key=frames_of, reverse=True)
    for target in ordered:
        if not target:
            continue
        frames, shape = frames_of(target), _padded([rows[i] for i in target], prompt_of(target), buckets)
        for donor in sorted(ordered, key=len):  # the smallest batches first: they go altogether
            if len(target) == shape.batch:
                break
            if not donor or frames_of(donor) >= frames:
                continue
            for index in [i for i in donor if rows[i].own_frames == 0 and 2 * rows[i].frames >= frames]:
                candidate = [*target, index]
                if len(target) < shape.batch and _padded([rows[i] for i in candidate], prompt_of(candidate),
                                                         buckets) == shape:
                    target.append(index)
                    donor.remove(index)
    return [batch for batch in batches if batch]


def _padded(rows: Sequence[RowSpec], prompt_frames: int, buckets: Buckets) -> SolveShape:
    """The shape a batch of `rows` solves at: its bucket, or its exact shape beyond the buckets."""
    exact = SolveShape(len(rows), max(row.frames for row in rows), max(row.own_frames for row in rows),
                       prompt_frames, max(row.kept_frames for row in rows))
    return buckets.shape(exact) or exact
