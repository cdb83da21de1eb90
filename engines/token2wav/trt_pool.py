"""TensorRT for the DiT estimator: plan layout, optimisation profiles, a context pool, the estimator.

One deserialized engine serves N execution contexts, each with its own CUDA stream, so up to N estimator
calls (of different streams' chunks) run concurrently. Since TensorRT 10 every context may use the same
optimisation profile (profile sharing is always on), so a plan holds one profile. A context is lent
for one call, to a thread (`LeasePool.lease`) or to a coroutine (`LeasePool.acquire`, which waits
without blocking the event loop), and returned afterwards.

`TrtDiTEstimator` implements the estimator interface the CFM solver calls (`forward` for whole
sequences, `forward_chunk` for a chunk after explicit caches, see dit.py), so the DiT flow runs
unchanged with TensorRT in place of the PyTorch DiT (which it keeps for calls the plans cannot take);
`TrtToken2Wav` is `TorchToken2Wav` over that flow, running a batch's chunks concurrently, one pool
context each.

Importing this module does not import `tensorrt`; building a pool without it raises `TensorRTUnavailable`.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import dataclasses
import logging
import threading
from collections.abc import AsyncIterator, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any, Generic, Literal, TypeVar

import torch
from torch import nn

from engines.config import DiTConfig, ModelPaths, configs_for_models_dir
from engines.token2wav.base import ChunkJob, FinishedChunks, LaunchedChunks
from engines.token2wav.dit import DiT
from engines.token2wav.dit_cache import CacheRule
from engines.token2wav.flow_dit import DiTFlow, load_dit_flow
from engines.token2wav.hift import HiFTGenerator, load_hift
from engines.token2wav.onnx_export import EstimatorShapes
from engines.token2wav.torch_backend import TorchToken2Wav

logger = logging.getLogger(__name__)
T = TypeVar("T")

Precision = Literal["fp32", "fp16", "bf16"]
PRECISIONS: tuple[Precision, ...] = ("fp32", "fp16", "bf16")


class TensorRTUnavailable(RuntimeError):
    """`tensorrt` cannot be imported on this machine."""


def import_tensorrt() -> ModuleType:
    """The `tensorrt` module, or `TensorRTUnavailable` saying how to get it."""
    try:
        import tensorrt  # type: ignore[import-not-found]
    except ImportError as exc:
        raise TensorRTUnavailable(
            f"TensorRT is not importable ({exc}); the TensorRT token2wav backend needs a CUDA host with the "
            "tensorrt package (TensorRT >= 10, e.g. the nvcr.io/nvidia/tensorrt-llm/release image). "
            "Use the PyTorch backend otherwise."
        ) from exc
    return tensorrt


@dataclass(frozen=True)
class TrtArtifacts:
    """Where the ONNX graphs and TensorRT plans of a models directory live."""

    root: Path

    @property
    def onnx_dir(self) -> Path:
        return ModelPaths(self.root).engines / "onnx"

    @property
    def plan_dir(self) -> Path:
        return ModelPaths(self.root).engines / "tensorrt"

    @property
    def dit_chunk_onnx(self) -> Path:
        return self.onnx_dir / "dit_chunk.onnx"

    @property
    def dit_offline_onnx(self) -> Path:
        return self.onnx_dir / "dit_offline.onnx"

    def dit_chunk_plan(self, precision: Precision) -> Path:
        return self.plan_dir / f"dit_chunk.{precision}.plan"

    def dit_offline_plan(self, precision: Precision) -> Path:
        return self.plan_dir / f"dit_offline.{precision}.plan"

    @property
    def campplus_plan(self) -> Path:
        """CAMPPlus (already ONNX in the release) in fp32: it runs once per voice, accuracy first."""
        return self.plan_dir / "campplus.fp32.plan"


@dataclass(frozen=True)
class EstimatorLimits:
    """Sizes the DiT plans accept; `streams` chunks per call, each 2 guidance rows.

    Defaults cover a 30 s prompt (1500 frames, estimated once per voice as one chunk), chunks up to
    1600 frames and caches of prompt + the flow's 100 recent frames; offline up to 60 s in all.
    """

    streams: int = 8
    max_frames: int = 1600
    max_cache_frames: int = 1700
    max_offline_frames: int = 3000
    opt_frames: int = 50
    opt_cache_frames: int = 500

    def __post_init__(self) -> None:
        for name in ("streams", "max_frames", "max_cache_frames", "max_offline_frames", "opt_frames"):
            if getattr(self, name) < 1:
                raise ValueError(f"EstimatorLimits.{name} must be positive, got {getattr(self, name)}")
        if not (self.opt_frames <= self.max_frames and 0 <= self.opt_cache_frames <= self.max_cache_frames):
            raise ValueError(f"optimal sizes must lie within the maxima: {self}")

    @property
    def max_rows(self) -> int:
        return 2 * self.streams


Shapes = Mapping[str, tuple[int, ...]]
Profile = dict[str, tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]]


def profile_of(low: Shapes, opt: Shapes, high: Shapes) -> Profile:
    """The profile whose inputs range from the shapes `low` over `opt` to `high` (same names in each)."""
    return {name: (low[name], opt[name], high[name]) for name in low}


def chunk_profile(cfg: DiTConfig, limits: EstimatorLimits) -> Profile:
    """(min, opt, max) shape of every chunk-graph input: rows 2…2·streams, frames 1…max, cache 0…max."""
    shapes = EstimatorShapes(cfg)
    return profile_of(shapes.chunk_inputs(2, 1, 0),
                      shapes.chunk_inputs(2, limits.opt_frames, limits.opt_cache_frames),
                      shapes.chunk_inputs(limits.max_rows, limits.max_frames, limits.max_cache_frames))


def offline_profile(cfg: DiTConfig, limits: EstimatorLimits) -> Profile:
    """(min, opt, max) shape of every offline-graph input: rows 2…2·streams, frames 1…max offline."""
    shapes = EstimatorShapes(cfg)
    return profile_of(shapes.offline_inputs(2, 1), shapes.offline_inputs(2, limits.opt_frames * 10),
                      shapes.offline_inputs(limits.max_rows, limits.max_offline_frames))


def outside(profile: Profile, feeds: Mapping[str, torch.Tensor]) -> str | None:
    """The first input of `feeds` outside the plan's profile, described, or None when all fit."""
    for name, (low, _, high) in profile.items():
        shape = tuple(feeds[name].shape)
        bounds = zip(shape, low, high, strict=False)
        if len(shape) != len(low) or any(not lo <= n <= hi for n, lo, hi in bounds):
            return f"input {name} of shape {shape} is outside the TensorRT profile {low}…{high}"
    return None


def _torch_dtypes(trt: ModuleType) -> dict[Any, torch.dtype]:
    return {
        trt.DataType.FLOAT: torch.float32, trt.DataType.HALF: torch.float16,
        trt.DataType.BF16: torch.bfloat16, trt.DataType.BOOL: torch.bool,
        trt.DataType.INT32: torch.int32, trt.DataType.INT64: torch.int64,
    }


class LeasePool(Generic[T]):
    """A fixed set of items lent to one holder at a time: to threads (`lease`) or coroutines (`acquire`).

    A returned item goes to a waiting coroutine first (handed over on its own event loop), else back to
    the free list, waking a waiting thread.
    """

    def __init__(self, items: Sequence[T]) -> None:
        if not items:
            raise ValueError("a LeasePool needs at least one item")
        self.size = len(items)
        self._free = collections.deque(items)
        self._lock = threading.Condition()
        self._waiters: collections.deque[tuple[asyncio.AbstractEventLoop, asyncio.Future[T]]]
        self._waiters = collections.deque()

    @property
    def available(self) -> int:
        with self._lock:
            return len(self._free)

    @contextlib.contextmanager
    def lease(self) -> Iterator[T]:
        """A free item for the calling thread (blocks until one is free)."""
        with self._lock:
            while not self._free:
                self._lock.wait()
            item = self._free.popleft()
        try:
            yield item
        finally:
            self._release(item)

    @contextlib.asynccontextmanager
    async def acquire(self) -> AsyncIterator[T]:
        """A free item for the calling coroutine; waiting does not block the event loop."""
        loop = asyncio.get_running_loop()
        waiter: asyncio.Future[T] | None = None
        with self._lock:
            if self._free:
                item = self._free.popleft()
            else:
                waiter = loop.create_future()
                self._waiters.append((loop, waiter))
        if waiter is not None:
            try:
                item = await waiter
            except asyncio.CancelledError:
                self._abandon(waiter)
                raise
        try:
            yield item
        finally:
            self._release(item)

    def _abandon(self, waiter: asyncio.Future[T]) -> None:
        """A cancelled waiter: forget it, or pass on the item it was handed just before the cancel."""
        with self._lock:
            self._waiters = collections.deque(w for w in self._waiters if w[1] is not waiter)
        if waiter.done() and not waiter.cancelled():
            self._release(waiter.result())

    def _release(self, item: T) -> None:
        with self._lock:
            while self._waiters:
                loop, waiter = self._waiters.popleft()
                if not waiter.done() and not loop.is_closed():
                    loop.call_soon_threadsafe(self._hand_over, waiter, item)
                    return
            self._free.append(item)
            self._lock.notify()

    def _hand_over(self, waiter: asyncio.Future[T], item: T) -> None:
        """On the waiter's loop: give it `item`, or pass it on if the waiter was cancelled meanwhile."""
        if waiter.done():
            self._release(item)
        else:
            waiter.set_result(item)


class _Context:
    """One execution context with its CUDA stream; used by one caller at a time."""

    def __init__(self, engine: Any, device: torch.device) -> None:
        self.context = engine.create_execution_context()
        self.stream = torch.cuda.Stream(device=device)


class TrtContextPool:
    """N execution contexts over one deserialized plan, with their I/O described once."""

    def __init__(self, plan: Path, size: int, device: torch.device | str = "cuda") -> None:
        if size < 1:
            raise ValueError(f"pool size must be positive, got {size}")
        trt = import_tensorrt()
        self.device = torch.device(device)
        self.plan = Path(plan)
        self._logger = trt.Logger(trt.Logger.WARNING)
        self._runtime = trt.Runtime(self._logger)
        self.engine = self._runtime.deserialize_cuda_engine(self.plan.read_bytes())
        if self.engine is None:
            raise RuntimeError(f"{self.plan} is not a TensorRT plan for this TensorRT version and GPU: "
                               "rebuild it with build_engines.py build-trt")
        dtypes = _torch_dtypes(trt)
        names = [self.engine.get_tensor_name(i) for i in range(self.engine.num_io_tensors)]
        self.inputs = {n: dtypes[self.engine.get_tensor_dtype(n)] for n in names
                       if self.engine.get_tensor_mode(n) == trt.TensorIOMode.INPUT}
        self.outputs = {n: dtypes[self.engine.get_tensor_dtype(n)] for n in names if n not in self.inputs}
        self.profile: Profile = {}
        for name in self.inputs:
            low, opt, high = (tuple(dims) for dims in self.engine.get_tensor_profile_shape(name, 0))
            self.profile[name] = (low, opt, high)
        self.contexts = LeasePool([_Context(self.engine, self.device) for _ in range(size)])

    # -- running --------------------------------------------------------------------------------------

    def run(self, ctx: _Context, feeds: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Execute with `feeds` (converted to the plan's input dtypes) on the context's stream.

        Shapes outside `profile` raise (TensorRT refuses them); callers that can do without the plan
        check `outside` first. The context's stream waits for the current torch stream before it reads
        the inputs, and the current stream waits for the context's before anything uses the outputs.
        """
        current = torch.cuda.current_stream(self.device)
        inputs = {n: feeds[n].to(self.device, dtype).contiguous() for n, dtype in self.inputs.items()}
        context = ctx.context
        for name, tensor in inputs.items():
            if not context.set_input_shape(name, tuple(tensor.shape)):
                low, _, high = self.profile[name]
                raise ValueError(f"TensorRT rejected shape {tuple(tensor.shape)} for input {name} of "
                                 f"{self.plan.name} (profile {low}…{high}); rebuild the plans with "
                                 "larger limits (build_engines.py build-trt)")
            context.set_tensor_address(name, tensor.data_ptr())
        outputs = {n: torch.empty(tuple(context.get_tensor_shape(n)), dtype=dtype, device=self.device)
                   for n, dtype in self.outputs.items()}
        for name, tensor in outputs.items():
            context.set_tensor_address(name, tensor.data_ptr())
        ctx.stream.wait_stream(current)
        if not context.execute_async_v3(ctx.stream.cuda_stream):
            raise RuntimeError(f"TensorRT execution of {self.plan.name} failed")
        current.wait_stream(ctx.stream)
        return outputs

    def __call__(self, feeds: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        with self.contexts.lease() as ctx:
            return self.run(ctx, feeds)


class TrtDiTEstimator(nn.Module):
    """The DiT estimator on TensorRT plans, with the `forward`/`forward_chunk` contract of dit.py.

    Calls the plans cannot take run on `fallback`, the PyTorch DiT: shapes outside the profiles (a very
    long last chunk or utterance), a per-query offline mask (`DiTFlow.offline` with a chunk layout) or
    a missing offline plan. Inputs and outputs keep the caller's dtype and device.
    """

    def __init__(self, chunk: TrtContextPool, offline: TrtContextPool | None, fallback: DiT) -> None:
        super().__init__()
        self.chunk_pool = chunk
        self.offline_pool = offline
        self.fallback = fallback

    def forward(self, x: torch.Tensor, mask: torch.Tensor, mu: torch.Tensor, t: torch.Tensor,
                spks: torch.Tensor, cond: torch.Tensor) -> torch.Tensor:
        feeds = {"x": x, "mask": mask.bool(), "mu": mu, "t": t.float(), "spks": spks, "cond": cond}
        pool = self.offline_pool
        if pool is None or mask.shape[1] != 1 or self._declined(pool, feeds):
            return self.fallback(x, mask, mu, t, spks, cond)
        return pool(feeds)["velocity"].to(x.dtype)

    def forward_chunk(
        self, x: torch.Tensor, mu: torch.Tensor, t: torch.Tensor, spks: torch.Tensor, cond: torch.Tensor,
        cnn_cache: torch.Tensor, att_cache: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        feeds = {"x": x, "mu": mu, "t": t.float(), "spks": spks, "cond": cond, "cnn_cache": cnn_cache,
                 "att_cache": att_cache}
        if self._declined(self.chunk_pool, feeds):
            return self.fallback.forward_chunk(x, mu, t, spks, cond, cnn_cache, att_cache)
        out = self.chunk_pool(feeds)
        dtype = x.dtype
        return out["velocity"].to(dtype), out["new_cnn_cache"].to(dtype), out["chunk_att_cache"].to(dtype)

    @staticmethod
    def _declined(pool: TrtContextPool, feeds: Mapping[str, torch.Tensor]) -> bool:
        problem = outside(pool.profile, feeds)
        if problem is not None:
            logger.warning("%s: %s; running this call in PyTorch", pool.plan.name, problem)
        return problem is not None


class TrtToken2Wav(TorchToken2Wav):
    """`TorchToken2Wav` whose DiT flow estimates with TensorRT; a batch's chunks run concurrently."""

    def __init__(self, flow: DiTFlow, hift: HiFTGenerator, workers: int) -> None:
        # No HiFT graphs: chunks run on several threads, and graphs replay from shared buffers.
        super().__init__(flow, hift, name="tensorrt-dit", cuda_graphs=False)
        self._workers = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="token2wav-trt")

    def run_chunk(self, job: ChunkJob) -> torch.Tensor:
        return super().launch_chunks([job]).wait()[0]

    def run_chunks(self, jobs: Sequence[ChunkJob]) -> list[torch.Tensor]:
        # Each chunk takes its own pool context, so chunks of different streams overlap on the GPU.
        return list(self._workers.map(self.run_chunk, jobs))

    def launch_chunks(self, jobs: Sequence[ChunkJob]) -> LaunchedChunks:
        return FinishedChunks(self.run_chunks(jobs))


def load_trt_token2wav(
    models_dir: Path,
    precision: Precision = "fp16",
    pool_size: int = 4,
    device: torch.device | str = "cuda",
    dit_cache_rule: CacheRule = "reference",
    vocoder_dtype: torch.dtype = torch.float32,
) -> TrtToken2Wav:
    """The DiT token2wav of `models_dir` with the estimator on its TensorRT plans.

    The conformer encoder and HiFT stay in PyTorch (fp32 HiFT as in the reference, its decoder in
    `vocoder_dtype`: hift.HiFTGenerator.use_decoder_dtype); the flow's own tensors use fp16 for fp16/bf16
    plans and fp32 otherwise. dit_cache_rule: see dit_cache.py.
    """
    artifacts, paths = TrtArtifacts(Path(models_dir)), ModelPaths(Path(models_dir))
    configs = configs_for_models_dir(paths.root)
    flow_dtype = torch.float32 if precision == "fp32" else torch.float16
    flow_cfg = dataclasses.replace(configs.dit_flow, att_cache_rule=dit_cache_rule)
    flow = load_dit_flow(paths.dit_flow, flow_cfg, device, flow_dtype)
    chunk = TrtContextPool(artifacts.dit_chunk_plan(precision), pool_size, device)
    offline_plan = artifacts.dit_offline_plan(precision)
    offline = TrtContextPool(offline_plan, 1, device) if offline_plan.is_file() else None
    dit = flow.decoder.estimator
    assert isinstance(dit, DiT), "DiTFlow's estimator is a DiT"
    flow.decoder.estimator = TrtDiTEstimator(chunk, offline, fallback=dit)
    hift = load_hift(paths.hift, configs.hift, device, vocoder_dtype)
    logger.info("TensorRT DiT estimator: %s (%d contexts), offline plan: %s", chunk.plan, pool_size,
                offline.plan if offline else "none")
    return TrtToken2Wav(flow, hift, workers=pool_size)
