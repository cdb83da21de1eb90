"""Attention over two key sets at once, for the DiT's batched streaming chunks (dit.SplitKeys).

A batch's rows attend to [shared prompt keys, own keys]. Laying the shared prompt out per row, so that one
fused kernel sees each row's keys, copies rows × prompt frames of keys and values in every block of every
Euler step; at 64 streams those copies cost as much as the attention itself. Instead:
- the prompt part is one attention per guidance half: the queries of all the half's rows against the
  half's prompt keys, each query with its row's bias (the prompt keys are read in place);
- the own part is one attention per row over its own cache and its chunk;
- both parts return their log-sum-exp, and `merge_attention` weighs them by it, which is the softmax
  over the union of the keys (up to float rounding).

`attention_with_lse` is a custom op so that torch.compile keeps the kernel and its strides as they are.
On CUDA it runs a fused kernel that takes an additive bias and returns the log-sum-exp: cuDNN's on Hopper
in half precision (about twice as fast as the memory-efficient kernel at the DiT's shapes on an H100,
benchmarks/dit_kernels.py), the memory-efficient kernel otherwise; elsewhere plain matmuls and a softmax
in float32.
"""

from __future__ import annotations

import functools
import math

import torch

BIAS_ALIGNMENT = 16  # the memory-efficient kernel needs bias rows whose stride is a multiple of 16
CUDNN_DTYPES = (torch.float16, torch.bfloat16)  # cuDNN's fused attention has no float32 kernel
CUDNN_MIN_CAPABILITY = (9, 0)  # where it was measured faster (H100); older GPUs keep the other kernel


@functools.cache
def _cudnn_fused_attention(device: torch.device) -> bool:
    """Whether `device` runs cuDNN's fused attention (cuDNN 9 or later, a Hopper or newer GPU)."""
    version = torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None
    capability = torch.cuda.get_device_capability(device)
    return version is not None and version >= 90000 and capability >= CUDNN_MIN_CAPABILITY


def _runs_cudnn_attention(q: torch.Tensor) -> bool:
    """Whether queries `q` go to cuDNN's fused attention: half precision on a device it suits, with cuDNN
    on (an operator who turns `torch.backends.cudnn.enabled` off gets the memory-efficient kernel)."""
    return (q.is_cuda and q.dtype in CUDNN_DTYPES and torch.backends.cudnn.enabled
            and _cudnn_fused_attention(q.device))


@torch.library.custom_op("cosyvoice::attention_with_lse", mutates_args=())
def attention_with_lse(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax attention of q (N, H, M, d) over k, v (N, H, S, d), scale 1/√d, additive bias
    broadcastable to (N, H, M, S) (see `aligned_bias`; finite, e.g. the dtype's minimum where masked).

    Returns the output (N, H, M, d), laid out as (N, M, H, d) in memory, and the float32 log-sum-exp of
    each query's biased, scaled scores as (N, M, H): both in the layout of rows of queries, which is
    what `merge_attention` reads (the memory-efficient kernel's log-sum-exp is (N, H, M) padded to 32; a
    slice of it would make compiled code specialise on whether M is a multiple of 32).
    """
    n, heads, queries, dim = q.shape
    full_bias = bias.expand(n, heads, queries, k.shape[2])
    if _runs_cudnn_attention(q):
        out, lse = torch.ops.aten._scaled_dot_product_cudnn_attention(q, k, v, full_bias, True, 0.0, False,
                                                                     False)[:2]
        # The promised layouts whatever the kernel chose (no copy when it chose them).
        out = out.transpose(1, 2).contiguous().transpose(1, 2)
        return out, lse.reshape(n, heads, queries).float().transpose(1, 2).contiguous()
    if q.is_cuda:
        out, lse = torch.ops.aten._scaled_dot_product_efficient_attention(q, k, v, full_bias, True)[:2]
        return out, lse[..., :queries].transpose(1, 2).contiguous()
    scores = torch.matmul(q.float(), k.float().transpose(-2, -1)) / math.sqrt(dim) + full_bias.float()
    out = torch.matmul(torch.softmax(scores, dim=-1), v.float()).to(q.dtype)
    lse = torch.logsumexp(scores, dim=-1)
    return out.transpose(1, 2).contiguous().transpose(1, 2), lse.transpose(1, 2).contiguous()


@attention_with_lse.register_fake
def _attention_with_lse_shapes(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    n, heads, queries, _ = q.shape
    out = q.new_empty(n, queries, heads, v.shape[3]).transpose(1, 2)
    return out, q.new_empty(n, queries, heads, dtype=torch.float32)


def aligned_bias(mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Additive bias of bool `mask` (…, S), True = attend: 0, or `masked_bias(dtype)`. Rows are stored
    with a stride of a multiple of `BIAS_ALIGNMENT`."""
    keys = mask.shape[-1]
    stride = math.ceil(keys / BIAS_ALIGNMENT) * BIAS_ALIGNMENT
    storage = torch.zeros(*mask.shape[:-1], stride, dtype=dtype, device=mask.device)
    bias = storage[..., :keys]
    return bias.masked_fill_(~mask, masked_bias(dtype))


def masked_bias(dtype: torch.dtype) -> float:
    """The bias of a masked key: finite, so that a query whose keys are all masked gets a finite output
    and a log-sum-exp near this value, which weighs nothing in `merge_attention` (with −inf the kernel
    reports such a query's log-sum-exp as +inf). At most −1e30 in magnitude: the kernel scales scores by
    log2(e), which would take float32's minimum to −inf."""
    return max(torch.finfo(dtype).min, -1e30)


def merge_attention(
    first: torch.Tensor, first_lse: torch.Tensor, second: torch.Tensor, second_lse: torch.Tensor
) -> torch.Tensor:
    """The attention over two disjoint key sets from each set's output (…, d) and log-sum-exp (…, 1)."""
    weight = torch.sigmoid(first_lse - second_lse)  # = e^lse1 / (e^lse1 + e^lse2)
    merged = second.float() + weight * (first.float() - second.float())
    return merged.to(first.dtype)
