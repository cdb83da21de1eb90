"""HiFT's stride-1 convolutions of time-major activations as one Triton kernel, with the residual block's
elementwise work in its epilogue (CUDA; any device under Triton's interpreter).

HiFT's residual blocks are ~two thirds of its convolutions: per dilation step conv_d then conv_1, each
followed in `ResBlock.fused` by a Snake kernel that adds the bias (and, after conv_1, the block's input)
and writes the next activation. cuDNN runs them as TF32 implicit GEMMs at a fraction of the bound a
64-stream call's shapes allow, and converts some activations between layouts on the way. Here one
program computes a tile of (samples × output channels) of one row as a sum of `taps` matmuls
(samples × input channels by input × output channels; TF32 inputs, float32 sums, as cuDNN's), reading
the activation in place with the tap's shift (zeros outside the row: the convolution's zero padding),
then adds bias and residual and writes the sum and / or its Snake — the same operations, in the same
order, as `snake._snake_time_major_kernel`, so a dilation step is two launches and no elementwise pass.

Weights are taken as (taps, in, out) (`tap_major_weight`), so a tile of them is read along memory.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from torch import Tensor
from triton.language.extra import libdevice

from engines.token2wav.hift import is_time_major


@dataclass(frozen=True)
class ConvTiles:
    """A launch configuration: samples × output channels per program, input channels per matmul step."""

    samples: int = 128
    outputs: int = 64
    inputs: int = 32
    warps: int = 4
    stages: int = 3


DEFAULT_TILES = ConvTiles()


# Lengths and the taps' geometry vary per call and per layer: not specialised on, so one compile per
# channel count and epilogue serves every batch and every (kernel size, dilation) of the model.
@triton.jit(do_not_specialize=["length", "taps", "dilation", "padding"])
def _conv_time_major_kernel(x_ptr, w_ptr, bias_ptr, residual_ptr, alpha_ptr, ends_ptr, sum_ptr, out_ptr,
                            length, taps, dilation, padding, C_IN: tl.constexpr, C_OUT: tl.constexpr,
                            BLOCK_T: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                            HAS_BIAS: tl.constexpr, HAS_RESIDUAL: tl.constexpr, HAS_ENDS: tl.constexpr,
                            WRITE_SUM: tl.constexpr, WRITE_SNAKE: tl.constexpr):
    # Program (row, sample block, output block). x (rows, length, C_IN) and the outputs (rows, length,
    # C_OUT) in memory; w (taps, C_IN, C_OUT).
    row = tl.program_id(0)
    samples = tl.program_id(1) * BLOCK_T + tl.arange(0, BLOCK_T)
    outputs = tl.program_id(2) * BLOCK_N + tl.arange(0, BLOCK_N)
    inputs = tl.arange(0, BLOCK_K)
    x_row = x_ptr + row.to(tl.int64) * length * C_IN
    acc = tl.zeros((BLOCK_T, BLOCK_N), dtype=tl.float32)
    # One loop over (tap, input block) pairs, the implicit GEMM's reduction, so it pipelines as one.
    for step in range(taps * (C_IN // BLOCK_K)):
        tap = step // (C_IN // BLOCK_K)
        start = (step % (C_IN // BLOCK_K)) * BLOCK_K
        source = samples + tap * dilation - padding
        inside = (source >= 0) & (source < length)
        a = tl.load(x_row + source[:, None] * C_IN + (start + inputs)[None, :], mask=inside[:, None],
                    other=0.0)
        w = tl.load(w_ptr + (tap * C_IN + start + inputs)[:, None] * C_OUT + outputs[None, :])
        acc = tl.dot(a, w, acc, input_precision="tf32")
    written = samples[:, None] < length
    offsets = row.to(tl.int64) * length * C_OUT + samples[:, None] * C_OUT + outputs[None, :]
    v = acc
    if HAS_BIAS:
        v = v + tl.load(bias_ptr + outputs)[None, :]
    if HAS_RESIDUAL:
        v = v + tl.load(residual_ptr + offsets, mask=written, other=0.0)
    if WRITE_SUM:
        tl.store(sum_ptr + offsets, v, mask=written)
    if WRITE_SNAKE:
        alpha = tl.load(alpha_ptr + outputs)[None, :]
        wave = libdevice.sin(alpha * v)
        y = v + wave * wave * (1.0 / (alpha + 1e-9))
        if HAS_ENDS:
            y = tl.where(samples[:, None] < tl.load(ends_ptr + row), y, 0.0)
        tl.store(out_ptr + offsets, y, mask=written)


def tap_major_weight(weight: Tensor) -> Tensor:
    """nn.Conv1d's (out, in, taps) weight as the kernel reads it: (taps, in, out), contiguous."""
    return weight.permute(2, 1, 0).contiguous()


def conv_time_major(x: Tensor, weight: Tensor, bias: Tensor | None, dilation: int, padding: int, *,
                    residual: Tensor | None = None, alpha: Tensor | None = None, ends: Tensor | None = None,
                    write_sum: bool = True,
                    tiles: ConvTiles = DEFAULT_TILES) -> tuple[Tensor | None, Tensor | None]:
    """v = conv1d(x, weight, bias, dilation, padding) (+ residual) for time-major float32 x (B, C_in, L)
    and `weight` from `tap_major_weight` (taps, C_in, C_out), stride 1 and a "same" length (padding =
    dilation·(taps − 1)/2); returns (v if `write_sum`, Snake of v with `alpha` (C_out,) if given), both
    new time-major (B, C_out, L) tensors. `ends` (B,) int64 zeroes each row's Snake from its end on, as
    `snake.snake` does."""
    rows, c_in, length = x.shape
    taps, weight_in, c_out = weight.shape
    if not is_time_major(x) or x.dtype != torch.float32:
        raise ValueError("conv_time_major needs a time-major float32 activation")
    if weight_in != c_in or not weight.is_contiguous():
        raise ValueError(f"weight {tuple(weight.shape)} is not a contiguous (taps, {c_in}, out) tensor")
    if 2 * padding != dilation * (taps - 1):
        raise ValueError(f"padding {padding} does not keep the length of a {taps}-tap convolution "
                         f"dilated {dilation}")
    if c_in % tiles.inputs or c_out % tiles.outputs:
        raise ValueError(f"channels {c_in} → {c_out} are not multiples of the tiles {tiles}")
    if residual is not None and (not is_time_major(residual) or residual.shape != (rows, c_out, length)):
        raise ValueError("the residual must be a time-major activation of the output's shape")
    if not write_sum and alpha is None:
        raise ValueError("nothing to write: neither the sum nor its Snake")
    total = _time_major_empty(rows, c_out, length, x) if write_sum else None
    out = _time_major_empty(rows, c_out, length, x) if alpha is not None else None
    if rows and length:
        grid = (rows, triton.cdiv(length, tiles.samples), c_out // tiles.outputs)
        # Pointers the kernel does not use (their flags off) are x's: any tensor of the device serves.
        _conv_time_major_kernel[grid](
            x, weight, x if bias is None else bias, x if residual is None else residual,
            x if alpha is None else alpha, x if ends is None else ends, x if total is None else total,
            x if out is None else out, length, taps, dilation, padding, C_IN=c_in, C_OUT=c_out,
            BLOCK_T=tiles.samples, BLOCK_N=tiles.outputs, BLOCK_K=tiles.inputs, HAS_BIAS=bias is not None,
            HAS_RESIDUAL=residual is not None, HAS_ENDS=ends is not None, WRITE_SUM=total is not None,
            WRITE_SNAKE=out is not None, num_warps=tiles.warps, num_stages=tiles.stages)
    return total, out


def _time_major_empty(rows: int, channels: int, length: int, like: Tensor) -> Tensor:
    return like.new_empty(rows, length, channels).transpose(1, 2)
