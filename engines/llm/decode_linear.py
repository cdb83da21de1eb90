"""A decode step's projections for few rows, with the work around them fused, as Triton kernels (CUDA only).

A decode step multiplies a handful of rows by every weight of the model: each matmul is bound by reading
its weights and by the launch, not by arithmetic. The general path runs per layer RMSNorm, the qkv
matmul, the output projection, RMSNorm, gate|up, SwiGLU, down and cuBLAS's split-K reduction: 9 launches
besides attention (H200, one row: ~27 µs of them, against ~7 µs to read the layer's 30 MB of weights).
Here a layer is 4 launches besides attention, for up to 16 rows:

- `norm_linear`: RMSNorm of the residual rows folded into the projection's input: every program
  recomputes the statistic of its rows (a row is 896 values) and, for `tl.dot`, rounds the normalised
  input to the model dtype as the norm kernel would, then the matmul and the bias. Serves q|k|v.
- the same with `gated`: a program takes a block of gate columns and the same block of up columns and
  writes silu(gate) · up (gate and up rounded to the model dtype first, as the general path's matmul
  output is); the 2 × 4864-wide intermediate is never written.
- `add_linear_`: `residual += x @ W^T` in place, the positions split across programs where there are too
  few column blocks to fill the GPU; a column block's split that finishes last adds the partials (in
  split order, so the result does not depend on timing) and the residual, as the decode attention
  kernel merges its splits. Serves the output projection and down.

`norm_linear` of a single row (one stream decoding alone, the latency case) multiplies without tl.dot,
whose smallest tile is 16 rows, in fp32 throughout: its normalised input is not rounded to the model
dtype. `add_linear_` of a single row is such a GEMV too, over all of K in each program (no split, so no
partials, counters or second pass). Past 16 rows cuBLAS's matmuls are faster and the general path runs.
The results equal the general path's up to the order of fp32 sums and that rounding
(tests/engines/test_llm_decode_linear.py).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from engines.llm.programmatic_launch import launch_options

# Tiles, warps and pipeline stages per kernel, the fastest of a sweep on an H200 (docs/benchmarks.md, 25th
# session): (BLOCK_N output columns, BLOCK_K input positions per iteration, num_warps, num_stages).
ONE_ROW_TILE = (16, 128, 8, 3)  # `_norm_gemv_kernel`: q|k|v is 72 programs, gate|up 304
NORM_TILE = (16, 128, 8, 3)
GATED_TILE = (32, 128, 8, 3)
ADD_TILE = (32, 128, 4, 5)
# `_add_gemv_kernel` (one row's adds; its K loop is unrolled): (BLOCK_N, BLOCK_K, num_warps) for rows of
# at most SHORT_ROW positions (o_proj's 896) and for longer ones (down's 4864), the fastest of a sweep on
# an H200 (docs/benchmarks.md, thirtieth session: 1.6 and 4.3 µs against the split-K kernel's 3.3 and 5.9).
SHORT_ROW = 1024
ONE_ROW_ADD_TILE_SHORT = (8, 64, 8)
ONE_ROW_ADD_TILE_LONG = (4, 256, 16)
# Programs `add_linear_` aims for (two per multiprocessor of an H100): 896 output columns are 28 blocks,
# whose positions are split in up to MAX_SPLITS.
TARGET_PROGRAMS = 264
MAX_SPLITS = 8
MAX_ROWS = 16  # tl.dot's row block; more rows take the general path (past 16 rows cuBLAS is faster)


@triton.jit
def _row_rstd(x_ptr, rows, real_rows, stride_x, K: tl.constexpr, eps, BLOCK_K: tl.constexpr,
              BLOCK_M: tl.constexpr):
    """1 / sqrt(mean(x²) + eps) of each row (fp32), as RMSNorm computes it."""
    # Squares summed elementwise, reduced across threads once at the end (a reduction per iteration
    # serialises the loop's loads).
    squares = tl.zeros([BLOCK_M, BLOCK_K], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        x = tl.load(x_ptr + rows[:, None] * stride_x + k[None, :], mask=real_rows[:, None] & (k[None, :] < K),
                    other=0.0).to(tl.float32)
        squares += x * x
    return tl.rsqrt(tl.sum(squares, 1) / K + eps)


@triton.jit
def _norm_gemv_kernel(
    x_ptr, norm_ptr, w_ptr, bias_ptr, out_ptr, eps,
    K: tl.constexpr, N: tl.constexpr, GATED: tl.constexpr, HAS_BIAS: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr,
):
    """`_norm_linear_kernel` for one row, without tl.dot (whose 16-row tile would be 15/16 padding): the
    products summed elementwise in fp32 and reduced once at the end. The norm's statistic is summed in
    the same pass and applies to the sums (a prologue pass over the row delays every weight load by its
    latency: +3 µs a layer on an H200), so the normalised input is never rounded to the model dtype.
    The K loop is unrolled at compile time so that every step's loads are in flight together: as a
    loop, ptxas waited for each step's loads before the next step's (H200, one row: q|k|v 4.1 -> 2.4 µs,
    gate|up 7.1 -> 6.1 µs; docs/benchmarks.md, 28th session)."""
    if PDL:  # programmatic_launch.py: nothing is read or written before the previous kernel has ended
        tl.extra.cuda.gdc_wait()
    columns = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    real_columns = columns < N
    dtype = w_ptr.dtype.element_ty
    squares = tl.zeros([BLOCK_K], tl.float32)
    acc = tl.zeros([BLOCK_N, BLOCK_K], tl.float32)
    up_acc = tl.zeros([BLOCK_N, BLOCK_K], tl.float32)
    for k0 in tl.static_range(0, K, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        real_k = k < K
        x = tl.load(x_ptr + k, mask=real_k, other=0.0).to(tl.float32)
        squares += x * x
        weighted = x * tl.load(norm_ptr + k, mask=real_k, other=0.0).to(tl.float32)
        weight_mask = real_columns[:, None] & real_k[None, :]
        weights = tl.load(w_ptr + columns[:, None] * K + k[None, :], mask=weight_mask, other=0.0)
        acc += weights.to(tl.float32) * weighted[None, :]
        if GATED:
            up = tl.load(w_ptr + (columns[:, None] + N) * K + k[None, :], mask=weight_mask, other=0.0)
            up_acc += up.to(tl.float32) * weighted[None, :]
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()
    rstd = tl.rsqrt(tl.sum(squares, 0) / K + eps)
    out = tl.sum(acc, 1) * rstd
    if HAS_BIAS:
        out += tl.load(bias_ptr + columns, mask=real_columns, other=0.0).to(tl.float32)
    if GATED:
        gate = out.to(dtype).to(tl.float32)
        out = gate * tl.sigmoid(gate) * (tl.sum(up_acc, 1) * rstd).to(dtype).to(tl.float32)
    tl.store(out_ptr + columns, out.to(dtype), mask=real_columns)


@triton.jit
def _add_gemv_kernel(
    x_ptr, w_ptr, residual_ptr,
    K: tl.constexpr, N: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr,
):
    """`_add_linear_kernel` for one row: residual[block] += x @ W[block]^T with the products summed
    elementwise in fp32 and reduced once at the end, every program over the whole row. The split-K
    kernel's second pass (partials stored, a counter, the last split's loads of them) is two dependent
    trips to global memory; here a program's only dependent trip is the residual's. The K loop is
    unrolled, as in `_norm_gemv_kernel`, so that every step's loads are in flight together."""
    if PDL:  # programmatic_launch.py: nothing is read or written before the previous kernel has ended
        tl.extra.cuda.gdc_wait()
    columns = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    real_columns = columns < N
    acc = tl.zeros([BLOCK_N, BLOCK_K], tl.float32)
    for k0 in tl.static_range(0, K, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        real_k = k < K
        x = tl.load(x_ptr + k, mask=real_k, other=0.0).to(tl.float32)
        weights = tl.load(w_ptr + columns[:, None] * K + k[None, :],
                          mask=real_columns[:, None] & real_k[None, :], other=0.0)
        acc += weights.to(tl.float32) * x[None, :]
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()
    total = tl.sum(acc, 1) + tl.load(residual_ptr + columns, mask=real_columns, other=0.0).to(tl.float32)
    tl.store(residual_ptr + columns, total.to(residual_ptr.dtype.element_ty), mask=real_columns)


# The row count is not specialised on: Triton would compile M = 16 (divisible by 16) apart from 2..15.
@triton.jit(do_not_specialize=["M"])
def _norm_linear_kernel(
    x_ptr, norm_ptr, w_ptr, bias_ptr, out_ptr, M, stride_x, stride_out, eps,
    K: tl.constexpr, N: tl.constexpr, GATED: tl.constexpr, HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr,
):
    """out[:, block] = rms_norm(x) @ W[block]^T (+ bias), or with GATED silu(gate) · up of the block's
    gate columns and the same columns of the up half (rows N.. of W)."""
    if PDL:
        tl.extra.cuda.gdc_wait()
    columns = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    rows = tl.arange(0, BLOCK_M)
    real_rows = rows < M
    real_columns = columns < N
    dtype = w_ptr.dtype.element_ty
    rstd = _row_rstd(x_ptr, rows, real_rows, stride_x, K, eps, BLOCK_K, BLOCK_M)
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    up_acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        real_k = k < K
        x = tl.load(x_ptr + rows[:, None] * stride_x + k[None, :], mask=real_rows[:, None] & real_k[None, :],
                    other=0.0).to(tl.float32)
        norm_weight = tl.load(norm_ptr + k, mask=real_k, other=0.0).to(tl.float32)
        normed = (x * rstd[:, None] * norm_weight[None, :]).to(dtype)
        weight_mask = real_columns[:, None] & real_k[None, :]
        weights = tl.load(w_ptr + columns[:, None] * K + k[None, :], mask=weight_mask, other=0.0)
        acc += tl.dot(normed, tl.trans(weights))
        if GATED:
            up = tl.load(w_ptr + (columns[:, None] + N) * K + k[None, :], mask=weight_mask, other=0.0)
            up_acc += tl.dot(normed, tl.trans(up))
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()
    if HAS_BIAS:
        acc += tl.load(bias_ptr + columns, mask=real_columns, other=0.0).to(tl.float32)[None, :]
    if GATED:  # from gate and up rounded as the matmul's output is; the product rounded once, as compiled
        gate = acc.to(dtype).to(tl.float32)
        acc = gate * tl.sigmoid(gate) * up_acc.to(dtype).to(tl.float32)
    out_mask = real_rows[:, None] & real_columns[None, :]
    tl.store(out_ptr + rows[:, None] * stride_out + columns[None, :], acc.to(dtype), mask=out_mask)


@triton.jit(do_not_specialize=["M"])
def _add_linear_kernel(
    x_ptr, w_ptr, residual_ptr, part_ptr, counters_ptr, M, stride_x, stride_residual,
    K: tl.constexpr, N: tl.constexpr, SPLIT_K: tl.constexpr, SPLITS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr,
):
    """residual[:, block] += x @ W[block]^T over this program's split of the K positions."""
    if PDL:
        tl.extra.cuda.gdc_wait()
    block = tl.program_id(0)
    split = tl.program_id(1)
    columns = block * BLOCK_N + tl.arange(0, BLOCK_N)
    rows = tl.arange(0, BLOCK_M)
    real_rows = rows < M
    real_columns = columns < N
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for step in range(SPLIT_K // BLOCK_K):  # the last split's steps past K load nothing
        k = split * SPLIT_K + step * BLOCK_K + tl.arange(0, BLOCK_K)
        real_k = k < K
        x = tl.load(x_ptr + rows[:, None] * stride_x + k[None, :], mask=real_rows[:, None] & real_k[None, :],
                    other=0.0)
        weights = tl.load(w_ptr + columns[:, None] * K + k[None, :],
                          mask=real_columns[:, None] & real_k[None, :], other=0.0)
        acc += tl.dot(x, tl.trans(weights))
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()
    out_mask = real_rows[:, None] & real_columns[None, :]
    residual_ptrs = residual_ptr + rows[:, None] * stride_residual + columns[None, :]
    if SPLITS == 1:
        total = acc + tl.load(residual_ptrs, mask=out_mask, other=0.0).to(tl.float32)
        tl.store(residual_ptrs, total.to(residual_ptr.dtype.element_ty), mask=out_mask)
    else:
        tile = rows[:, None] * BLOCK_N + tl.arange(0, BLOCK_N)[None, :]
        tl.store(part_ptr + (block * SPLITS + split) * BLOCK_M * BLOCK_N + tile, acc)
        # As in decode_attention: the barrier, then a release/acquire increment at GPU scope orders every
        # split's stores before the last one's loads (which bypass L1); it resets the counter.
        tl.debug_barrier()
        arrived = tl.atomic_add(counters_ptr + block, 1, sem="acq_rel", scope="gpu")
        if arrived == SPLITS - 1:
            tl.atomic_xchg(counters_ptr + block, 0, sem="relaxed", scope="gpu")
            total = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
            for part in tl.static_range(SPLITS):
                total += tl.load(part_ptr + (block * SPLITS + part) * BLOCK_M * BLOCK_N + tile,
                                 cache_modifier=".cg")
            total += tl.load(residual_ptrs, mask=out_mask, other=0.0).to(tl.float32)
            tl.store(residual_ptrs, total.to(residual_ptr.dtype.element_ty), mask=out_mask)


def split_length(columns: int, positions: int) -> int:
    """Input positions per program of `add_linear_` (a multiple of its BLOCK_K): split until the column
    blocks times the splits reach TARGET_PROGRAMS."""
    block_n, block_k = ADD_TILE[:2]
    blocks = triton.cdiv(columns, block_n)
    splits = min(MAX_SPLITS, max(1, TARGET_PROGRAMS // blocks), triton.cdiv(positions, block_k))
    return triton.cdiv(triton.cdiv(positions, splits), block_k) * block_k


class DecodeLinears:
    """The kernels for up to MAX_ROWS rows, with the split partials and counters of `add_linear_`
    allocated once (CUDA graphs captured with them keep pointing at them); what
    `qwen2.LayerKernels.decode_linears` takes. Calls run one after another on one stream."""

    def __init__(self, hidden: int, intermediate: int, device: torch.device,
                 programmatic_launch: bool = False) -> None:
        """`programmatic_launch`: launch with PDL (programmatic_launch.py; the caller checks `supported`)."""
        self.programmatic_launch = programmatic_launch
        blocks = triton.cdiv(hidden, ADD_TILE[0])
        widest = max(blocks * triton.cdiv(positions, split_length(hidden, positions))
                     for positions in (hidden, intermediate))
        self.parts = torch.empty(widest * MAX_ROWS * ADD_TILE[0], dtype=torch.float32, device=device)
        self.counters = torch.zeros(blocks, dtype=torch.int32, device=device)
        self.residual_width = hidden  # what the partials and counters are sized for

    @staticmethod
    def serves(rows: int) -> bool:
        return rows <= MAX_ROWS

    def norm_linear(self, x: Tensor, norm_weight: Tensor, eps: float, weight: Tensor, bias: Tensor | None,
                    gated: bool = False) -> Tensor:
        """rms_norm(x) @ weight^T + bias for rows x [M, K] (unit stride along K); with `gated`, weight
        is [gate | up] (2N, K) and the result silu(gate) · up [M, N]."""
        rows, positions = x.shape
        columns = weight.shape[0] // 2 if gated else weight.shape[0]
        _check(x, weight, positions, rows)
        out = torch.empty(rows, columns, dtype=weight.dtype, device=x.device)
        bias_or_any = bias if bias is not None else weight
        if rows == 1:
            block_n, block_k, warps, stages = ONE_ROW_TILE
            _norm_gemv_kernel[(triton.cdiv(columns, block_n),)](
                x, norm_weight, weight, bias_or_any, out, eps, K=positions, N=columns, GATED=gated,
                HAS_BIAS=bias is not None, BLOCK_N=block_n, BLOCK_K=block_k, PDL=self.programmatic_launch,
                num_warps=warps, num_stages=stages,
                **launch_options(self.programmatic_launch),
            )
            return out
        block_n, block_k, warps, stages = GATED_TILE if gated else NORM_TILE
        _norm_linear_kernel[(triton.cdiv(columns, block_n),)](
            x, norm_weight, weight, bias_or_any, out, rows, x.stride(0), out.stride(0), eps, K=positions,
            N=columns, GATED=gated, HAS_BIAS=bias is not None, BLOCK_M=MAX_ROWS, BLOCK_N=block_n,
            BLOCK_K=block_k, PDL=self.programmatic_launch, num_warps=warps, num_stages=stages,
            **launch_options(self.programmatic_launch),
        )
        return out

    def add_linear_(self, residual: Tensor, x: Tensor, weight: Tensor) -> Tensor:
        """`residual += x @ weight^T` for rows x [M, K] and residual [M, N] (both unit stride along
        their last axis); returns residual. One row takes `add_gemv_`, more `add_split_`."""
        if x.shape[0] == 1:
            return self.add_gemv_(residual, x, weight)
        return self.add_split_(residual, x, weight)

    def add_gemv_(self, residual: Tensor, x: Tensor, weight: Tensor) -> Tensor:
        """`add_linear_` of one row through `_add_gemv_kernel`."""
        rows, positions, columns = _checked_add(residual, x, weight)
        if rows != 1:
            raise ValueError(f"add_gemv_ takes one row, got {rows}")
        block_n, block_k, warps = ONE_ROW_ADD_TILE_SHORT if positions <= SHORT_ROW else ONE_ROW_ADD_TILE_LONG
        _add_gemv_kernel[(triton.cdiv(columns, block_n),)](
            x, weight, residual, K=positions, N=columns, BLOCK_N=block_n, BLOCK_K=block_k,
            PDL=self.programmatic_launch, num_warps=warps, num_stages=1,
            **launch_options(self.programmatic_launch),
        )
        return residual

    def add_split_(self, residual: Tensor, x: Tensor, weight: Tensor) -> Tensor:
        """`add_linear_` of up to MAX_ROWS rows through the split-K `_add_linear_kernel`."""
        rows, positions, columns = _checked_add(residual, x, weight)
        block_n, block_k, warps, stages = ADD_TILE
        split = split_length(columns, positions)
        splits = triton.cdiv(positions, split)
        blocks = triton.cdiv(columns, block_n)
        if columns != self.residual_width or blocks * splits * MAX_ROWS * block_n > self.parts.numel():
            raise ValueError(f"add_linear_ was sized for {self.residual_width} output columns and the "
                             f"model's input widths; got a weight of {tuple(weight.shape)}")
        _add_linear_kernel[(blocks, splits)](
            x, weight, residual, self.parts, self.counters, rows, x.stride(0), residual.stride(0),
            K=positions, N=columns, SPLIT_K=split, SPLITS=splits, BLOCK_M=MAX_ROWS, BLOCK_N=block_n,
            BLOCK_K=block_k, PDL=self.programmatic_launch, num_warps=warps, num_stages=stages,
            **launch_options(self.programmatic_launch),
        )
        return residual


def _checked_add(residual: Tensor, x: Tensor, weight: Tensor) -> tuple[int, int, int]:
    """The rows, input positions and output columns of `residual += x @ weight^T`, checked."""
    rows, positions = x.shape
    columns = weight.shape[0]
    _check(x, weight, positions, rows)
    if residual.shape != (rows, columns) or residual.stride(1) != 1:
        raise ValueError(f"add_linear_ needs a residual of {(rows, columns)} with unit column stride")
    return rows, positions, columns


def _check(x: Tensor, weight: Tensor, positions: int, rows: int) -> None:
    if x.dtype != weight.dtype:
        raise ValueError(f"rows and weight must share a dtype, got {x.dtype} and {weight.dtype}")
    if weight.shape[1] != positions or not weight.is_contiguous():
        raise ValueError(f"a contiguous weight of {positions} input positions is needed, "
                         f"got {tuple(weight.shape)}")
    if x.stride(1) != 1 or rows > MAX_ROWS:
        raise ValueError(f"rows with unit stride, at most {MAX_ROWS}, are needed; got {tuple(x.shape)}")
