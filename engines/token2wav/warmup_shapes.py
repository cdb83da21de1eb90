"""Which solve and encoder shapes a DiT flow's start-up captures, and which shape classes of its compiled
block a cold start compiles in worker processes: worked out from the flow's buckets, its cache rule, the
schedule's hops and the voice's prompt alone (no device work). The warm-up (torch_warmup.py) and the
backend's start (torch_backend.py) act on them; the flow (flow_dit.py) serves whatever shapes they left.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Sequence

import torch

from engines.token2wav.batching import EncodeShape, RowSpec, SolveShape, plan_batches, round_up
from engines.token2wav.block_compile import BlockCompileJob, BlockCompileWorkers
from engines.token2wav.dit import DiT, one_call_attention
from engines.token2wav.dit_cache import EstimatorKeys
from engines.token2wav.flow_dit import DiTFlow, DiTSpeaker
from engines.token2wav.graphs import GraphedEncoder, GraphedSolver


def planned_solve_shapes(flow: DiTFlow, batches: Iterable[int], hops: Sequence[int],
                         prompt_frames: int) -> list[list[SolveShape]]:
    """The solves (bucketed shapes, as `DiTFlow.chunks` plans them) of streams of one voice run in step at
    each of `batches` streams, largest first, through chunks of `hops` tokens and then a last chunk of the
    lookahead alone: what `TorchToken2Wav.warmup`'s chunk pass solves, from the cache rule alone. One list
    per chunk of that sequence, in order, each shape once."""
    cfg = flow.cfg
    ratio, lookahead = cfg.token_mel_ratio, cfg.encoder.pre_lookahead
    fits = None if flow.solve_memory is None else flow.solve_memory.fits
    per_chunk: list[list[SolveShape]] = [[] for _ in range(len(hops) + 1)]
    for batch in sorted(set(batches), reverse=True):
        keys = EstimatorKeys.start(cfg.att_cache_rule, cfg.att_cache_recent_frames, prompt_frames)
        for shapes, tokens in zip(per_chunk, (*hops, lookahead), strict=True):
            frames = ratio * tokens
            after = keys.after_chunk(frames)
            row = RowSpec(frames, 0, prompt_frames, own_frames=len(keys.own), kept_frames=len(after.own))
            for planned in plan_batches([row] * batch, flow.buckets, fits):
                exact = SolveShape(len(planned), frames, row.own_frames, prompt_frames, row.kept_frames)
                shape = flow.buckets.shape(exact) or exact
                if shape not in shapes:
                    shapes.append(shape)
            keys = after
    return per_chunk


def first_chunk_solve_shapes(flow: DiTFlow, batches: Iterable[int], first_hops: Sequence[int],
                             prompt_frames: int) -> list[list[SolveShape]]:
    """The solves of streams' first chunks of each of `first_hops` tokens at each of `batches` streams (as
    `planned_solve_shapes` plans a schedule's first chunk), one list per hop."""
    return [planned_solve_shapes(flow, batches, (hop,), prompt_frames)[0] for hop in first_hops]


def planned_encoder_history(flow: DiTFlow, hops: Sequence[int], prompt_tokens: int) -> int | None:
    """The largest history bucket the warm-up's chunk pass encodes at (streams of a voice with
    `prompt_tokens` through chunks of `hops` tokens, then a last chunk of the lookahead alone), from the
    buckets alone; None when no chunk fits them (all run eagerly)."""
    stride, lookahead = flow.cfg.encoder.up_stride, flow.cfg.encoder.pre_lookahead
    histories: list[int] = []
    own = 0
    for tokens in (*hops, lookahead):
        shape = flow.buckets.encode_shape(EncodeShape(1, tokens, prompt_tokens + own), stride)
        if shape is not None:
            histories.append(shape.history)
        own += tokens
    return max(histories, default=None)


def encoder_capture_shapes(flow: DiTFlow, batches: Iterable[int], reached: int) -> list[EncodeShape]:
    """The encoder graphs of `later_graph_shapes` once streams reached `reached` history tokens: every
    chunk-token bucket at each of `batches` rows and each history bucket up to `reached`, largest first."""
    stride, buckets = flow.cfg.encoder.up_stride, flow.buckets
    rows = _row_buckets(flow, batches)
    tokens = sorted((f // stride for f in buckets.frames if f % stride == 0), reverse=True)
    history = sorted((h for h in buckets.history_tokens if h <= reached), reverse=True)
    return [EncodeShape(b, t, h) for b in rows for t in tokens for h in history]


def graphed_shapes(flow: DiTFlow, planned: Sequence[Sequence[SolveShape]]) -> list[SolveShape]:
    """The shapes of `planned` (`planned_solve_shapes`) that are buckets, so have graphs (the others run
    eagerly), in order."""
    return [shape for shapes in planned for shape in shapes if flow.buckets.shape(shape) == shape]


def _row_buckets(flow: DiTFlow, batches: Iterable[int]) -> list[int]:
    """The row buckets of `batches` streams' calls, largest first (those past the buckets left out)."""
    sizes = {round_up(b, flow.buckets.batch) for b in batches}
    return sorted((size for size in sizes if size is not None), reverse=True)


def later_graph_shapes(flow: DiTFlow, batches: Iterable[int]) -> list[SolveShape | EncodeShape]:
    """The solve and encoder graphs at `batches` rows that serving meets but running streams through the
    schedule in step (a warm-up's chunk pass) does not, once such a pass has run; largest first within
    each kind. Solves: every chunk-frames bucket at the most cached state the pass met (its largest own
    and kept frames, its prompts): once an utterance's cache is trimmed it stays there, and its last chunk
    (any length) or a batch mixing it with other streams' chunks solves there with any frames bucket; at
    the less cached states met (after a stream's first chunk or two) the frames buckets up to the chunk
    met there, for an utterance of a few words whose last chunk comes early; shapes over the solve memory
    cap are skipped, as batch planning never forms them. Encoder: every chunk-token bucket at each history
    bucket met: a last chunk may have any length. Longer histories are left out: their graphs' working
    memory grows with the history (at 64 rows, GiBs), and they only come after ~20 s of one utterance,
    where an eager encoder call is a small part of the chunk."""
    solver, encoder, batches = flow.graphs, flow.encoder_graphs, list(batches)
    shapes: list[SolveShape | EncodeShape] = []
    if solver is not None and solver.shapes:
        shapes += _solve_capture_shapes(flow, batches, solver.shapes)
    if isinstance(encoder, GraphedEncoder) and encoder.shapes:
        shapes += encoder_capture_shapes(flow, batches, max(shape.history for shape in encoder.shapes))
    return shapes


def _solve_capture_shapes(flow: DiTFlow, batches: Iterable[int], met: Sequence[SolveShape]
                          ) -> list[SolveShape]:
    """The solves of `later_graph_shapes` after a chunk pass that solved `met` (see there)."""
    cached = max(met, key=lambda shape: (shape.own_frames, shape.kept_frames))
    prompts = {shape.prompt_frames for shape in met}
    rows = _row_buckets(flow, batches)
    frames = sorted(flow.buckets.frames, reverse=True)
    states = {(cached.own_frames, cached.kept_frames): frames[0]}
    for shape in met:
        if 0 < shape.own_frames < cached.own_frames:
            key = (shape.own_frames, shape.kept_frames)
            states[key] = max(states.get(key, 0), shape.frames)
    shapes = [SolveShape(b, f, own, p, min(kept, own + f))
              for b in rows for (own, kept), most in states.items() for f in frames if f <= most
              for p in sorted(prompts)]
    fits = flow.solve_memory.fits if flow.solve_memory is not None else None
    return [shape for shape in shapes if shape.batch == 1 or fits is None or fits(shape)]


def reserve_graphs(flow: DiTFlow, batches: Iterable[int], hops: Sequence[int], voice: DiTSpeaker,
                   extra_first_hops: Sequence[int] = ()) -> None:
    """Size the graphs' shared buffers now for every graph a warm-up with `voice` will capture (the chunk
    pass's, `planned_solve_shapes` and `planned_encoder_history`, the first chunks of `extra_first_hops`,
    then `later_graph_shapes`), before it captures any: graphs captured on smaller buffers are otherwise
    captured again when a larger shape grows them (at 64 rows the kept cache grows from 30 to 100 to 200
    frames through the schedule; 35 of the encoder's 125 captures at an H100 restart, docs/benchmarks.md
    sixteenth session). Shapes past the buckets run eagerly and take no graph buffer."""
    batches, encoder = list(batches), flow.encoder_graphs
    reached = planned_encoder_history(flow, hops, voice.encoder.num_tokens)
    if isinstance(encoder, GraphedEncoder) and reached is not None:
        encoder.reserve(encoder_capture_shapes(flow, batches, reached))
    if isinstance(flow.graphs, GraphedSolver):
        planned = (planned_solve_shapes(flow, batches, hops, voice.prompt_frames)
                   + first_chunk_solve_shapes(flow, batches, extra_first_hops, voice.prompt_frames))
        graphed = graphed_shapes(flow, planned)
        if graphed:
            flow.graphs.reserve([*graphed, *_solve_capture_shapes(flow, batches, graphed)])


def start_compiling_blocks(flow: DiTFlow, batches: Iterable[int], hops: Sequence[int], prompt_frames: int,
                           workers: BlockCompileWorkers | None = None, extra_first_hops: Sequence[int] = (),
                           ) -> BlockCompileWorkers | None:
    """When the flow's block is kept ahead of time and its folder holds no variant yet (a cold start), start
    compiling the shape classes of `planned_solve_shapes(flow, batches, hops, prompt_frames)` (and of the
    first chunks of `extra_first_hops`: `first_chunk_solve_shapes`) in worker processes (block_compile.py):
    one per chunk of the schedule and attention layout (a chunk's batches of up to `ONE_CALL_MAX_ROWS` rows
    are a class of their own: two classes a worker would compile one after the other), or one per chunk where
    there are not enough workers (`workers` if given: idle ones spawned earlier, stopped when there is nothing
    for them or one has ended; else new ones, at most one per core). `wait()` on the result before the
    warm-up, which then loads the variants instead of compiling one class after the other. None when there is
    nothing to start."""
    estimator = flow.decoder.estimator
    block = estimator.kept_block if isinstance(estimator, DiT) else None
    jobs: list[BlockCompileJob] = []
    if block is not None and not block.variants:
        requires_grad = next(estimator.parameters()).requires_grad
        matmul = torch.backends.cuda.matmul.fp32_precision
        conv = torch.backends.cudnn.conv.fp32_precision  # type: ignore[attr-defined]
        limit = workers.count if workers is not None else len(os.sched_getaffinity(0))
        batches = list(batches)
        planned = (planned_solve_shapes(flow, batches, hops, prompt_frames)
                   + first_chunk_solve_shapes(flow, batches, extra_first_hops, prompt_frames))
        jobs = [BlockCompileJob(flow.cfg, flow.dtype, str(flow.device), block.folder, tuple(shapes),
                                flow.decoder.noise.shape[2], torch.get_num_threads(), matmul, conv,
                                requires_grad)
                for shapes in compile_job_shapes(planned, limit)]
    if workers is not None and not (jobs and len(jobs) <= workers.count == len(workers.running)):
        workers.stop()
        workers = None
    if not jobs:
        return None
    if workers is None:
        return BlockCompileWorkers.started(jobs)
    workers.run(jobs)
    return workers


def compile_job_shapes(per_chunk: Sequence[Sequence[SolveShape]], limit: int) -> list[list[SolveShape]]:
    """The compile workers' shape lists for `per_chunk` (`planned_solve_shapes`): each chunk's shapes split
    by attention layout (`one_call_attention`), in order, while that makes at most `limit` lists; else one
    list per chunk."""
    split = [[shape for shape in shapes if one_call_attention(shape.batch) == small]
             for shapes in per_chunk for small in (False, True)]
    lists = [shapes for shapes in split if shapes]
    return lists if len(lists) <= limit else [list(shapes) for shapes in per_chunk if shapes]
