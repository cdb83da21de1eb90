"""The PyTorch token2wav warm-up in steps (`TorchToken2Wav.staged_warmup`): a first stage before traffic,
then steps that the engine thread runs between serving calls.

A whole warm-up captures ~250 CUDA graphs (encoder, solve and HiFT graphs for every chunk of the schedule
at every batch size, and the final chunks' shapes): ~30 s of an H100 restart, each capture tens to
hundreds of milliseconds of host time (docs/benchmarks.md, twentieth session), while serving needs few of
them at once. The first stage runs, largest shapes first:
- every chunk of the largest batch through the schedule, and that batch's later solve and encoder graphs
  (`warmup_shapes.later_graph_shapes`): the graphs' memory pools reach their peak before traffic (final-chunk
  vocoder graphs are bounded by the largest chunk graph), so that memory admission, measured once the
  first stage is done, sees it;
- a first chunk at every other batch size, and first chunks of the backend's `extra_first_hops` at every
  batch size: a new stream's first audio never runs eagerly.
Then graphs are captured only inside a step (`pause`). For each other batch size (smallest first: traffic
ramps up) the graphs its chunk pass meets and its later solve and encoder graphs are captured, one per
step, then its streams run through the schedule, one chunk call per step (replaying them); then the
final-chunk vocoder graphs, one per step; a step with nothing to capture is skipped. Until its step has
come, a shape runs in a captured graph holding it (`ShapeGraphs.stand_in`: the largest batch's, padded),
eagerly where none does; a call that arrives during a step waits for it. The last step seals the
graphs. Without CUDA graphs all of it is the first stage.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import time
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING

import torch

from engines.config import PRE_LOOKAHEAD, TOKEN_MEL_RATIO
from engines.cuda_graphs import usable_bytes
from engines.exclusive import EXCLUSIVE
from engines.token2wav.base import ChunkJob, SpeakerState, WarmupSteps
from engines.token2wav.batching import round_up
from engines.token2wav.flow_dit import DiTFlow, DiTSpeaker
from engines.token2wav.graphs import GraphedEncoder, GraphedSolver
from engines.token2wav.vocoder_graphs import GraphedVocoder, VocodeShape
from engines.token2wav.warmup_shapes import graphed_shapes, later_graph_shapes, planned_solve_shapes

if TYPE_CHECKING:
    from engines.token2wav.torch_backend import TorchToken2Wav

logger = logging.getLogger(__name__)

GraphSet = GraphedSolver | GraphedEncoder | GraphedVocoder
_DONE = object()  # what `next` returns for an exhausted part of the steps


def staged_warmup(t2w: TorchToken2Wav, speaker: SpeakerState, voice: DiTSpeaker | None,
                  batches: Sequence[int], hops: Sequence[int], phases: Phases) -> WarmupSteps:
    """The warm-up of `t2w` with `speaker`'s streams (`voice`: its DiT flow state, if any) at each of
    `batches` through chunks of `hops` tokens and a last one: the first stage until the first `yield`,
    then one step per `yield` (see the module docstring). The graphs' buffers must be sized first
    (`warmup_shapes.reserve_graphs`); `phases` goes on timing the caller's first-stage work."""
    tokens = torch.zeros(sum(hops) + PRE_LOOKAHEAD, dtype=torch.int64)
    largest, *others = sorted(batches, reverse=True)
    graph_sets = _graph_sets(t2w)
    _run_all(_chunk_pass(t2w, speaker, largest, hops, tokens))
    phases.end(f"chunk pass at {largest}")
    if not graph_sets:
        for batch in others:
            _run_all(_chunk_pass(t2w, speaker, batch, hops, tokens))
        phases.end("chunk passes")
        logger.info("%s warm-up on %s: %s", t2w.name, t2w.device, phases)
        yield
        return
    _run_all(_later_flow_captures(t2w.flow, [largest]))
    phases.end(f"later graphs at {largest}")
    for batch in others:
        _run_all(_chunk_pass(t2w, speaker, batch, hops[:1], tokens, last=False))
    phases.end("first chunks")
    if t2w.extra_first_hops:  # a schedule starting with a shorter (or longer) chunk: its first chunks too
        for hop in t2w.extra_first_hops:
            for batch in (largest, *others):
                _run_all(_chunk_pass(t2w, speaker, batch, (hop,), tokens, last=False))
        phases.end(f"first chunks of {', '.join(map(str, t2w.extra_first_hops))} tokens")
    if isinstance(t2w.flow, DiTFlow):
        t2w.flow.pause_graphs()  # its graph sets, and the DiT block's compiling sealed
    if t2w.vocoder_graphs is not None:
        t2w.vocoder_graphs.pause()
    logger.info("%s warm-up on %s, first stage: %s", t2w.name, t2w.device, phases)
    free_before = _free_gib(t2w.device)
    yield
    began, worked, longest, steps = time.perf_counter(), 0.0, 0.0, 0
    later: list[WarmupSteps] = []
    for batch in sorted(others):
        later += [_graphs_of_pass(t2w, voice, batch, hops), _chunk_pass(t2w, speaker, batch, hops, tokens)]
    later.append(_later_flow_captures(t2w.flow, others))  # what the passes' own captures left, if any
    if t2w.vocoder_graphs is not None:
        later.append(_final_vocoder_captures(t2w, t2w.vocoder_graphs))
    try:
        for part in later:
            while True:
                resumed = time.perf_counter()
                with contextlib.ExitStack() as capturing:
                    for graphs in graph_sets:
                        capturing.enter_context(graphs.capturing())
                    done = next(part, _DONE) is _DONE
                took = time.perf_counter() - resumed
                worked, longest = worked + took, max(longest, took)
                if done:
                    break
                steps += 1
                yield
    finally:  # also when a step failed or the engine stops mid-way: nothing more is captured
        try:
            for part in later:
                part.close()  # the pass in progress closes its streams
        finally:
            if isinstance(t2w.flow, DiTFlow):
                t2w.flow.seal_graphs()
            if t2w.vocoder_graphs is not None:
                t2w.vocoder_graphs.seal()
    # The device memory the steps took is not in memory admission's budget (measured after the first
    # stage): this says how much of its margin they used.
    logger.info("%s warm-up on %s finished between calls: %d steps, %.1f s of work in %.1f s, the longest "
                "%.0f ms; device memory free %.2f GiB (%.2f GiB after the first stage)", t2w.name,
                t2w.device, steps, worked, time.perf_counter() - began, 1000 * longest, _free_gib(t2w.device),
                free_before)


def _free_gib(device: torch.device) -> float:
    """`usable_bytes` in GiB, as memory admission measures it (realtime/memory_budget.py)."""
    return usable_bytes(device) / 2**30


def _graph_sets(t2w: TorchToken2Wav) -> list[GraphSet]:
    sets: list[GraphSet] = list(t2w.flow.graph_sets()) if isinstance(t2w.flow, DiTFlow) else []
    if t2w.vocoder_graphs is not None:
        sets.append(t2w.vocoder_graphs)
    return sets


def _chunk_pass(t2w: TorchToken2Wav, speaker: SpeakerState, batch: int, hops: Sequence[int],
                tokens: torch.Tensor, last: bool = True) -> WarmupSteps:
    """`batch` streams of `speaker` in step through chunks of `hops` tokens, then (`last`) a final chunk
    of the lookahead alone: one `yield` after each call. The streams close at the end, or when the pass
    is closed early. Each call holds engines/exclusive.py's lock: an LLM building beside it may trace."""
    starts = list(itertools.accumulate(hops, initial=0))
    pieces = [(tokens[start : start + hop + PRE_LOOKAHEAD], False)
              for start, hop in zip(starts[:-1], hops, strict=True)]
    if last:
        pieces.append((tokens[starts[-1] :], True))
    streams = [t2w.open_stream(speaker) for _ in range(batch)]
    try:
        for piece, final in pieces:
            with EXCLUSIVE:
                t2w.run_chunks([ChunkJob(stream, piece, last=final) for stream in streams])
            yield
    finally:
        for stream in streams:
            stream.close()


def _run_all(steps: Iterator[None]) -> None:
    for _ in steps:
        pass


def _later_flow_captures(flow: object, batches: Sequence[int]) -> WarmupSteps:
    """Capture the solve and encoder graphs at `batches` rows that chunk passes do not meet, one per
    `yield` (the shapes follow from what the passes before met; those captured already are skipped)."""
    if isinstance(flow, DiTFlow):
        for shape in later_graph_shapes(flow, batches):
            if flow.capture_graph(shape):
                yield


def _graphs_of_pass(t2w: TorchToken2Wav, voice: DiTSpeaker | None, batch: int, hops: Sequence[int],
                    ) -> WarmupSteps:
    """Capture, one per `yield`, the graphs a chunk pass of `batch` streams meets (its planned solves, its
    chunks' HiFT shapes) and the later solve and encoder graphs at that batch, before the pass: its calls
    then replay them, rather than one step capturing a call's encoder, solve and HiFT graphs at once (the
    longest steps, up to ~0.7 s on an H100, which a call arriving meanwhile waits for)."""
    flow, vocoder = t2w.flow, t2w.vocoder_graphs
    if isinstance(flow, DiTFlow) and voice is not None:
        solves = graphed_shapes(flow, planned_solve_shapes(flow, [batch], hops, voice.prompt_frames))
        for planned_shape in [*solves, *later_graph_shapes(flow, [batch])]:
            if flow.capture_graph(planned_shape):
                yield
    rows = None if vocoder is None else round_up(batch, vocoder.batches)
    if vocoder is None or rows is None:
        return
    # The later chunks after HiFT's cached frames (the first one's shape is the first stage's), then the
    # last chunk, the lookahead alone, padded to its final-chunk bucket in parts of a row bucket each.
    cfg = vocoder.hift.cfg
    cached = cfg.source_cache_samples
    shapes = [VocodeShape(rows, TOKEN_MEL_RATIO * hop + cfg.mel_cache_frames, cached, padded=False)
              for hop in hops[1:]]
    shapes = [shape for shape in shapes if (shape.frames, shape.cached) in vocoder.chunks]
    final = vocoder.final_bucket(TOKEN_MEL_RATIO * PRE_LOOKAHEAD + cfg.mel_cache_frames, cached)
    if final is not None:
        shapes += [VocodeShape(part, final, cached, padded=True)
                   for part in dict.fromkeys(vocoder.finals.parts(batch, final) or [])]
    for shape in shapes:
        if vocoder.capture_missing(shape):
            yield


def _final_vocoder_captures(t2w: TorchToken2Wav, vocoder: GraphedVocoder) -> WarmupSteps:
    """Capture the final-chunk vocoder graphs, one per `yield`, largest first: final chunks of any
    length, after a first chunk's frames (a segment shorter than one chunk, no cache) or after the
    cached frames of a later one."""
    first_final = TOKEN_MEL_RATIO * (max((t2w.graph_hops[0], *t2w.extra_first_hops)) + PRE_LOOKAHEAD - 1)
    uncached = vocoder.final_bucket(first_final, 0) or first_final
    shapes = (vocoder.final_shapes(0, max_frames=uncached)
              + vocoder.final_shapes(vocoder.hift.cfg.source_cache_samples))
    # Largest first across both lists, as within each (see GraphedVocoder.final_shapes).
    for shape in sorted(shapes, key=lambda shape: shape.batch * shape.frames, reverse=True):
        if vocoder.capture_missing(shape):
            yield


class Phases:
    """Seconds of a sequence of steps on `device`, each from the end of the one before: what a warm-up
    spent where. A step ends once the device has done its work (captures queue work they do not wait for)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._mark = time.perf_counter()
        self._seconds: list[tuple[str, float]] = []

    def end(self, name: str) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        now = time.perf_counter()
        self._seconds.append((name, now - self._mark))
        self._mark = now

    def __str__(self) -> str:
        return ", ".join(f"{name} {seconds:.1f} s" for name, seconds in self._seconds)
