"""CUDA graph capture for the engines' start-up: one function, `capture_graph`, used by the LLM runner
and the token2wav graphs.

`torch.cuda.graph` synchronises the whole device and empties the caching allocator before every
capture. For the hundreds of graphs captured at start-up that costs twice: the host waits for the
warm-up run's kernels before it may record the next graph, and every warm-up run afterwards allocates
its working memory from the driver again (cudaMalloc, and cudaFree's implicit synchronisation). Here a
capture only orders its stream after the caller's, so the host records a graph while the device still
runs the warm-up.

Capture is thread-local (other threads may keep launching work and allocating meanwhile) and is made on
the caller's capture stream, one per memory pool: the allocator reuses a pool's blocks only on the
stream that freed them, so graphs sharing a pool must be captured on one stream. The LLM captures on a
high-priority stream and token2wav on normal ones, so one engine's capture stream is never another
thread's working stream (torch hands out streams of each priority from a small shared pool,
round-robin). Graphs are captured one at a time in the process, warm-up run included, under
engines/exclusive.py's lock: a first run may compile, and Triton's autotuning synchronises the device,
which CUDA forbids while another thread captures.
"""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Callable, Iterator
from typing import Any

import torch

from engines.exclusive import EXCLUSIVE

# Below this share of the device free, a capture first releases the allocator's cached blocks.
LOW_FREE_SHARE = 0.2


def empty_cache() -> None:
    """`torch.cuda.empty_cache()` between captures: PyTorch's allocator asserts when its cache is emptied
    while any thread of the process captures a graph (on any device), so this waits for the capture under
    way, if any, to end."""
    with EXCLUSIVE:
        torch.cuda.empty_cache()


def usable_bytes(device: torch.device) -> int:
    """What new tensors on `device` can still take: its free memory once the caching allocator has handed
    back the blocks it holds unused (`empty_cache`, so after a capture under way; the graphs' private
    pools stay)."""
    with torch.cuda.device(device):
        empty_cache()
    return torch.cuda.mem_get_info(device)[0]


def free_bytes(device: torch.device) -> int:
    """The device's free memory plus the blocks the caching allocator holds unused: about `usable_bytes`,
    measured without waiting for a capture under way, whose warm-up run may compile
    for seconds (an LLM building beside a cold start held such a measure 8.3 s, docs/benchmarks.md,
    twenty-first session). Unused blocks of graph pools count too: an estimate, for decisions with a
    wide margin."""
    unused = torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
    return torch.cuda.mem_get_info(device)[0] + unused


@contextlib.contextmanager
def collector_paused() -> Iterator[None]:
    """Python's automatic cycle collection off while inside (the whole process's; captures run one at a
    time). An explicit `gc.collect()` still runs: Dynamo's after a compile, on another thread, which a
    thread-local capture allows.

    A collection set off by an allocation inside a capture frees whatever cyclic garbage holds, on the
    capturing thread: a CUDA graph among it is destroyed there (`cudaGraphDestroy`), which CUDA forbids
    while the thread captures, and the capture fails at its next launch ("operation failed due to a
    previous error during capture"; the GPU tests' warm-up after tests that left graphs in cycles,
    docs/benchmarks.md, twenty-second session). `torch.cuda.graph` collects before every capture instead,
    a full collection each time."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


@contextlib.contextmanager
def measured_conv_plans() -> Iterator[None]:
    """cuDNN times its candidate plans for each new convolution shape inside (`torch.backends.cudnn.
    benchmark`) instead of taking its heuristics' first: for a graph's warm-up run. The plan chosen is
    cached per shape and thread, and the capture that follows on the same thread, with the flag back off,
    finds it there and records it.

    The flag is the process's: a convolution another thread starts meanwhile measures its plans too,
    which only costs it time (no capture is under way while the capture lock is held)."""
    benchmark = torch.backends.cudnn.benchmark
    torch.backends.cudnn.benchmark = True
    try:
        yield
    finally:
        torch.backends.cudnn.benchmark = benchmark


def capture_graph(fn: Callable[[], object], pool: Any, stream: torch.cuda.Stream,
                  warmup: Callable[[], object] | None = None) -> torch.cuda.CUDAGraph:
    """A CUDA graph of `fn` captured on `stream`, its intermediates in memory pool `pool` (None: a new
    pool, `graph.pool()`; every graph of a pool is captured on the same stream).

    `warmup` (default `fn`) runs once before, on the caller's stream: a first call may compile, pick
    kernels or allocate workspaces, none of which may happen inside a capture. It must launch every
    kernel `fn` does on the same shapes; it may repeat them fewer times (the solve's graphs warm up on
    one Euler step of ten: the device runs a warm-up, a capture only records).
    """
    current = torch.cuda.current_stream(stream.device)
    graph = torch.cuda.CUDAGraph()
    with EXCLUSIVE:
        free, total = torch.cuda.mem_get_info(stream.device)
        if free < LOW_FREE_SHARE * total:
            # Without torch.cuda.graph's empty_cache before every capture, blocks cached for other
            # streams can fill the device; hand them back when it is nearly full (no capture is under
            # way while the lock is held).
            torch.cuda.empty_cache()
        (fn if warmup is None else warmup)()
        stream.wait_stream(current)
        with torch.cuda.stream(stream), collector_paused():
            if pool is None:
                graph.capture_begin(capture_error_mode="thread_local")
            else:
                graph.capture_begin(pool=pool, capture_error_mode="thread_local")
            try:
                fn()
            except BaseException:
                with contextlib.suppress(RuntimeError):  # the capture is broken: the first error says why
                    graph.capture_end()
                raise
            graph.capture_end()
        current.wait_stream(stream)
    return graph
