"""The DiT block's shape classes compiled side by side in worker processes, before the warm-up meets them.

On a cold start the token2wav warm-up compiles the block once per shape class as it first meets each
(`DiT.compile_blocks`): six classes of ~12 s each on an H100 host, one after the other, ~76 s of a
163 s start (docs/benchmarks.md, sixteenth session). Compiling is host work (Dynamo's trace, Inductor's
lowering, Triton's builds), single-threaded per class and held by the GIL, so threads cannot share it;
processes can. `BlockCompileWorkers` starts one process per list of solve shapes: each builds the flow's
CFM with the same sizes and dtype (random weights: compiled code does not depend on their values), runs
one Euler step of each of its shapes through the block kept ahead of time (`engines/precompiled.py`), and
so saves a variant per class it meets into the folder the warm-up's block reads. The warm-up then loads
the variants instead of compiling them.

Each list is one chunk of the warm-up's schedule at every batch size, largest first, as the warm-up
runs them: a class is compiled at the shapes the warm-up would have compiled it at (Inductor picks its
kernels' configurations by the first shapes), and a worker that meets a class another has saved
meanwhile loads it instead. A worker that fails is logged; the warm-up compiles what is missing, as
without workers.
"""

from __future__ import annotations

import dataclasses
import logging
import multiprocessing
import multiprocessing.queues
import multiprocessing.util
import os
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
import torch._inductor.config as inductor_config

from engines.config import FlowConfig
from engines.precompiled import SUFFIX
from engines.token2wav.batching import SolveShape
from engines.token2wav.cfm import ConditionalCFM
from engines.token2wav.dit import DiT
from engines.token2wav.graphs import SolverLayout

logger = logging.getLogger(__name__)

# A worker still compiling after this long is stopped: ~12 s per class on an H100 host, a few per worker.
WORKERS_TIMEOUT_S = 600.0


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


@dataclass(frozen=True)
class WorkerReport:
    """What a worker did, for the parent's log: seconds from its start to its first shape (a spawned
    Python, imports, the model built), then the seconds its shapes took and how many classes it
    compiled for them (the rest it loaded from another worker's variants, or they were one class)."""

    name: str
    ready_s: float
    shapes: int
    shapes_s: float
    compiled: int


def compile_block_classes(job: BlockCompileJob, parent: int | None = None,
                          reports: multiprocessing.queues.SimpleQueue[WorkerReport] | None = None,
                          spawned: float | None = None) -> None:
    """A worker's part: run one Euler step of each of `job.shapes` through the kept block (so compiling
    and saving every class they meet that no variant in the folder serves yet). `parent`: the pid of the
    process that started it, which this one does not outlive; `reports`: where its `WorkerReport` goes,
    `spawned` the wall-clock time it was started at."""
    if parent is not None:
        _exit_with_parent(parent)
    torch.set_num_threads(job.threads)
    inductor_config.compile_threads = job.compile_threads
    torch.backends.cuda.matmul.fp32_precision = job.matmul_precision
    torch.backends.cudnn.conv.fp32_precision = job.conv_precision  # type: ignore[attr-defined]
    device = torch.device(job.device)
    dit = DiT(job.cfg.dit)
    cfm = ConditionalCFM(dit, job.cfg.n_timesteps, job.cfg.cfg_rate, job.noise_frames)
    cfm.to(device, job.dtype).eval().requires_grad_(job.requires_grad)
    dit.compile_blocks(precompiled=job.folder.parent)
    block = dit.kept_block
    if block is None or block.folder != job.folder:
        raise RuntimeError(f"the worker's block keeps its variants elsewhere than {job.folder}")
    # One step's caches: the warm-up's block sees the same shapes (one step of the solve's buffers).
    layout = dataclasses.replace(SolverLayout.of(job.cfg, job.dtype, device), steps=1)

    def zeros(name: str, size: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        return torch.zeros(size, dtype=dtype, device=device)

    ready = time.time()
    with torch.inference_mode():
        conditioning = cfm.step_conditioning()
        for shape in job.shapes:
            inputs, outputs = layout.inputs(shape, zeros), layout.outputs(shape, zeros)
            inputs.lengths.fill_(1)  # valid rows: one real frame each, as a graph's warm-up run
            inputs.mask.fill_(True)
            cfm.solve_ragged(inputs, outputs, conditioning, steps=1)
            if block.failed:  # nothing is kept from here on: say so rather than compile for nothing
                raise RuntimeError("the ahead-of-time compile failed (logged above)")
    if reports is not None:
        name = multiprocessing.current_process().name
        started = ready if spawned is None else spawned
        reports.put(WorkerReport(name, ready - started, len(job.shapes), time.time() - ready, block.compiled))


def _exit_with_parent(parent: int, poll_s: float = 1.0) -> None:
    """End this worker once its parent `parent` is gone (killed before it could stop its workers): a
    thread watches for the process being handed to another parent (maybe while it was importing)."""

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(poll_s)
        os._exit(1)

    threading.Thread(target=watch, name="parent-watch", daemon=True).start()


class BlockCompileWorkers:
    """Worker processes running `jobs` (spawned: CUDA does not survive a fork), started at once; `wait`
    ends them. A parent that exits before waiting (a start that failed meanwhile) stops them."""

    def __init__(self, jobs: Sequence[BlockCompileJob], timeout_s: float = WORKERS_TIMEOUT_S) -> None:
        if not jobs:
            raise ValueError("no compile jobs")
        self.folder = jobs[0].folder
        self.timeout_s = timeout_s
        self._started = time.perf_counter()
        share = max(1, len(os.sched_getaffinity(0)) // len(jobs))
        context = multiprocessing.get_context("spawn")
        self._reports: multiprocessing.queues.SimpleQueue[WorkerReport] = context.SimpleQueue()
        spawned = time.time()
        # Not daemonic: Inductor starts processes of its own to compile kernels.
        self._workers = [context.Process(target=compile_block_classes, name=f"dit-block-compile-{index}",
                                         args=(dataclasses.replace(job, compile_threads=share), os.getpid(),
                                               self._reports, spawned))
                         for index, job in enumerate(jobs)]
        # Stopped at interpreter exit, before multiprocessing joins its children (a start that failed
        # meanwhile), and if one of them cannot start.
        multiprocessing.util.Finalize(self, _stop, args=(self._workers,), exitpriority=10)
        try:
            for worker in self._workers:
                worker.start()
        except BaseException:
            _stop(self._workers)
            raise

    def wait(self) -> int:
        """Wait for the workers until `timeout_s` after their start; stop any still running then. A failed
        or stopped worker is logged (the warm-up compiles what it did not). Returns how many finished."""
        deadline = self._started + self.timeout_s
        finished = 0
        for worker in self._workers:
            worker.join(max(0.0, deadline - time.perf_counter()))
            if worker.is_alive():
                logger.warning("%s still compiling %.0f s after its start: stopped (the warm-up compiles "
                               "what it did not)", worker.name, self.timeout_s)
                _stop([worker])
            elif worker.exitcode != 0:
                logger.warning("%s failed (exit code %s); the warm-up compiles what it did not", worker.name,
                               worker.exitcode)
            else:
                finished += 1
        logger.info("DiT block: %d of %d compile workers done %.1f s after their start; %d variants in %s",
                    finished, len(self._workers), time.perf_counter() - self._started,
                    len(list(self.folder.glob(f"*{SUFFIX}"))), self.folder.name)
        while not self._reports.empty():  # every finished worker's, put before it exited
            report = self._reports.get()
            logger.info("%s: ready %.1f s after its start, then %d shapes in %.1f s (%d classes compiled "
                        "here)", report.name, report.ready_s, report.shapes, report.shapes_s, report.compiled)
        return finished


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

