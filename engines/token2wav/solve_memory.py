"""Device bytes of one batched CFM solve, and the memory cap that bounds a batch's rows by them.

Under the reference DiT cache rule (dit_cache.py) a stream's estimator cache grows to L_p + 100 frames,
so the rows of a later chunk carry hundreds of cached frames while a first chunk carries none; a row cap
that suits first chunks (64 rows) does not fit an 80 GB GPU for long caches (docs/benchmarks.md, issue
#13). `SolveMemory` therefore bounds each batch by bytes, per padded `SolveShape`:

    bytes(shape) = static(shape) + batch · transient_row(shape)

- static: the solve's input and output tensors (`SolverLayout.input_specs` / `output_specs`; a CUDA
  graph's static buffers). Per row the large ones are the own cache read and the kept cache written,
  `u · (own_frames + kept_frames)` with u = steps · depth · 2 (guidance) · heads · 2 · head_dim · itemsize
  bytes per cached frame (640 KiB at full size in fp16); the prompt's cache is held once per batch.
- transient_row: what `ConditionalCFM.solve_ragged` holds per row while one step runs: the step's new
  keys and values for the chunk and the [own cache, chunk] history they are gathered from,
  u / steps · (own_frames + 2 · frames) (the kept cache goes straight into the output).

So a row needs about u · (own + kept) + u / steps · (own + 2 · frames), plus ~3 MiB of conv caches and
chunk tensors: ~25 MiB for a first chunk (own 0, 30 frames), ~580 MiB for a 200-token chunk with a
400-frame cache (at full size; 64 such rows would need 36 GiB, 64 first chunks 1.6 GiB). A batch may
take a shape only while `bytes(shape) ≤ budget` (a lone row always runs); the warm-up runs the schedule
through the same planning, so it captures only the shapes the cap allows. Keep the transient term in step
with `solve_ragged` if its working tensors change.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from engines.token2wav.batching import SolveShape
from engines.token2wav.dit_cache import cached_frame_elements
from engines.token2wav.graphs import SolverLayout


@dataclass(frozen=True)
class SolveMemory:
    """The bytes of a solve of `layout` (see the module docstring) against `budget` bytes."""

    layout: SolverLayout
    budget: int

    def __post_init__(self) -> None:
        if self.budget < 1:
            raise ValueError(f"a solve memory budget must be positive, got {self.budget} bytes")

    @property
    def cached_frame_bytes(self) -> int:
        """u: one cached frame of one row in every step and block, both guidance halves."""
        layout = self.layout
        elements = cached_frame_elements(layout.steps, layout.depth, layout.heads, layout.head_dim)
        return elements * layout.dtype.itemsize

    def static_bytes(self, shape: SolveShape) -> int:
        """The solve's input and output tensors."""
        specs = (self.layout.input_specs(shape), self.layout.output_specs(shape))
        return sum(math.prod(size) * dtype.itemsize for spec in specs for size, dtype in spec.values())

    def transient_row_bytes(self, shape: SolveShape) -> int:
        """What the solve holds per row while it runs, beyond its inputs and outputs."""
        u = self.cached_frame_bytes
        return u // self.layout.steps * (shape.own_frames + 2 * shape.frames)

    def bytes(self, shape: SolveShape) -> int:
        return self.static_bytes(shape) + shape.batch * self.transient_row_bytes(shape)

    def fits(self, shape: SolveShape) -> bool:
        """Whether a solve of `shape` stays within the budget (what `plan_batches` asks)."""
        return self.bytes(shape) <= self.budget

