"""The bytes of a batched DiT solve (engines/token2wav/solve_memory.py) and the row caps they give."""

from __future__ import annotations

import pytest
import torch

from engines.config import ModelConfigs
from engines.token2wav.batching import Buckets, SolveShape
from engines.token2wav.graphs import SolverLayout
from engines.token2wav.solve_memory import SolveMemory

MIB = 1 << 20
GIB = 1 << 30
FULL = SolverLayout.of(ModelConfigs.full().dit_flow, torch.float16, torch.device("cpu"))
PROMPT = 512  # a prompt-frames bucket of the released voices (≤ 10 s prompts)


def test_static_bytes_are_the_solves_input_and_output_tensors() -> None:
    layout = SolverLayout.of(ModelConfigs.tiny().dit_flow, torch.float32, torch.device("cpu"))
    memory = SolveMemory(layout, GIB)
    for shape in (SolveShape(1, 30, 0, 24, 30), SolveShape(8, 50, 100, 64, 150)):
        inputs = layout.inputs(shape, lambda name, size, dtype: torch.zeros(size, dtype=dtype))
        outputs = layout.outputs(shape, lambda name, size, dtype: torch.zeros(size, dtype=dtype))
        tensors = [*vars(inputs).values(), *vars(outputs).values()]
        assert memory.static_bytes(shape) == sum(t.nbytes for t in tensors)


def test_the_formula_at_full_size() -> None:
    """u = steps · depth · 2 · heads · 2 · head_dim · 2 bytes per cached frame; a row needs about
    u · (own + kept) + u / steps · (own + 2 · frames) beyond the per-batch prompt cache."""
    memory = SolveMemory(FULL, 16 * GIB)
    u = 10 * 16 * 2 * 8 * 2 * 64 * 2
    assert memory.cached_frame_bytes == u == 640 * 1024

    def row(frames: int, own: int, kept: int) -> int:
        one, two = SolveShape(1, frames, own, PROMPT, kept), SolveShape(2, frames, own, PROMPT, kept)
        return memory.bytes(two) - memory.bytes(one)

    def cached(frames: int, own: int, kept: int) -> int:
        return u * (own + kept) + u // 10 * (own + 2 * frames)

    # On top: the conv caches read and written (2 · 1.25 MiB) and the chunk's mu, mel, mask and indices.
    for frames, own, kept in ((30, 0, 30), (400, 400, 400)):
        assert 0 < row(frames, own, kept) - cached(frames, own, kept) < 3 * MIB
    assert 22 * MIB < row(30, 0, 30) < 26 * MIB
    assert 570 * MIB < row(400, 400, 400) < 580 * MIB


def test_a_16_gib_cap_keeps_64_first_chunks_and_splits_long_caches() -> None:
    """Under the reference cache rule (own caches up to L_p + 100 frames) the 64-row graphs of long
    caches ran an 80 GB H100 out of memory (docs/benchmarks.md); the cap allows 64 first chunks and
    short caches, 16 rows of 400-frame caches."""
    memory = SolveMemory(FULL, 16 * GIB)
    buckets = Buckets()

    def most_rows(frames: int, own: int, kept: int) -> int:
        fitting = [b for b in buckets.batch if memory.fits(SolveShape(b, frames, own, PROMPT, kept))]
        return max(fitting, default=1)

    assert most_rows(30, 0, 30) == 64  # first chunks
    assert most_rows(50, 100, 100) == 64
    assert most_rows(100, 100, 200) == 64
    assert most_rows(200, 200, 400) == 32
    assert most_rows(400, 400, 400) == 16
    assert not memory.fits(SolveShape(64, 200, 200, PROMPT, 400))  # the shape whose capture ran out


def test_a_budget_is_positive() -> None:
    with pytest.raises(ValueError, match="positive"):
        SolveMemory(FULL, 0)
