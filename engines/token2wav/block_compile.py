"""The DiT block's shape classes compiled side by side in worker processes, before the warm-up meets them.

On a cold start the token2wav warm-up compiles the block once per shape class as it first meets each
(`DiT.compile_blocks`): six classes of ~12 s each on an H100 host, one after the other, ~76 s of a
163 s start (docs/benchmarks.md, sixteenth session). Compiling is host work (Dynamo's trace, Inductor's
lowering, Triton's builds), single-threaded per class and held by the GIL, so threads cannot share it;
processes can. `BlockCompileWorkers` spawns the processes idle, early in a cold start (as the token2wav
load begins, before this process imports Dynamo: `idle_workers_for_cold_start`); each imports the
compiler and builds a DiT of the flow's sizes and dtype on the device while it waits (random weights:
compiled code does not depend on their values). Once the voice is known each gets a list of solve
shapes, runs one Euler step of each through the block kept ahead of time (`engines/precompiled.py`),
and so saves a variant per class it meets into the folder the warm-up's block reads. The warm-up then
loads the variants instead of compiling them (on an H100 host: 12 workers done ~33–36 s after their
jobs, docs/benchmarks.md nineteenth session).

Each list is one chunk of the warm-up's schedule and attention layout at every batch size, largest
first, as the warm-up runs them (`warmup_shapes.compile_job_shapes`): a class is compiled at the shapes the
warm-up would have compiled it at (Inductor picks its kernels' configurations by the first shapes), and
a worker that meets a class another has saved meanwhile loads it instead. A worker that fails is
logged; the warm-up compiles what is missing, as without workers.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import multiprocessing
import multiprocessing.queues
import multiprocessing.util
import os
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from multiprocessing.connection import Connection
from pathlib import Path

import torch

from engines.config import FlowConfig
from engines.precompiled import likely_supported, saved_variants
from engines.token2wav.batching import SolveShape
from engines.token2wav.cfm import ConditionalCFM
from engines.token2wav.dit import DiT, block_folder
from engines.token2wav.graphs import SolverLayout

logger = logging.getLogger(__name__)

# A worker still compiling this long after its job came is stopped: ~12–17 s per class on an H100 host,
# a few classes per worker.
WORKERS_TIMEOUT_S = 600.0
# An idle worker given no job for this long ends (a start that never warmed up); `stop`, its parent's exit
# or death end it sooner. Above the slowest start measured (~235 s cold), so that a job is not lost.
IDLE_TIMEOUT_S = 1800.0
# How often `wait` looks for reports and ended workers, and how long a worker that reported gets to exit.
WAIT_POLL_S = 0.05
EXIT_GRACE_S = 60.0


@dataclass(frozen=True)
class BlockCompileJob:
    """What one worker compiles, and the parent's state the compiled variants' guards check or the
    compiler reads (the thread count, the parameters' `requires_grad`, the float32 precisions)."""

    cfg: FlowConfig
    dtype: torch.dtype
    device: str
    folder: Path  # the block's variant folder, as the parent computed it (in the `precompiled` root)
    shapes: tuple[SolveShape, ...]
    noise_frames: int  # the CFM's noise buffer
    threads: int
    matmul_precision: str
    conv_precision: str
    requires_grad: bool  # the parent's parameters' flag (guards check it; a loaded flow keeps True)
    compile_threads: int = 1  # Inductor's kernel-compiling subprocesses: the host's cores shared out


def guarded_state() -> tuple[tuple[str, str], ...]:
    """This thread's global state that compiled variants guard on, as Dynamo's global state guard reads
    it (thread count, TF32, reduced-precision reductions, autocast, determinism, default dtype, torch
    function mode; not the autograd mode: both sides call under inference mode): a worker reports the
    state it compiled under, and the warm-up compares its own (a variant compiled under another state
    does not serve, and the warm-up compiles that class again). From the guard's own record where this
    torch exposes it (a private API), else from the public settings."""
    try:
        state = json.loads(str(torch._C._dynamo.guards.GlobalStateGuard().__getstate__()))
    except Exception:  # another torch: the public settings the guard reads
        matmul = torch.backends.cuda.matmul
        state = {"num_threads": torch.get_num_threads(), "allow_tf32": matmul.fp32_precision == "tf32",
                 "allow_fp16_reduce": matmul.allow_fp16_reduced_precision_reduction,
                 "allow_bf16_reduce": matmul.allow_bf16_reduced_precision_reduction,
                 "deterministic_algorithms": torch.are_deterministic_algorithms_enabled(),
                 "default_dtype": str(torch.get_default_dtype()),
                 "torch_function": torch._C._is_torch_function_enabled()}
    state.pop("grad_mode", None)
    return tuple(sorted((name, json.dumps(value, sort_keys=True)) for name, value in state.items()))


@dataclass(frozen=True)
class WorkerReport:
    """What a worker did, for the parent's log: seconds from its spawn to idle (a spawned Python and its
    imports), from its job to its first shape (the model built on the device, unless `built_ahead`
    while it waited), the seconds its shapes took, and the shapes at which it compiled a class (the
    others' classes it loaded from another worker's variants or had compiled already); `superseded` of
    those another worker saved first."""

    name: str
    idle_s: float
    ready_s: float
    built_ahead: bool
    shapes: int
    shapes_s: float
    compiled_at: tuple[SolveShape, ...]
    superseded: int
    state: tuple[tuple[str, str], ...]  # `guarded_state` as it compiled


@dataclass(frozen=True)
class BlockModel:
    """The model a worker compiles the block of: known before the shapes are (from the models' manifest),
    so an idle worker builds it on the device while the parent loads (`BlockCompileWorkers(preload=)`)."""

    cfg: FlowConfig
    dtype: torch.dtype
    device: str

    def build(self) -> DiT:
        """The DiT, random weights (compiled code does not depend on their values), on the device, with
        the device's context and first kernels set up (the bulk of a worker's set-up on a GPU host)."""
        device = torch.device(self.device)
        if device.type == "cuda":
            torch.cuda.set_device(device)  # Triton and the autotuner use the current device
        with device:
            dit = DiT(self.cfg.dit).to(self.dtype).eval()
        if device.type == "cuda":
            with torch.inference_mode():  # cuBLAS's handle and workspace
                dit.t_embedder(torch.zeros(1, device=device))
            torch.cuda.synchronize(device)
        return dit


def compile_block_classes(
    job: BlockCompileJob, built: DiT | None = None
) -> tuple[float, float, tuple[SolveShape, ...], int, tuple[tuple[str, str], ...]]:
    """A worker's part: run one Euler step of each of `job.shapes` through the kept block (so compiling
    and saving every class they meet that no variant in the folder serves yet), on `built` (the job's
    model, built while idle) or on one built here. Returns the seconds to the first shape, the seconds
    of the shapes, the shapes at which a class was compiled, how many of those another process had
    saved meanwhile, and the `guarded_state` they were compiled under."""
    import torch._inductor.config as inductor_config  # Dynamo and Inductor: imported by the worker only

    called = time.perf_counter()
    dit = built if built is not None else BlockModel(job.cfg, job.dtype, job.device).build()
    device = torch.device(job.device)
    torch.set_num_threads(job.threads)
    inductor_config.compile_threads = job.compile_threads
    torch.backends.cuda.matmul.fp32_precision = job.matmul_precision
    torch.backends.cudnn.conv.fp32_precision = job.conv_precision  # type: ignore[attr-defined]
    cfm = ConditionalCFM(dit, job.cfg.n_timesteps, job.cfg.cfg_rate, job.noise_frames)
    cfm.to(device, job.dtype).requires_grad_(job.requires_grad)
    dit.compile_blocks(precompiled=job.folder.parent)
    block = dit.kept_block
    if block is None or block.folder != job.folder:
        raise RuntimeError(f"the worker's block keeps its variants elsewhere than {job.folder}")
    # One step's caches: the warm-up's block sees the same shapes (one step of the solve's buffers).
    layout = dataclasses.replace(SolverLayout.of(job.cfg, job.dtype, device), steps=1)

    def zeros(name: str, size: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        return torch.zeros(size, dtype=dtype, device=device)

    ready = time.perf_counter()
    compiled_at = []
    state = guarded_state()
    with torch.inference_mode():
        conditioning = cfm.step_conditioning()
        for shape in job.shapes:
            inputs, outputs = layout.inputs(shape, zeros), layout.outputs(shape, zeros)
            inputs.lengths.fill_(1)  # valid rows: one real frame each, as a graph's warm-up run
            inputs.mask.fill_(True)
            compiled = block.compiled
            cfm.solve_ragged(inputs, outputs, conditioning, steps=1)
            if block.failed:  # nothing is kept from here on: say so rather than compile for nothing
                raise RuntimeError("the ahead-of-time compile failed (logged above)")
            if block.compiled > compiled:
                compiled_at.append(shape)
    return ready - called, time.perf_counter() - ready, tuple(compiled_at), block.superseded, state


def _serve(parent: int, jobs: Connection, reports: multiprocessing.queues.SimpleQueue[WorkerReport],
           spawned: float, idle_timeout_s: float, preload: BlockModel | None) -> None:
    """A worker process: import what compiling needs and build `preload`'s model if given, wait up to
    `idle_timeout_s` for a job (None or a closed pipe: nothing to do), run it and report. It does not
    outlive `parent`, the process that spawned it at `spawned`."""
    _exit_with_parent(parent)
    if sys.pycache_prefix is not None:
        # A bytecode cache folder of the service's (realtime/bytecode.py): write into it for the parent
        # and the siblings, which spawn's `-B` (given when the parent started without writing) forbids.
        sys.dont_write_bytecode = False
    import torch._inductor.compile_fx  # noqa: F401  (the compile's own imports, done while idle)

    built = None
    if preload is not None:
        try:
            built = (preload, preload.build())
        except Exception:  # no device memory left, say: the job builds its own (and fails if it must)
            logger.exception("%s: the model could not be built ahead of its job",
                             multiprocessing.current_process().name)
    idle = time.time()
    try:
        job: BlockCompileJob | None = jobs.recv() if jobs.poll(idle_timeout_s) else None
    except EOFError:
        job = None
    if job is None:
        return
    name = multiprocessing.current_process().name
    if built is not None and built[0] != BlockModel(job.cfg, job.dtype, job.device):
        logger.warning("%s: the model built ahead (%s) is not the job's (%s); building the job's", name,
                       built[0].device, job.device)
        built = None
    ready_s, shapes_s, compiled_at, superseded, state = compile_block_classes(
        job, None if built is None else built[1])
    reports.put(WorkerReport(name, idle - spawned, ready_s, built is not None, len(job.shapes), shapes_s,
                             compiled_at, superseded, state))


def idle_workers_for_cold_start(root: Path | None, cfg: FlowConfig, dtype: torch.dtype, device: torch.device,
                                count: int, preload: bool = True) -> BlockCompileWorkers | None:
    """`count` idle workers, each building a DiT of `cfg` in `dtype` on CUDA `device` while it waits if
    `preload`, when that DiT keeps its block under `root` and the block's folder holds no variant yet (a
    cold start); None otherwise (a restart, no ahead-of-time compile in this torch) or when the
    processes could not start (logged: the warm-up then compiles alone). Cheap to call before Dynamo is
    imported."""
    if root is None or device.type != "cuda" or not likely_supported():
        return None
    folder = block_folder(root, cfg.dit, dtype, device)
    if folder is None or saved_variants(folder):
        return None
    if device.index is None:  # named as the jobs will name it (the flow's parameters' device)
        device = torch.device("cuda", torch.cuda.current_device())
    try:
        return BlockCompileWorkers(count, preload=BlockModel(cfg, dtype, str(device)) if preload else None)
    except Exception as exc:  # no processes on this host, say
        logger.warning("DiT block compile workers not started (%s: %s); the warm-up compiles alone",
                       type(exc).__name__, exc)
        return None


def _exit_with_parent(parent: int, poll_s: float = 1.0) -> None:
    """End this worker once its parent `parent` is gone (killed before it could stop its workers): a
    thread watches for the process being handed to another parent (maybe while it was importing)."""

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(poll_s)
        os._exit(1)

    threading.Thread(target=watch, name="parent-watch", daemon=True).start()


class BlockCompileWorkers:
    """`count` worker processes, spawned at once (CUDA does not survive a fork) and idle: each imports
    what compiling needs, builds `preload`'s model if given (on its device: the context, the first
    kernels) and waits for its job. So a start can spawn them before it loads its models (a worker took
    24–26 s to get going beside five others on an H100 host, docs/benchmarks.md seventeenth session)
    and hand them their jobs (`run`) once it knows the shapes. `wait` returns once each has reported; they
    exit by themselves then. A parent that exits first stops them; a worker given no job within
    `idle_timeout_s` ends, as does one whose parent is gone."""

    def __init__(self, count: int, timeout_s: float = WORKERS_TIMEOUT_S,
                 idle_timeout_s: float = IDLE_TIMEOUT_S, preload: BlockModel | None = None) -> None:
        if count < 1:
            raise ValueError(f"{count} compile workers")
        self.timeout_s = timeout_s
        self.folder: Path | None = None  # the jobs' folder, once they run
        self._ran = time.perf_counter()  # when the jobs were handed out (`run`)
        self._busy: list[bool] = [False] * count  # which workers were given a job
        context = multiprocessing.get_context("spawn")
        self._reports: multiprocessing.queues.SimpleQueue[WorkerReport] = context.SimpleQueue()
        pipes = [context.Pipe(duplex=False) for _ in range(count)]
        self._jobs = [sender for _, sender in pipes]
        spawned = time.time()
        # Not daemonic: Inductor starts processes of its own to compile kernels.
        self._workers = [context.Process(target=_serve, name=f"dit-block-compile-{index}",
                                         args=(os.getpid(), receiver, self._reports, spawned, idle_timeout_s,
                                               preload))
                         for index, (receiver, _) in enumerate(pipes)]
        # Stopped at interpreter exit, before multiprocessing joins its children (a start that failed
        # meanwhile), and if one of them cannot start.
        multiprocessing.util.Finalize(self, _stop, args=(self._workers,), exitpriority=10)
        try:
            for worker in self._workers:
                worker.start()
        except BaseException:
            _stop(self._workers)
            raise
        finally:
            for receiver, _ in pipes:
                receiver.close()  # the workers' ends: a worker gone then shows as a broken pipe

    @property
    def count(self) -> int:
        return len(self._workers)

    @property
    def running(self) -> list[int]:
        """The process ids of the workers still running."""
        return [worker.pid for worker in self._workers if worker.pid is not None and worker.is_alive()]

    @property
    def exit_codes(self) -> list[int | None]:
        """Each worker's exit code (None: still running)."""
        return [worker.exitcode for worker in self._workers]

    @classmethod
    def started(cls, jobs: Sequence[BlockCompileJob],
                timeout_s: float = WORKERS_TIMEOUT_S) -> BlockCompileWorkers:
        """One worker per job, spawned and handed its job."""
        workers = cls(len(jobs), timeout_s)
        workers.run(jobs)
        return workers

    def run(self, jobs: Sequence[BlockCompileJob]) -> None:
        """Hand out `jobs`, one per worker (at most as many as there are); the others end. Once only. A
        worker that ended before it got its job (see `running`) compiles nothing: `wait` says so."""
        if not jobs or len(jobs) > len(self._workers):
            raise ValueError(f"{len(jobs)} jobs for {len(self._workers)} compile workers")
        if self.folder is not None:
            raise RuntimeError("the compile workers have their jobs already")
        self.folder = jobs[0].folder
        self._ran = time.perf_counter()
        share = max(1, len(os.sched_getaffinity(0)) // len(jobs))
        for index, sender in enumerate(self._jobs):
            job = dataclasses.replace(jobs[index], compile_threads=share) if index < len(jobs) else None
            self._busy[index] = job is not None
            with contextlib.suppress(OSError):  # the worker is gone: `wait` counts it out
                sender.send(job)
            sender.close()

    def _reap(self, reported: set[str], grace_s: float = EXIT_GRACE_S) -> None:
        """Join the workers as they exit; stop those still there after `grace_s`; log any of `reported`
        (their names) that exited with an error after its report."""
        deadline = time.perf_counter() + grace_s
        for worker in self._workers:
            if worker.pid is not None:
                worker.join(max(0.0, deadline - time.perf_counter()))
        _stop(self._workers)
        failed = [f"{worker.name} ({worker.exitcode})" for worker in self._workers
                  if worker.name in reported and worker.exitcode not in (0, None)]
        if failed:
            logger.info("compile workers that ended with an error after reporting: %s", ", ".join(failed))

    def stop(self, grace_s: float = 2.0) -> None:
        """End the workers without jobs for them (nothing to compile after all): an idle one ends by itself
        on the closed pipe; those still there after `grace_s` (importing, say) are stopped."""
        for sender in self._jobs:
            sender.close()
        deadline = time.perf_counter() + grace_s
        for worker in self._workers:
            if worker.pid is not None:
                worker.join(max(0.0, deadline - time.perf_counter()))
        _stop(self._workers)

    def wait(self) -> int:
        """Wait until each worker given a job has reported, or ended without (failed, stopped, or gone
        before its job came: logged; the warm-up compiles what it did not), until `timeout_s` after `run`;
        stop any still running then. A worker that reported exits by itself (tearing down its device
        context and Inductor's processes takes seconds the start need not wait for): reaped in the
        background. Returns how many compiled their job to the end; 0 (the workers stopped) before `run`."""
        if self.folder is None:
            self.stop()
            return 0
        deadline = self._ran + self.timeout_s
        pending = {worker.name: worker
                   for worker, busy in zip(self._workers, self._busy, strict=True) if busy}
        reports: dict[str, WorkerReport] = {}
        while pending:
            while not self._reports.empty():  # each put before its worker returns
                report = self._reports.get()
                reports[report.name] = report
                pending.pop(report.name, None)
            for name, worker in list(pending.items()):
                if worker.exitcode is not None and self._reports.empty():  # ended with no report
                    del pending[name]
                    if worker.exitcode != 0:
                        logger.warning("%s failed (exit code %s); the warm-up compiles what it did not",
                                       name, worker.exitcode)
                    else:
                        logger.warning("%s ended before its job came; the warm-up compiles what it did not",
                                       name)
            if pending and time.perf_counter() >= deadline:
                stuck = [worker for worker in pending.values() if worker.exitcode is None]
                _stop(stuck)
                for worker in stuck:
                    logger.warning("%s still compiling %.0f s after its job came: stopped (the warm-up "
                                   "compiles what it did not)", worker.name, self.timeout_s)
                    del pending[worker.name]
                deadline = float("inf")  # the others have ended: one more look for their reports
                continue
            if pending:
                time.sleep(WAIT_POLL_S)
        # Bound to `self`: its finaliser (which stops whatever still runs) waits until the exits are in.
        threading.Thread(target=self._reap, args=(set(reports),), name="compile-workers-reap",
                         daemon=True).start()
        logger.info("DiT block: %d of %d compile workers done %.1f s after their jobs came; %d variants "
                    "in %s", len(reports), sum(self._busy), time.perf_counter() - self._ran,
                    len(saved_variants(self.folder)), self.folder.name)
        here = dict(guarded_state())
        for report in reports.values():
            differs = {name: f"{value} there, {here.get(name)} here" for name, value in report.state
                       if here.get(name) != value}
            if differs:
                logger.warning("%s compiled under another global state than this thread's (%s): its "
                               "variants will not serve here", report.name, differs)
            logger.info("%s: idle %.1f s after its spawn, ready %.1f s after its job (model built %s), "
                        "then %d shapes in %.1f s; classes compiled at %s (%d of them saved by another "
                        "worker first)", report.name, report.idle_s, report.ready_s,
                        "ahead" if report.built_ahead else "then", report.shapes, report.shapes_s,
                        _shapes(report.compiled_at), report.superseded)
        return len(reports)


def _shapes(shapes: Sequence[SolveShape]) -> str:
    """`(rows, frames, own cache frames)` of each shape, or "none"."""
    return ", ".join(f"({shape.batch}, {shape.frames}, own {shape.own_frames})" for shape in shapes) or "none"


def _stop(workers: Sequence[multiprocessing.process.BaseProcess], grace_s: float = 10.0) -> None:
    """Terminate the started workers still running; kill those still there after `grace_s`."""
    running = [worker for worker in workers if worker.pid is not None and worker.is_alive()]
    for worker in running:
        worker.terminate()
    deadline = time.perf_counter() + grace_s
    for worker in running:
        worker.join(max(0.0, deadline - time.perf_counter()))
        if worker.is_alive():
            worker.kill()
            worker.join()

