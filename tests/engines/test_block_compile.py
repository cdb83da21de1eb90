"""The warm-up's solve shapes and encoder history planned ahead, and the DiT block's classes compiled in
worker processes (engines/token2wav/block_compile.py), on the CPU with the tiny models."""

from __future__ import annotations

import math
import re
from pathlib import Path

import pytest
import torch
from test_token2wav_batching import TRIMMING, PersistentEncoder, PersistentSolver, make_voice
from weights import randomize

from engines.config import PRE_LOOKAHEAD
from engines.precompiled import saved_variants, supported
from engines.token2wav.batching import Buckets, EncodeShape, SolveShape
from engines.token2wav.block_compile import BlockCompileJob, guarded_state
from engines.token2wav.flow_dit import DiTFlow, DiTSpeaker
from engines.token2wav.graphs import EncoderLayout
from engines.token2wav.warmup_shapes import (
    compile_job_shapes,
    encoder_capture_shapes,
    planned_encoder_history,
    planned_solve_shapes,
    reserve_graphs,
    start_compiling_blocks,
)

# Small buckets for the tiny models: frames of hops 5 / 8 / 12 and of the last chunk (the lookahead).
BUCKETS = Buckets(batch=(1, 2, 4), frames=(6, 10, 16, 24), prompt_frames=(32, 64), own_frames=(8, 16, 32),
                  history_tokens=(16, 32, 64))
HOPS = (5, 8, 12)


def seeded_flow() -> DiTFlow:
    flow = DiTFlow(TRIMMING).eval().requires_grad_(False)  # recent frames 10: the cache is trimmed
    randomize(flow, seed=0)
    return flow


def chunk_pass(flow: DiTFlow, speaker: DiTSpeaker, batches: tuple[int, ...]) -> list[list[SolveShape]]:
    """What `TorchToken2Wav.warmup`'s chunk pass solves: per chunk of the schedule, the shapes in order."""
    solver = PersistentSolver(flow)
    flow.use_bucketed_solver(solver, BUCKETS)
    tokens = torch.zeros(sum(HOPS) + PRE_LOOKAHEAD, dtype=torch.int64)
    per_chunk: list[list[SolveShape]] = [[] for _ in range(len(HOPS) + 1)]
    for batch in batches:
        streams = [flow.open_stream(speaker) for _ in range(batch)]
        start = 0
        for index, hop in enumerate((*HOPS, None)):
            piece, last = ((tokens[start : start + hop + PRE_LOOKAHEAD], False) if hop is not None
                           else (tokens[start:], True))
            solver.runs.clear()
            flow.chunks(streams, [piece] * batch, [last] * batch)
            for shape in solver.runs:
                if shape not in per_chunk[index]:
                    per_chunk[index].append(shape)
            start += hop or 0
    return per_chunk


def run_in_step(flow: DiTFlow, speaker: DiTSpeaker, batches: tuple[int, ...]) -> None:
    """The warm-up's chunk pass: at each batch size, that many streams through `HOPS`, then a last chunk."""
    tokens = torch.zeros(sum(HOPS) + PRE_LOOKAHEAD, dtype=torch.int64)
    for batch in batches:
        streams = [flow.open_stream(speaker) for _ in range(batch)]
        start = 0
        for hop in HOPS:
            flow.chunks(streams, [tokens[start : start + hop + PRE_LOOKAHEAD]] * batch, [False] * batch)
            start += hop
        flow.chunks(streams, [tokens[start:]] * batch, [True] * batch)


@pytest.mark.parametrize("capped", [False, True])
def test_planned_solve_shapes_are_those_the_chunk_pass_solves(capped: bool) -> None:
    """Planned from the cache rule alone, the same shapes, per chunk and in order, as streams run through
    the schedule in step; with a solve memory cap that splits the largest batch of long caches too."""
    flow = seeded_flow()
    speaker = flow.prepare_speaker(make_voice(1, 12))
    if capped:
        flow.limit_solve_memory(1)  # every batch of more than one row exceeds it: one row per solve
    batches = (4, 2, 1)
    solved = chunk_pass(flow, speaker, batches)
    planned = planned_solve_shapes(flow, batches, HOPS, speaker.prompt_frames)
    assert planned == solved
    assert any(shape.own_frames == 0 for shape in planned[0])  # first chunks, then cached ones
    assert all(shape.own_frames > 0 for shape in planned[1])
    if capped:
        assert all(shape.batch == 1 for shapes in planned for shape in shapes)


def test_planned_encoder_history_is_the_most_the_chunk_pass_encodes_at() -> None:
    """The history bucket the warm-up's encoder graphs are sized for before any capture is the largest the
    chunk pass meets (so no graph is captured again on grown buffers), from the buckets alone."""
    flow = seeded_flow()
    speaker = flow.prepare_speaker(make_voice(1, 12))
    encoder = PersistentEncoder(flow)
    flow.use_bucketed_solver(PersistentSolver(flow), BUCKETS, encoder)
    run_in_step(flow, speaker, (4, 2, 1))
    met = {shape.history for shape in encoder.runs}
    assert len(met) > 1  # the pass grows the history: sizing for its first shape would not do
    planned = planned_encoder_history(flow, HOPS, speaker.encoder.num_tokens)
    assert planned == max(met)
    # The shape the buffers are sized for holds every buffer of every shape the warm-up then captures.
    captures = encoder_capture_shapes(flow, (4, 2, 1), planned)
    layout = EncoderLayout(flow.cfg.encoder, flow.cfg.output_size, flow.dtype, flow.device)

    def sizes(shape: EncodeShape) -> dict[str, int]:
        numels: dict[str, int] = {}

        def record(name: str, size: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
            numels[name] = math.prod(size)
            return torch.empty(size, dtype=dtype)

        layout.inputs(shape, record)
        layout.outputs(shape, record)
        return numels

    # What `GraphedEncoder.reserve` sizes each buffer at: the most any capture views.
    reserved = {name: max(sizes(shape)[name] for shape in captures) for name in sizes(captures[0])}
    for shape in encoder.runs:
        assert all(reserved[name] >= numel for name, numel in sizes(shape).items()), shape


@pytest.mark.skipif(not supported(), reason="this torch has no ahead-of-time compile")
@pytest.mark.parametrize("requires_grad", [True, False])
def test_workers_compile_the_classes_the_warm_up_then_loads(
    tmp_path: Path, requires_grad: bool, caplog: pytest.LogCaptureFixture
) -> None:
    """Two of three worker processes spawned idle (each building the flow's DiT while it waits) are given
    the block's classes of the planned solves, compile them into the kept folder and report what they
    did, then exit by themselves; the flow's own block then serves every one of them from a loaded
    variant (compiling none), with the eager flow's first chunks."""
    import time

    from engines.token2wav.block_compile import BlockCompileJob, BlockCompileWorkers, BlockModel

    eager, kept = seeded_flow(), seeded_flow()
    for flow in (eager, kept):
        flow.requires_grad_(requires_grad)  # as loaded (True) or as the tests build flows (False)
    kept.decoder.estimator.compile_blocks(precompiled=tmp_path)
    block = kept.decoder.estimator.kept_block
    assert block is not None and block.variants == 0
    speaker = kept.prepare_speaker(make_voice(1, 12))
    kept.use_bucketed_solver(None, BUCKETS)
    planned = planned_solve_shapes(kept, (2,), HOPS[:2], speaker.prompt_frames)[:2]  # first, second chunks
    matmul = torch.backends.cuda.matmul.fp32_precision
    conv = torch.backends.cudnn.conv.fp32_precision  # type: ignore[attr-defined]
    jobs = [BlockCompileJob(kept.cfg, kept.dtype, "cpu", block.folder, tuple(shapes),
                            kept.decoder.noise.shape[2], torch.get_num_threads(), matmul, conv, requires_grad)
            for shapes in planned]
    # Spawned idle, as a cold start does before it loads.
    workers = BlockCompileWorkers(len(jobs) + 1, preload=BlockModel(kept.cfg, kept.dtype, "cpu"))
    with caplog.at_level("INFO", logger="engines.token2wav.block_compile"):
        workers.run(jobs)  # the spare worker gets none and ends
        assert workers.wait() == len(jobs)
    deadline = time.monotonic() + 60
    while workers.running and time.monotonic() < deadline:
        time.sleep(0.1)
    assert workers.exit_codes == [0] * (len(jobs) + 1)
    # "built ahead": the workers ran their jobs on the DiT they built while waiting.
    report = (r"(dit-block-compile-\d): idle [\d.]+ s after its spawn, ready [\d.]+ s after its job \(model "
              r"built ahead\), then (\d+) shapes in [\d.]+ s; classes compiled at (.*) \((\d+) of them saved "
              r"by another worker first\)")
    reports = [re.fullmatch(report, record.getMessage()) for record in caplog.records]
    done = sorted((match[1], int(match[2]), match[3], int(match[4])) for match in reports if match)
    assert [(name, shapes) for name, shapes, *_ in done] == [
        (f"dit-block-compile-{index}", len(shapes)) for index, shapes in enumerate(planned)]
    # The two jobs' shapes are two classes (own cache empty, then not): each compiled at its job's first
    # shape, by its worker alone, and saved.
    assert [(at, superseded) for *_, at, superseded in done] == [
        (f"({shapes[0].batch}, {shapes[0].frames}, own {shapes[0].own_frames})", 0) for shapes in planned]
    assert len(saved_variants(block.folder)) == 2
    # They compiled under this thread's guarded state (else the loads below would compile again).
    assert not [r for r in caplog.records if "another global state" in r.getMessage()]
    outputs = []
    for flow in (eager, kept):
        flow.use_bucketed_solver(PersistentSolver(flow), BUCKETS)  # the planned (bucketed) shapes
        voice = flow.prepare_speaker(make_voice(1, 12))
        streams = [flow.open_stream(voice) for _ in range(2)]
        tokens = torch.randint(0, TRIMMING.vocab_size, (HOPS[0] + PRE_LOOKAHEAD,),
                               generator=torch.Generator().manual_seed(4))
        with torch.inference_mode():
            first = flow.chunks(streams, [tokens, tokens], [False, False])
            second = flow.chunks(streams, [tokens[: HOPS[1] + PRE_LOOKAHEAD]] * 2, [False, False])
        outputs.append([*first, *second])
    assert block.compiled == 0 and block.variants >= 2
    for got, want in zip(outputs[1], outputs[0], strict=True):
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


def test_the_guarded_state_is_what_dynamo_guards_on() -> None:
    """A change of a setting the variants' global state guard checks shows in `guarded_state`."""
    before = dict(guarded_state())
    threads = torch.get_num_threads()
    torch.set_num_threads(threads + 1)
    try:
        after = dict(guarded_state())
    finally:
        torch.set_num_threads(threads)
    assert {name for name in before if before[name] != after[name]} == {"num_threads"}
    assert dict(guarded_state()) == before
    # Dynamo's own guard agrees: set under one state, it refuses the other.
    guard = torch._C._dynamo.guards.GlobalStateGuard()
    torch.set_num_threads(threads + 1)
    try:
        assert not guard.check()
    finally:
        torch.set_num_threads(threads)
    assert guard.check()


def test_a_failed_or_stuck_worker_is_logged_and_the_start_goes_on(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A worker that fails (here: its block keeps variants elsewhere than the job says) fails alone; one
    still running at the timeout is stopped; either way the call returns, and the warm-up then compiles
    what is missing."""
    from engines.token2wav.block_compile import BlockCompileJob, BlockCompileWorkers

    flow = seeded_flow()
    shapes = (SolveShape(2, 10, 0, 32, 10),)
    job = BlockCompileJob(flow.cfg, flow.dtype, "cpu", tmp_path / "elsewhere", shapes,
                          flow.decoder.noise.shape[2], 1, "none", "tf32", False)
    with caplog.at_level("WARNING", logger="engines.token2wav.block_compile"):
        assert BlockCompileWorkers.started([job]).wait() == 0
        assert BlockCompileWorkers.started([job, job], timeout_s=0.0).wait() == 0
    messages = [record.getMessage() for record in caplog.records]
    assert any("failed (exit code 1)" in message for message in messages)
    assert sum("stopped" in message for message in messages) == 2


# A parent that starts one worker on a long job (every frames bucket at four batch sizes, compiled on the
# CPU), prints the worker's pid, then waits to be killed.
PARENT = """
import sys, time, torch
from pathlib import Path
import test_block_compile as t
from engines.token2wav.batching import SolveShape
from engines.token2wav.block_compile import BlockCompileJob, BlockCompileWorkers
flow = t.seeded_flow()
flow.decoder.estimator.compile_blocks(precompiled=Path(sys.argv[1]))
block = flow.decoder.estimator.kept_block
shapes = tuple(SolveShape(b, f, own, 32, min(own + f, 32)) for b in (4, 3, 2, 1) for f in (6, 10, 16, 24)
               for own in (0, 8, 16))
job = BlockCompileJob(flow.cfg, flow.dtype, "cpu", block.folder, shapes,
                      flow.decoder.noise.shape[2], 1, "none", "tf32", False)
workers = BlockCompileWorkers.started([job])
print(workers.running[0], flush=True)
time.sleep(600)
"""


def test_a_worker_ends_when_its_parent_is_killed(tmp_path: Path) -> None:
    """A parent killed outright (SIGKILL: no exit handler runs) leaves no compile worker behind: the
    worker notices it was handed to another parent and exits."""
    import os
    import signal
    import subprocess
    import sys
    import time

    root = Path(__file__).resolve().parents[2]
    path = os.pathsep.join(str(p) for p in (root, root / "tests" / "engines", root / "tests"))
    parent = subprocess.Popen([sys.executable, "-c", PARENT, str(tmp_path)], cwd=root, stdout=subprocess.PIPE,
                              text=True, env={**os.environ, "PYTHONPATH": path})
    try:
        assert parent.stdout is not None
        worker = int(parent.stdout.readline())
        os.kill(worker, 0)  # running
    finally:
        parent.send_signal(signal.SIGKILL)
        parent.wait()
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            state = Path(f"/proc/{worker}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except FileNotFoundError:
            return
        if state == "Z":  # exited, not yet reaped by its new parent
            return
        time.sleep(0.2)
    pytest.fail(f"compile worker {worker} still running 30 s after its parent was killed")


@pytest.mark.skipif(not supported(), reason="this torch has no ahead-of-time compile")
def test_jobs_carry_the_parents_state_and_a_restart_starts_none(tmp_path: Path,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """What the workers' guards must match comes from the flow that starts them (its thread count, its
    parameters' `requires_grad`, the float32 precisions, its block's folder), one picklable job per chunk
    of the plan, run by idle workers spawned earlier if all of them still wait (else by fresh ones); once
    the folder holds a variant (a restart) nothing is started and idle workers are stopped."""
    import pickle

    import engines.token2wav.warmup_shapes as warmup_shapes

    started: list[list[BlockCompileJob]] = []

    class Recorded:  # stands for the processes: only the jobs are looked at here
        @classmethod
        def started(cls, jobs: list[BlockCompileJob]) -> Recorded:
            started.append(jobs)
            return cls()

    monkeypatch.setattr(warmup_shapes, "BlockCompileWorkers", Recorded)
    flow = seeded_flow().requires_grad_(True)  # as a loaded flow
    flow.use_bucketed_solver(None, BUCKETS)
    flow.decoder.estimator.compile_blocks(precompiled=tmp_path)
    block = flow.decoder.estimator.kept_block
    assert block is not None
    speaker = flow.prepare_speaker(make_voice(1, 12))
    assert start_compiling_blocks(flow, (2, 1), HOPS, speaker.prompt_frames) is not None
    (jobs,) = started
    planned = planned_solve_shapes(flow, (2, 1), HOPS, speaker.prompt_frames)
    # The tiny buckets' batches (2 and 1 streams) are all of the one-call attention layout: one job per chunk.
    assert [job.shapes for job in jobs] == [tuple(shapes) for shapes in planned]
    for job in jobs:
        assert (job.threads, job.requires_grad, job.folder, job.dtype) == (
            torch.get_num_threads(), True, block.folder, flow.dtype)
        assert job.matmul_precision == torch.backends.cuda.matmul.fp32_precision
        assert pickle.loads(pickle.dumps(job)) == job
    chunks = len(planned)
    idle = IdleWorkers(chunks, running=chunks)  # spawned early, all still waiting: they take the jobs
    assert start_compiling_blocks(flow, (2, 1), HOPS, speaker.prompt_frames, idle) is idle  # type: ignore[arg-type]
    assert idle.calls == [f"run {chunks}"] and len(started) == 1
    ended = IdleWorkers(chunks, running=chunks - 1)  # one gave up waiting: fresh ones take the jobs
    assert isinstance(start_compiling_blocks(flow, (2, 1), HOPS, speaker.prompt_frames, ended),  # type: ignore[arg-type]
                      Recorded)
    assert ended.calls == ["stop"] and len(started) == 2
    stream = flow.open_stream(speaker)  # one chunk compiles (and keeps) a class: no longer a cold start
    with torch.inference_mode():
        flow.chunks([stream], [torch.zeros(HOPS[0] + PRE_LOOKAHEAD, dtype=torch.int64)], [False])
    assert block.variants >= 1
    spare = IdleWorkers(chunks, running=chunks)
    assert start_compiling_blocks(flow, (2, 1), HOPS, speaker.prompt_frames, spare) is None  # type: ignore[arg-type]
    assert spare.calls == ["stop"] and len(started) == 2


def test_a_chunks_shapes_split_by_attention_layout_while_there_are_workers_for_them() -> None:
    """Each chunk's planned shapes go to two workers, the batches above the one-call attention layout's
    rows and those within it (two shape classes a single worker would compile one after the other), in
    their planned order; where that makes more lists than workers, one list per chunk."""
    from engines.token2wav.dit import ONE_CALL_MAX_ROWS

    small = ONE_CALL_MAX_ROWS // 2  # streams
    first = [SolveShape(batch, 30, 0, 256, 30) for batch in (64, 32, small, 1)]
    second = [SolveShape(batch, 50, 32, 256, 82) for batch in (64, small)]
    last = [SolveShape(small, 16, 200, 256, 200)]
    assert compile_job_shapes([first, second, last], limit=5) == [
        first[:2], first[2:], second[:1], second[1:], last]
    assert compile_job_shapes([first, second, last], limit=4) == [first, second, last]
    assert compile_job_shapes([first, [], last], limit=2) == [first, last]


class IdleWorkers:
    """Stands for idle compile workers spawned early: records what the flow asks of them."""

    def __init__(self, count: int, running: int) -> None:
        self.count, self.running = count, list(range(running))
        self.calls: list[str] = []

    def run(self, jobs: list[BlockCompileJob]) -> None:
        self.calls.append(f"run {len(jobs)}")

    def stop(self) -> None:
        self.calls.append("stop")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.skipif(not supported(), reason="this torch has no ahead-of-time compile")
def test_on_cuda_the_workers_compile_every_class_of_the_chunk_pass(tmp_path: Path) -> None:
    """As the service runs it: idle workers spawned for a cold start before the flow loads from its
    checkpoint in half precision (parameters as loaded) with CUDA graphs over a kept block; the workers
    compile the planned chunk pass's classes, and the chunk pass itself (first calls in the graphs'
    warm-up runs, on the buffers the warm-up reserves) then compiles none; the next start spawns no
    workers."""
    from engines.token2wav.block_compile import idle_workers_for_cold_start
    from engines.token2wav.flow_dit import load_dit_flow

    checkpoint, kept = tmp_path / "flow.pt", tmp_path / "kept"
    torch.save(seeded_flow().state_dict(), checkpoint)
    cuda = torch.device("cuda")
    idle = idle_workers_for_cold_start(kept, TRIMMING, torch.float16, cuda, len(HOPS) + 1)
    assert idle is not None
    flow = load_dit_flow(checkpoint, TRIMMING, "cuda", torch.float16)
    flow.enable_cuda_graphs(BUCKETS, precompiled=kept)
    block = flow.decoder.estimator.kept_block
    assert block is not None and block.variants == 0
    speaker = flow.prepare_speaker(make_voice(1, 12))
    batches = (4, 2, 1)
    workers = start_compiling_blocks(flow, batches, HOPS, speaker.prompt_frames, idle)
    assert workers is idle and workers.wait() == len(HOPS) + 1
    assert block.variants == 0  # saved by the workers; the flow's block loads them when it meets them
    # As TorchToken2Wav.warmup: the graphs' buffers sized first (outside inference mode).
    reserve_graphs(flow, batches, HOPS, speaker)
    run_in_step(flow, speaker, batches)
    assert block.compiled == 0 and block.variants > 0
    assert idle_workers_for_cold_start(kept, TRIMMING, torch.float16, cuda, len(HOPS) + 1) is None


def test_idle_workers_end_when_stopped_or_given_no_job_in_time(caplog: pytest.LogCaptureFixture) -> None:
    """Workers spawned for a cold start that then has nothing for them end by themselves: on the closed
    pipe of `stop`, or once no job came within their idle timeout. A job handed to a worker that has
    ended that way is not counted as compiled, and `wait` says so."""
    import time

    from engines.token2wav.block_compile import BlockCompileWorkers

    stopped = BlockCompileWorkers(2)
    stopped.stop(grace_s=120)  # time enough to finish importing and see the pipe closed
    assert stopped.exit_codes == [0, 0]
    late = BlockCompileWorkers(1, idle_timeout_s=0.5)
    deadline = time.monotonic() + 120
    while late.running and time.monotonic() < deadline:
        time.sleep(0.2)
    assert late.exit_codes == [0]
    flow = seeded_flow()
    job = BlockCompileJob(flow.cfg, flow.dtype, "cpu", Path("unused"), (SolveShape(2, 10, 0, 32, 10),),
                          flow.decoder.noise.shape[2], 1, "none", "tf32", False)
    late.run([job])
    with caplog.at_level("WARNING", logger="engines.token2wav.block_compile"):
        assert late.wait() == 0
    assert any("ended before its job came" in record.getMessage() for record in caplog.records)
