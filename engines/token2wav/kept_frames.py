"""The keys|values a chunk's solve keeps for each row's next chunk, gathered from the row's own cache and
the chunk's new frames by one Triton kernel (CUDA only).

Per Euler step `ConditionalCFM.solve_ragged` keeps, for every row, the frames at the row's `keep`
positions of [own cache (T_own frames), chunk (T frames)]. PyTorch needs the two joined first
(`word_copies.gather_words`: every frame of both read and written once more, then gathered): at 64 streams
with a 4 s prompt's 200 own frames and 50 new ones, ~1 GB read and written again per step. Here each
program reads the kept frames from whichever tensor holds them and writes them: the join is gone, and the
bytes moved are those of the gather alone. The values are copied, not computed: the result equals
`gather_words`' bit for bit (tests/engines/test_kept_frames.py).
"""

from __future__ import annotations

import triton
import triton.language as tl
from torch import Tensor

from engines.word_copies import word_views

TILE = 2048  # frames × words per program


# The sizes that vary with the batch are not specialised on (Triton would compile a variant per divisibility
# of each): one compile per dtype and model serves every batch, none on the serving path after the
# warm-up. `heads` and `words` are the model's, and their divisibility lets loads be vectorised.
@triton.jit(do_not_specialize=["rows", "own_frames", "new_frames", "kept"])
def _gather_kept_kernel(own_ptr, new_ptr, keep_ptr, out_ptr, rows, heads, own_frames, new_frames, kept,
                        words, BLOCK_K: tl.constexpr, BLOCK_W: tl.constexpr):
    # Program (lane, k-block): lane = (block·rows + row)·heads + head of (depth, rows, heads, frames, words)
    # tensors; it writes BLOCK_K kept frames of that lane.
    lane = tl.program_id(0)
    positions = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)
    lanes_words = tl.arange(0, BLOCK_W)
    row = (lane // heads) % rows
    wanted = positions < kept
    frame = tl.load(keep_ptr + row.to(tl.int64) * kept + positions, mask=wanted, other=0)
    from_own = frame < own_frames
    written = wanted[:, None] & (lanes_words[None, :] < words)
    # A position past both tensors (a bad index) gives zeros instead of faulting the device.
    inside = written & (frame < own_frames + new_frames)[:, None]
    own_at = (lane.to(tl.int64) * own_frames + frame[:, None]) * words + lanes_words[None, :]
    new_at = (lane.to(tl.int64) * new_frames + (frame - own_frames)[:, None]) * words + lanes_words[None, :]
    from_own_tile = from_own[:, None]
    values = tl.where(from_own_tile,
                      tl.load(own_ptr + own_at, mask=inside & from_own_tile, other=0),
                      tl.load(new_ptr + new_at, mask=inside & ~from_own_tile, other=0))
    out_at = (lane.to(tl.int64) * kept + positions[:, None]) * words + lanes_words[None, :]
    tl.store(out_ptr + out_at, values, mask=written)


def gather_kept_frames(own: Tensor, new: Tensor, keep: Tensor, out: Tensor) -> None:
    """out[d, r, h, k] = [own, new][d, r, h, keep[r, k]] along the frames (dim 3): own (D, R, H, T_own, W),
    new (D, R, H, T, W) and out (D, R, H, K, W) contiguous, of one dtype and device; keep (R, K) int64.
    T_own may be 0. Moves 8-byte words where the layouts allow (as `word_copies` does)."""
    if not (own.is_contiguous() and new.is_contiguous() and out.is_contiguous() and keep.is_contiguous()):
        raise ValueError("gather_kept_frames needs contiguous tensors")
    if own.shape[:3] != new.shape[:3] or out.shape[:3] != new.shape[:3] or own.shape[4] != new.shape[4]:
        raise ValueError(f"own {tuple(own.shape)}, new {tuple(new.shape)} and out {tuple(out.shape)} "
                         "differ outside the frames")
    if keep.shape != (new.shape[1], out.shape[3]):
        raise ValueError(f"keep {tuple(keep.shape)} for {new.shape[1]} rows and {out.shape[3]} kept frames")
    if not out.numel():
        return
    own_view, new_view, out_view = word_views(own, new, out) or [own, new, out]
    depth, rows, heads, kept, words = out_view.shape
    block_w = triton.next_power_of_2(words)
    block_k = max(1, TILE // block_w)
    grid = (depth * rows * heads, triton.cdiv(kept, block_k))
    # An empty own cache has no storage to point at: the kernel never reads it (no frame is below 0).
    _gather_kept_kernel[grid](own_view if own.numel() else new_view, new_view, keep, out_view, rows, heads,
                              own.shape[3], new.shape[3], kept, words, BLOCK_K=block_k, BLOCK_W=block_w)
