"""HiFT's Snake activation, x + sin²(α·x)/α, as one Triton kernel (CUDA only).

In PyTorch the activation is four elementwise kernels (α·x, sin, square, add-multiply), each reading and
writing the whole float32 activation; HiFT runs it 72 times per call, at up to 6 kHz × 64 channels per
row, and on an H100 those kernels were about a third of a 64-stream vocoder call. Here one program
reads a block of one channel of one row, with that channel's α, and writes the result: one read and one
write. Same operations in float32 (libdevice's sin, as PyTorch's), so the result equals the eager one up
to rounding (tests/engines/test_hift_snake.py). For a right-padded batch it also zeroes each row past its
end, so the masks a padded call needs cost no pass of their own. HiFT's decoder keeps its activations
time-major on CUDA (hift.TimeMajorConv1d): those are read in place by a second kernel whose programs
take a tile of samples × all channels, so that its loads run along memory (tests/engines/test_hift_layout.py).
That kernel also serves HiFT's residual blocks fused (hift.ResBlock.fused): it can add a convolution's
bias before the activation (the convolution then runs without it) and, in `residual_snake`, the block's
input too, writing the sum, its Snake or both, so a dilation step's bias adds and residual add cost no
pass of their own.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor
from triton.language.extra import libdevice

from engines.token2wav.hift import is_time_major

BLOCK = 1024  # samples of one channel per program
TIME_MAJOR_TILE = 4096  # samples × channels per program of a time-major activation


@triton.jit
def _snake_kernel(x_ptr, alpha_ptr, ends_ptr, out_ptr, length, channels, BLOCK: tl.constexpr,
                  HAS_ENDS: tl.constexpr):
    row_channel = tl.program_id(0)
    samples = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    inside = samples < length
    offsets = row_channel.to(tl.int64) * length + samples
    alpha = tl.load(alpha_ptr + row_channel % channels).to(tl.float32)
    x = tl.load(x_ptr + offsets, mask=inside, other=0.0).to(tl.float32)
    wave = libdevice.sin(alpha * x)
    y = x + wave * wave * (1.0 / (alpha + 1e-9))
    if HAS_ENDS:
        y = tl.where(samples < tl.load(ends_ptr + row_channel // channels), y, 0.0)
    tl.store(out_ptr + offsets, y, mask=inside)


@triton.jit
def _snake_time_major_kernel(x_ptr, bias_ptr, residual_ptr, alpha_ptr, ends_ptr, sum_ptr, out_ptr, length,
                             channels, BLOCK_T: tl.constexpr, BLOCK_C: tl.constexpr, HAS_ENDS: tl.constexpr,
                             HAS_BIAS: tl.constexpr, HAS_RESIDUAL: tl.constexpr, WRITE_SUM: tl.constexpr,
                             WRITE_SNAKE: tl.constexpr):
    # A row's samples are (length, channels) in memory: a program takes BLOCK_T samples of every
    # channel, so its loads run along the channels, contiguous. v = x (+ bias) (+ residual), in that
    # order (a convolution's output, its bias, the block's input); v and/or snake(v) are written.
    # Half-precision activations (a half-precision decoder, hift.HiFTGenerator.use_decoder_dtype) are
    # computed on in float32 and stored back in their dtype.
    row = tl.program_id(0)
    samples = tl.program_id(1) * BLOCK_T + tl.arange(0, BLOCK_T)
    lanes = tl.arange(0, BLOCK_C)
    inside = (samples[:, None] < length) & (lanes[None, :] < channels)
    offsets = row.to(tl.int64) * length * channels + samples[:, None] * channels + lanes[None, :]
    v = tl.load(x_ptr + offsets, mask=inside, other=0.0).to(tl.float32)
    if HAS_BIAS:
        v = v + tl.load(bias_ptr + lanes, mask=lanes < channels, other=0.0).to(tl.float32)[None, :]
    if HAS_RESIDUAL:
        v = v + tl.load(residual_ptr + offsets, mask=inside, other=0.0).to(tl.float32)
    if WRITE_SUM:
        tl.store(sum_ptr + offsets, v, mask=inside)
    if WRITE_SNAKE:
        alpha = tl.load(alpha_ptr + lanes, mask=lanes < channels, other=1.0).to(tl.float32)[None, :]
        wave = libdevice.sin(alpha * v)
        y = v + wave * wave * (1.0 / (alpha + 1e-9))
        if HAS_ENDS:
            y = tl.where(samples[:, None] < tl.load(ends_ptr + row), y, 0.0)
        tl.store(out_ptr + offsets, y, mask=inside)


def snake(x: Tensor, alpha: Tensor, ends: Tensor | None = None, bias: Tensor | None = None) -> Tensor:
    """Snake of x (B, C, L) on CUDA with α (C,), computed in float32 whatever x's dtype (float32, bfloat16
    or float16, `hift.KERNEL_DTYPES`) and stored in it: a new tensor, in x's memory layout where that is
    (B, C, L) or time-major (B, L, C), else (B, C, L). `ends` (B,) int64: each row's output is zero
    from that position on (a right-padded batch's rows, hift.RowEnds). `bias` (C,): Snake of x + bias
    (a convolution's output without its bias; time-major x only)."""
    time_major = is_time_major(x)
    if not time_major:
        if bias is not None:
            raise ValueError("snake adds a bias to time-major activations only")
        x = x.contiguous()
    rows, channels, length = x.shape
    out = torch.empty_like(x)  # its strides are x's
    if not out.numel():
        return out
    alpha = alpha.contiguous()
    if time_major:
        _time_major(x, bias, None, alpha, ends, None, out)
    else:
        grid = (rows * channels, triton.cdiv(length, BLOCK))
        _snake_kernel[grid](x, alpha, x if ends is None else ends, out, length, channels, BLOCK=BLOCK,
                            HAS_ENDS=ends is not None)
    return out


def residual_snake(x: Tensor, bias: Tensor | None, residual: Tensor, alpha: Tensor | None,
                   ends: Tensor | None = None) -> tuple[Tensor, Tensor | None]:
    """A residual block's step in one pass: v = x + bias + residual (x a convolution's time-major output
    without its bias, `residual` the block's input, time-major, same shape), and Snake of v with α as
    `snake` computes it (None without α: v alone). Both new tensors are time-major."""
    if not (is_time_major(x) and is_time_major(residual)) or x.shape != residual.shape:
        raise ValueError("residual_snake needs time-major x and residual of one shape")
    total = torch.empty_like(x)
    out = None if alpha is None else torch.empty_like(x)
    if total.numel():
        _time_major(x, bias, residual, None if alpha is None else alpha.contiguous(), ends, total, out)
    return total, out


def _time_major(x: Tensor, bias: Tensor | None, residual: Tensor | None, alpha: Tensor | None,
                ends: Tensor | None, total: Tensor | None, out: Tensor | None) -> None:
    """Launch `_snake_time_major_kernel`: the tensors not given are not read (or written)."""
    rows, channels, length = x.shape
    block_c = triton.next_power_of_2(channels)
    block_t = max(1, TIME_MAJOR_TILE // block_c)
    grid = (rows, triton.cdiv(length, block_t))
    # Pointers the kernel does not use (their flags off) are x's: any tensor of the device serves.
    _snake_time_major_kernel[grid](
        x, x if bias is None else bias, x if residual is None else residual, x if alpha is None else alpha,
        x if ends is None else ends, x if total is None else total, x if out is None else out, length,
        channels, BLOCK_T=block_t, BLOCK_C=block_c, HAS_ENDS=ends is not None, HAS_BIAS=bias is not None,
        HAS_RESIDUAL=residual is not None, WRITE_SUM=total is not None, WRITE_SNAKE=out is not None)
