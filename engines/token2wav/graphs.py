"""CUDA graphs for batched streaming chunks: the encoder and the CFM solve per bucketed shape
(`vocoder_graphs.py` does HiFT on the same `ShapeGraphs`).

Both run `ConditionalCFM.solve_ragged` (all Euler steps, all DiT blocks, guidance) behind one interface:
`buffers(shape)` hands out the input tensors for a padded `SolveShape`, the caller fills them, `run(shape)`
solves and returns the outputs. The eager solver allocates fresh tensors per call (any shape, any device).
The graph solver captures one CUDA graph per shape on its first use, and replays it. All graphs
share one memory pool for their intermediates, and their static inputs and outputs are views of shared
flat arenas, so memory grows with the largest shape rather than with the number of graphs (a graph
captured before a larger shape grew an arena is captured again on the larger buffer, which frees the
smaller one: the warm-up meets shapes in increasing order of chunk and cache frames). Outputs are
valid until the next `run`; inputs keep whatever was written last (callers write every row they read).
The weights must not change once graphs exist: they read them in place, and the steps' time
conditioning is computed once.

`GraphedEncoder` does the same for the conformer encoder of a batch (`EncoderInputs` → `EncoderOutputs`):
chunks right-padded to a bucket of tokens, histories left-padded to a bucket of cached tokens, padding
rows of one token; all of it masked, so the bucket computes what the exact shape computes.
"""
from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Generic, Protocol, TypeVar, cast

import torch

from engines.config import MEL_BINS, ConformerConfig, FlowConfig
from engines.cuda_graphs import capture_graph
from engines.token2wav.batching import EncodeShape, SolveShape
from engines.token2wav.cfm import ConditionalCFM, RaggedInputs, RaggedOutputs
from engines.token2wav.conformer import PRE_LOOKAHEAD_LEFT, UPSAMPLE_KERNEL_GROWTH, ConformerCache
from engines.token2wav.dit import DiT

logger = logging.getLogger(__name__)

ShapeT = TypeVar("ShapeT")
InputsT = TypeVar("InputsT")
OutputsT = TypeVar("OutputsT")


class TensorSource(Protocol):
    def __call__(self, name: str, size: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor: ...


@dataclass(frozen=True)
class SolverLayout:
    """Tensor shapes of a solve: Euler steps, DiT dims; dtype of the flow."""

    steps: int
    depth: int
    heads: int
    head_dim: int
    hidden: int
    dtype: torch.dtype
    device: torch.device

    @staticmethod
    def of(cfg: FlowConfig, dtype: torch.dtype, device: torch.device) -> SolverLayout:
        dit = cfg.dit
        return SolverLayout(cfg.n_timesteps, dit.depth, dit.num_heads, dit.head_dim, dit.hidden_size,
                            dtype, device)

    def input_specs(self, shape: SolveShape) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        b, kv = shape.batch, 2 * self.head_dim
        lead = (self.steps, self.depth)
        return {
            "mu": ((b, MEL_BINS, shape.frames), self.dtype),
            "spks": ((b, MEL_BINS), self.dtype),
            "offsets": ((b,), torch.int64),
            "lengths": ((b,), torch.int64),
            "cnn_cache": ((*lead, 2 * b, 2 * self.hidden, 2), self.dtype),
            "prompt_kv": ((*lead, 2, self.heads, shape.prompt_frames, kv), self.dtype),
            "own_kv": ((*lead, 2 * b, self.heads, shape.own_frames, kv), self.dtype),
            "mask": ((2 * b, shape.prompt_frames + shape.own_frames + shape.frames), torch.bool),
            "keep": ((b, shape.kept_frames), torch.int64),
        }

    def inputs(self, shape: SolveShape, tensor: TensorSource) -> RaggedInputs:
        specs = self.input_specs(shape)
        return RaggedInputs(**{name: tensor(f"in.{name}", *spec) for name, spec in specs.items()})

    def outputs(self, shape: SolveShape, tensor: TensorSource) -> RaggedOutputs:
        specs = self.output_specs(shape)
        return RaggedOutputs(**{name: tensor(f"out.{name}", *spec) for name, spec in specs.items()})

    def output_specs(self, shape: SolveShape) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        b, lead = shape.batch, (self.steps, self.depth)
        return {
            "mel": ((b, MEL_BINS, shape.frames), self.dtype),
            "cnn_cache": ((*lead, 2 * b, 2 * self.hidden, 2), self.dtype),
            "kept_kv": ((*lead, 2 * b, self.heads, shape.kept_frames, 2 * self.head_dim), self.dtype),
        }


class RaggedSolver(Protocol):
    def buffers(self, shape: SolveShape) -> RaggedInputs:
        """Input tensors of `shape` to fill before `run(shape)`."""
        ...

    def run(self, shape: SolveShape) -> RaggedOutputs:
        """Solve the inputs last handed out for `shape`."""
        ...


class _EagerCalls(Generic[ShapeT, InputsT, OutputsT]):
    """Fresh zeroed inputs per call (`_inputs`), computed at once by `run` (`_compute`): any shape, any
    device. `run(shape)` computes the inputs the last `buffers(shape)` handed out."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._pending: tuple[ShapeT, InputsT] | None = None

    def buffers(self, shape: ShapeT) -> InputsT:
        inputs = self._inputs(shape)
        self._pending = (shape, inputs)
        return inputs

    def run(self, shape: ShapeT) -> OutputsT:
        if self._pending is None or self._pending[0] != shape:
            raise RuntimeError(f"run({shape}) without buffers({shape}) first")
        inputs = self._pending[1]
        self._pending = None
        return self._compute(shape, inputs)

    def _zeros(self, name: str, size: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        return torch.zeros(size, dtype=dtype, device=self.device)

    def _inputs(self, shape: ShapeT) -> InputsT:
        raise NotImplementedError

    def _compute(self, shape: ShapeT, inputs: InputsT) -> OutputsT:
        raise NotImplementedError


class EagerSolver(_EagerCalls[SolveShape, RaggedInputs, RaggedOutputs]):
    """The CFM solve, eagerly at the exact shape. It compiles nothing itself (a CPU, or a shape beyond the
    buckets, would otherwise pay a compilation in the middle of traffic); blocks that the graph solver
    compiled stay compiled."""

    def __init__(self, cfm: ConditionalCFM, layout: SolverLayout) -> None:
        super().__init__(layout.device)
        self.cfm = cfm
        self.layout = layout

    def _inputs(self, shape: SolveShape) -> RaggedInputs:
        return self.layout.inputs(shape, self._zeros)

    def _compute(self, shape: SolveShape, inputs: RaggedInputs) -> RaggedOutputs:
        return self.cfm.solve_ragged(inputs)


# A buffer the arena replaces by a larger one stays alive as long as a graph views it; from this size
# on, those graphs are captured again (a few at warm-up) to free it. Smaller ones are left alone.
RECAPTURE_MIN_BYTES = 64 << 20


class _Arena:
    """Flat storage per (name, dtype), handed out as views; grows by reallocating (old views stay valid,
    and keep the old storage alive: `take_replaced` says which large storages were replaced)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._flat: dict[str, torch.Tensor] = {}
        self._replaced: set[int] = set()

    def view(self, name: str, size: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        numel = math.prod(size)
        return self.reserve(name, numel, dtype)[:numel].view(size)

    def reserve(self, name: str, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """The flat storage of `name`, at least `numel` elements of `dtype` (reallocated if smaller). An
        inference tensor, whoever asks: every graph runs in inference mode, and views of an ordinary
        tensor reach the compiled DiT block as ordinary tensors, whose guards refuse the variants compiled
        on inference tensors (an H100 cold start compiled every class again, docs/benchmarks.md,
        eighteenth session)."""
        flat = self._flat.get(name)
        if flat is None or flat.numel() < numel or flat.dtype != dtype:
            if flat is not None and flat.nbytes >= RECAPTURE_MIN_BYTES:
                self._replaced.add(flat.untyped_storage().data_ptr())
            with torch.inference_mode():
                flat = torch.zeros(numel, dtype=dtype, device=self.device)
            self._flat[name] = flat
        return flat

    def take_replaced(self) -> set[int]:
        """The data pointers of the large storages replaced since the last call."""
        replaced, self._replaced = self._replaced, set()
        return replaced


def _tensors(value: object) -> Iterable[torch.Tensor]:
    """The tensors inside a graph's inputs or outputs (dataclasses and tuples of tensors, or None)."""
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, tuple):
        for item in value:
            yield from _tensors(item)
    elif dataclasses.is_dataclass(value) and not isinstance(value, type):
        for field in dataclasses.fields(value):
            yield from _tensors(getattr(value, field.name))


@dataclass
class CapturedGraph(Generic[InputsT, OutputsT]):
    graph: torch.cuda.CUDAGraph
    inputs: InputsT
    outputs: OutputsT

    def storages(self) -> dict[int, int]:
        """Data pointer → bytes of each storage the static inputs and outputs view."""
        return {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
                for t in (*_tensors(self.inputs), *_tensors(self.outputs))}


class ShapeGraphs(Generic[ShapeT, InputsT, OutputsT]):
    """One CUDA graph per shape, captured (by `_capture`) on its first use, then replayed. The graphs
    share one memory pool and one arena of static inputs and outputs.

    Once `seal`ed (after the warm-up), nothing more is captured: a capture takes the engine thread, and
    every stream waiting on it, for tens to hundreds of milliseconds. A shape without a graph then runs in
    a captured graph holding it (`stand_in`), else through `eager` at the same (bucket) shape, and is
    logged once. While `pause`d (a warm-up that goes on in steps between serving calls), shapes are
    captured only inside `capturing` (the steps), and one without a graph yet runs likewise without a
    word: a step may still capture it."""

    def __init__(self, device: torch.device,
                 eager: _EagerCalls[ShapeT, InputsT, OutputsT] | None = None) -> None:
        if device.type != "cuda":
            raise ValueError(f"CUDA graphs need a CUDA device, not {device}")
        self.device = device
        self._pool = torch.cuda.graph_pool_handle()
        self._stream = torch.cuda.Stream(device)  # every capture into the pool (engines/cuda_graphs.py)
        self._arena = _Arena(device)
        self._graphs: dict[ShapeT, CapturedGraph[InputsT, OutputsT]] = {}
        self._eager = eager
        self._capturing = True  # a shape's graph is captured at its first use
        self._sealed = False  # the warm-up is over: shapes without a graph are logged
        self._uncaptured: set[ShapeT] = set()

    @property
    def shapes(self) -> list[ShapeT]:
        return list(self._graphs)

    @property
    def static_bytes(self) -> int:
        """Device bytes of the storages the graphs' static inputs and outputs view (each counted once)."""
        storages = {ptr: size for graph in self._graphs.values() for ptr, size in graph.storages().items()}
        return sum(storages.values())

    def seal(self) -> None:
        """Capture nothing more (see the class docstring)."""
        self._capturing = False
        self._sealed = True

    def pause(self) -> None:
        """Capture only inside `capturing` from now on (see the class docstring)."""
        self._capturing = False

    @contextlib.contextmanager
    def capturing(self) -> Iterator[None]:
        """Capture shapes at their first use while inside (a paused warm-up's step; sealed graphs never)."""
        before, self._capturing = self._capturing, not self._sealed
        try:
            yield
        finally:
            self._capturing = before and not self._sealed  # sealed inside stays sealed

    def covers(self, shape: ShapeT) -> bool:
        """Whether `shape` runs from a graph (captured, or to be captured now: see the class docstring)."""
        if shape in self._graphs or self._capturing:
            return True
        if self._sealed and shape not in self._uncaptured:
            self._uncaptured.add(shape)
            logger.warning("%s %s has no CUDA graph (the warm-up did not meet it): it runs eagerly",
                           type(self).__name__, shape)
        return False

    def stand_in(self, shape: ShapeT) -> ShapeT:
        """The shape to run a call of `shape` at: `shape` where a graph serves it (captured, or captured
        now), else the cheapest captured shape that holds it (`_holds`, `_padding_order`), else
        `shape` (eagerly). A larger graph computes the same rows (its padding is masked) for more device
        time, where an eager call at a shape met for the first time pays cuDNN's plans and every launch
        on the host: right after ready, 16 streams' later chunks took 214 ms a call eagerly, 203 ms of it
        on the host, and underran (docs/benchmarks.md, twenty-first session). So the shapes a paused
        warm-up has not reached yet, and those it never meets, replay the graphs it has."""
        if shape in self._graphs or self._capturing:
            return shape
        holders = [captured for captured in self._graphs if self._holds(captured, shape)]
        if not holders:
            return shape
        holder = min(holders, key=self._padding_order)
        if self._sealed and shape not in self._uncaptured:
            self._uncaptured.add(shape)
            logger.warning("%s %s has no CUDA graph (the warm-up did not meet it): it runs in %s's, padded",
                           type(self).__name__, shape, holder)
        return holder

    def _holds(self, captured: ShapeT, shape: ShapeT) -> bool:
        """Whether a call of `shape` can run in `captured`'s graph (padded to it): none can here."""
        return False

    def _padding_order(self, shape: ShapeT) -> tuple[int, ...]:
        """Stand-ins by preference, cheapest first: here by their dimensions in order (rows first)."""
        return dataclasses.astuple(cast(Any, shape))

    def capture(self, shapes: Iterable[ShapeT]) -> None:
        """Capture the graphs of `shapes` ahead of their first use."""
        for shape in shapes:
            self._graph(shape)

    def capture_missing(self, shape: ShapeT) -> bool:
        """Capture `shape`'s graph unless it is captured already; whether it was captured now."""
        if shape in self._graphs:
            return False
        self._graph(shape)
        return True

    def buffers(self, shape: ShapeT) -> InputsT:
        if self._eager is not None and not self.covers(shape):
            return self._eager.buffers(shape)
        return self._graph(shape).inputs

    def run(self, shape: ShapeT) -> OutputsT:
        if self._eager is not None and not self.covers(shape):
            return self._eager.run(shape)
        entry = self._graph(shape)
        entry.graph.replay()
        return entry.outputs

    def _graph(self, shape: ShapeT) -> CapturedGraph[InputsT, OutputsT]:
        entry = self._graphs.get(shape)
        if entry is None:
            entry = self._capture(shape)
            self._graphs[shape] = entry
            self._recapture_on_grown_buffers()
        return entry

    def _recapture_on_grown_buffers(self) -> None:
        """Capture again the graphs that view a buffer the arena has just replaced by a larger one, so
        that the old buffer is freed (e.g. at 64 rows the kept cache's buffer grows from 30 to 100 to 200
        frames: 1.2 + 4 GiB that would otherwise stay held by the first graphs)."""
        replaced = self._arena.take_replaced()
        if not replaced:
            return
        stale = [shape for shape, graph in self._graphs.items() if not replaced.isdisjoint(graph.storages())]
        for shape in stale:
            del self._graphs[shape]  # every view of the old buffers goes with it
        for shape in stale:
            self._graphs[shape] = self._capture(shape)
        if stale:
            logger.info("%s: %d graphs captured again on grown buffers", type(self).__name__, len(stale))

    @torch.inference_mode()  # a graph captured again here runs as every capture does
    def reserve(self, shapes: Iterable[ShapeT]) -> None:
        """Allocate the shared static buffers now at the largest size any of `shapes` views, so that the
        graphs captured before the largest of them view their final buffers (none captured again when it
        comes, no larger buffer allocated beside the smaller one)."""
        if self._sealed:
            return  # nothing more is captured: no buffer is needed
        wanted: dict[str, tuple[int, torch.dtype]] = {}

        def note(name: str, size: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
            numel = math.prod(size)
            if numel > wanted.get(name, (0, dtype))[0]:
                wanted[name] = (numel, dtype)
            return torch.empty(size, dtype=dtype, device="meta")

        for shape in shapes:
            self._static_buffers(shape, note)
        for name, (numel, dtype) in wanted.items():
            self._arena.reserve(name, numel, dtype)
        self._recapture_on_grown_buffers()

    def _static_buffers(self, shape: ShapeT, view: TensorSource) -> None:
        """Take the static inputs and outputs of a graph of `shape` through `view` (`reserve`)."""
        raise NotImplementedError

    def _capture(self, shape: ShapeT) -> CapturedGraph[InputsT, OutputsT]:
        raise NotImplementedError


def _every_dimension_holds(captured: SolveShape | EncodeShape, shape: SolveShape | EncodeShape) -> bool:
    """Whether `captured` is at least `shape` in every dimension (shapes of one kind)."""
    return all(big >= small for big, small in zip(dataclasses.astuple(captured), dataclasses.astuple(shape),
                                                  strict=True))


class GraphedSolver(ShapeGraphs[SolveShape, RaggedInputs, RaggedOutputs]):
    """The CFM solve from one CUDA graph per `SolveShape`."""

    def __init__(self, cfm: ConditionalCFM, layout: SolverLayout, precompiled: Path | None = None) -> None:
        super().__init__(layout.device, EagerSolver(cfm, layout))
        self.cfm = cfm
        self.layout = layout
        if isinstance(cfm.estimator, DiT):
            # The graphs replay fused kernels: on a GPU a graph of unfused blocks is launch-bound.
            cfm.estimator.compile_blocks(precompiled=precompiled)
        # The steps' time conditioning, computed once from the weights and read by every graph.
        self._conditioning: list[Any] | None = None

    def _holds(self, captured: SolveShape, shape: SolveShape) -> bool:
        # Every dimension is padded and masked: rows, chunk, own cache (left), prompts, kept frames.
        return _every_dimension_holds(captured, shape)

    def _padding_order(self, shape: SolveShape) -> tuple[int, ...]:
        # The DiT's attention: each chunk frame over prompt, own cache and chunk, per row.
        attended = shape.prompt_frames + shape.own_frames + shape.frames
        return shape.batch * shape.frames * attended, *dataclasses.astuple(shape)

    def _static_buffers(self, shape: SolveShape, view: TensorSource) -> None:
        self.layout.inputs(shape, view)
        self.layout.outputs(shape, view)

    def _capture(self, shape: SolveShape) -> CapturedGraph[RaggedInputs, RaggedOutputs]:
        inputs = self.layout.inputs(shape, self._arena.view)
        outputs = self.layout.outputs(shape, self._arena.view)
        # Valid rows for the warm-up run: one real frame, which attends to itself; kept positions in
        # range (the arena may hold another shape's indices).
        inputs.lengths.fill_(1)
        inputs.mask.fill_(True)
        inputs.keep.zero_()
        if self._conditioning is None:
            self._conditioning = self.cfm.step_conditioning()
        conditioning = self._conditioning
        graph = capture_graph(lambda: self.cfm.solve_ragged(inputs, outputs, conditioning),
                              self._pool, self._stream,
                              warmup=lambda: self.cfm.solve_ragged(inputs, outputs, conditioning, steps=1))
        logger.info("captured token2wav solve graph %s", shape)
        return CapturedGraph(graph, inputs, outputs)


@dataclass(frozen=True)
class EncoderInputs:
    """ids (B, tokens + lookahead) int64, right-padded; lengths (3, B) int64: per row its token count
    (lookahead included), the tokens it encodes and its cached tokens; cache: the rows' conv contexts and
    histories, left-padded to `history` tokens."""

    ids: torch.Tensor
    lengths: torch.Tensor
    cache: ConformerCache


@dataclass(frozen=True)
class EncoderOutputs:
    """mu (B, 80, stride·tokens) right-padded, and every row's update (its conv contexts and the
    keys/values of its `tokens` positions, real ones first)."""

    mu: torch.Tensor
    update: ConformerCache


EncodeFn = Callable[[EncoderInputs], tuple[torch.Tensor, ConformerCache]]


@dataclass(frozen=True)
class EncoderLayout:
    """Tensor shapes of an encoder call; dtype and device of the flow."""

    cfg: ConformerConfig
    mel_bins: int
    dtype: torch.dtype
    device: torch.device

    def _cache_specs(self, batch: int, tokens: int) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        cfg = self.cfg
        kv = (cfg.num_heads, 2 * cfg.head_dim)
        return {
            "lookahead": ((batch, cfg.d_model, PRE_LOOKAHEAD_LEFT), self.dtype),
            "upsample": ((batch, cfg.d_model, UPSAMPLE_KERNEL_GROWTH * cfg.up_stride), self.dtype),
            "token_kv": ((cfg.num_blocks, batch, kv[0], tokens, kv[1]), self.dtype),
            "frame_kv": ((cfg.num_up_blocks, batch, kv[0], cfg.up_stride * tokens, kv[1]), self.dtype),
        }

    def inputs(self, shape: EncodeShape, tensor: TensorSource) -> EncoderInputs:
        b = shape.batch
        specs = self._cache_specs(b, shape.history)
        cache = {name: tensor(f"in.{name}", *spec) for name, spec in specs.items()}
        return EncoderInputs(tensor("in.ids", (b, shape.tokens + self.cfg.pre_lookahead), torch.int64),
                             tensor("in.lengths", (3, b), torch.int64), ConformerCache(**cache))

    def outputs(self, shape: EncodeShape, tensor: TensorSource) -> EncoderOutputs:
        b = shape.batch
        specs = self._cache_specs(b, shape.tokens)
        cache = {name: tensor(f"out.{name}", *spec) for name, spec in specs.items()}
        mu = tensor("out.mu", (b, self.mel_bins, self.cfg.up_stride * shape.tokens), self.dtype)
        return EncoderOutputs(mu, ConformerCache(**cache))


class EncoderRunner(Protocol):
    def buffers(self, shape: EncodeShape) -> EncoderInputs:
        """Input tensors of `shape` to fill before `run(shape)`."""
        ...

    def run(self, shape: EncodeShape) -> EncoderOutputs:
        """Encode the inputs last handed out for `shape`."""
        ...


class EagerEncoder(_EagerCalls[EncodeShape, EncoderInputs, EncoderOutputs]):
    """The encoder, eagerly at the exact shape (padding rows of one token, as the graphs')."""

    def __init__(self, encode: EncodeFn, layout: EncoderLayout) -> None:
        super().__init__(layout.device)
        self.encode = encode
        self.layout = layout

    def _inputs(self, shape: EncodeShape) -> EncoderInputs:
        return self.layout.inputs(shape, self._zeros)

    def _compute(self, shape: EncodeShape, inputs: EncoderInputs) -> EncoderOutputs:
        return EncoderOutputs(*self.encode(inputs))


class GraphedEncoder(ShapeGraphs[EncodeShape, EncoderInputs, EncoderOutputs]):
    """The encoder from one CUDA graph per `EncodeShape`; outputs are valid until the next `run`."""

    def __init__(self, encode: EncodeFn, layout: EncoderLayout) -> None:
        super().__init__(layout.device, EagerEncoder(encode, layout))
        self.encode = encode
        self.layout = layout

    def _holds(self, captured: EncodeShape, shape: EncodeShape) -> bool:
        # Rows, tokens (right) and history (left) are padded and masked.
        return _every_dimension_holds(captured, shape)

    def _padding_order(self, shape: EncodeShape) -> tuple[int, ...]:
        # Attention: each token over history and chunk, per row.
        return shape.batch * shape.tokens * (shape.history + shape.tokens), *dataclasses.astuple(shape)

    def _static_buffers(self, shape: EncodeShape, view: TensorSource) -> None:
        self.layout.inputs(shape, view)
        self.layout.outputs(shape, view)

    def _capture(self, shape: EncodeShape) -> CapturedGraph[EncoderInputs, EncoderOutputs]:
        inputs = self.layout.inputs(shape, self._arena.view)
        outputs = self.layout.outputs(shape, self._arena.view)
        inputs.lengths.fill_(1)  # the warm-up run: one token per row, nothing cached

        def run() -> None:
            mu, update = self.encode(inputs)
            outputs.mu.copy_(mu)
            for target, value in zip(_cache_tensors(outputs.update), _cache_tensors(update), strict=True):
                target.copy_(value)

        graph = capture_graph(run, self._pool, self._stream)
        logger.info("captured token2wav encoder graph %s", shape)
        return CapturedGraph(graph, inputs, outputs)


def _cache_tensors(cache: ConformerCache) -> tuple[torch.Tensor, ...]:
    return cache.lookahead, cache.upsample, cache.token_kv, cache.frame_kv
