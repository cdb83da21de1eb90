"""Attention for decode steps (one query per row) over the slot KV cache, as Triton kernels (CUDA only).

One decode step of the general path runs, per layer, Inductor's rope kernels, an indexed write of the
new key and value into the cache, and SDPA with an additive mask over the whole bucketed `kv_len`
prefix of every row. `decode_attention` does all of that in one launch:

- a program takes one row, one KV head and one split of the positions (flash-decoding). The row's
  `group` query heads are computed together, so each key and value is read once for all of them;
- it rotates the query and the new key (rope, in fp32, rounded to the cache dtype like the general
  path's in-place rotation), and the first split stores the new key and value at the row's position;
- it reads only positions up to the row's own (the new key comes from registers, not the cache), so a
  short sequence in a long bucket costs what its length costs;
- when the positions are split, the split that finishes last merges the splits' softmax partials.

The result equals the general path's up to rounding (bf16 probabilities times values, fp32 softmax),
tested in tests/engines/test_llm_decode_attention.py against it.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl
from torch import Tensor

from engines.llm.programmatic_launch import launch_options

BLOCK_KEYS = 64  # positions per loop iteration of a program
# Programs a decode step aims for (4 per multiprocessor of an H100): few rows split their positions over
# more programs, at most MAX_SPLITS each (the merge reads every split); 128 rows split in two.
TARGET_PROGRAMS = 528
MAX_SPLITS = 8


@triton.jit
def _split_kernel(
    qkv_ptr, cos_ptr, sin_ptr, positions_ptr, cache_ptr, out_ptr, part_acc_ptr, part_max_ptr, part_sum_ptr,
    counters_ptr, first_slot, kv_len, stride_qkv_row, stride_rope_row, stride_positions,
    stride_cache_slot, stride_cache_head, stride_cache_pos, scale_log2,
    Q_HEADS: tl.constexpr, KV_HEADS: tl.constexpr, GROUP: tl.constexpr, GROUP_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr, SPLIT_LEN: tl.constexpr, SPLITS: tl.constexpr,
    SPLITS_PAD: tl.constexpr, PDL: tl.constexpr,
):
    if PDL:  # programmatic_launch.py: nothing is read or written before the previous kernel has ended
        tl.extra.cuda.gdc_wait()
    row_head = tl.program_id(0)
    split = tl.program_id(1)
    row = row_head // KV_HEADS
    head = row_head % KV_HEADS
    position = tl.load(positions_ptr + row * stride_positions)
    dtype = cache_ptr.dtype.element_ty

    # Rope of the half-split layout: x * cos + swap_halves(x) * signed_sin.
    dims = tl.arange(0, HEAD_DIM)
    swapped = (dims + HEAD_DIM // 2) % HEAD_DIM
    cos = tl.load(cos_ptr + row * stride_rope_row + dims).to(tl.float32)
    sin = tl.load(sin_ptr + row * stride_rope_row + dims).to(tl.float32)
    qkv_row = qkv_ptr + row * stride_qkv_row
    group_rows = tl.arange(0, GROUP_PAD)
    real_rows = group_rows < GROUP
    q_offsets = (head * GROUP + group_rows)[:, None] * HEAD_DIM
    q = tl.load(qkv_row + q_offsets + dims[None, :], mask=real_rows[:, None], other=0.0).to(tl.float32)
    q_swapped = tl.load(qkv_row + q_offsets + swapped[None, :], mask=real_rows[:, None], other=0.0)
    q = (q * cos[None, :] + q_swapped.to(tl.float32) * sin[None, :]).to(dtype)
    key_offset = (Q_HEADS + head) * HEAD_DIM
    new_key = tl.load(qkv_row + key_offset + dims).to(tl.float32)
    new_key_swapped = tl.load(qkv_row + key_offset + swapped).to(tl.float32)
    new_key = (new_key * cos + new_key_swapped * sin).to(dtype)
    new_value = tl.load(qkv_row + (Q_HEADS + KV_HEADS + head) * HEAD_DIM + dims).to(dtype)

    slot_ptr = cache_ptr + (first_slot + row).to(tl.int64) * stride_cache_slot
    keys_ptr = slot_ptr + head * stride_cache_head
    values_ptr = slot_ptr + (KV_HEADS + head) * stride_cache_head
    if split == 0:
        tl.store(keys_ptr + position * stride_cache_pos + dims, new_key)
        tl.store(values_ptr + position * stride_cache_pos + dims, new_value)

    # Online softmax over this split's positions up to the row's own (and below kv_len: a row past it
    # is padding, whose output is discarded); scores in the log2 domain.
    start = split * SPLIT_LEN
    end = tl.minimum(tl.minimum(start + SPLIT_LEN, position + 1), kv_len)
    running_max = tl.full([GROUP_PAD], float("-inf"), tl.float32)
    running_sum = tl.zeros([GROUP_PAD], tl.float32)
    acc = tl.zeros([GROUP_PAD, HEAD_DIM], tl.float32)
    for block in range(start, end, BLOCK_N):
        offsets = block + tl.arange(0, BLOCK_N)
        valid = offsets < end
        cached = (valid & (offsets < position))[:, None]
        is_new = (offsets == position)[:, None]
        cache_offsets = offsets[:, None] * stride_cache_pos + dims[None, :]
        keys = tl.load(keys_ptr + cache_offsets, mask=cached, other=0.0)
        values = tl.load(values_ptr + cache_offsets, mask=cached, other=0.0)
        keys = tl.where(is_new, new_key[None, :], keys)
        values = tl.where(is_new, new_value[None, :], values)
        scores = tl.dot(q, tl.trans(keys)) * scale_log2
        scores = tl.where(valid[None, :], scores, float("-inf"))
        new_max = tl.maximum(running_max, tl.max(scores, 1))
        correction = tl.exp2(running_max - new_max)
        probs = tl.exp2(scores - new_max[:, None])
        running_sum = running_sum * correction + tl.sum(probs, 1)
        acc = acc * correction[:, None] + tl.dot(probs.to(dtype), values)
        running_max = new_max
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()

    out_offsets = (row * Q_HEADS + head * GROUP + group_rows)[:, None] * HEAD_DIM + dims[None, :]
    if SPLITS == 1:
        out = acc / running_sum[:, None]
        tl.store(out_ptr + out_offsets, out.to(dtype), mask=real_rows[:, None])
    else:
        part = row_head * SPLITS + split
        tl.store(part_max_ptr + part * GROUP_PAD + group_rows, running_max)
        tl.store(part_sum_ptr + part * GROUP_PAD + group_rows, running_sum)
        acc_offsets = part * GROUP_PAD * HEAD_DIM + group_rows[:, None] * HEAD_DIM + dims[None, :]
        tl.store(part_acc_ptr + acc_offsets, acc)
        # The split of a (row, KV head) that finishes last merges them all (no second launch): the
        # barrier, then one release/acquire increment at GPU scope orders every split's stores before
        # its loads, which bypass L1 (".cg"). It resets the counter for the next call.
        tl.debug_barrier()
        arrived = tl.atomic_add(counters_ptr + row_head, 1, sem="acq_rel", scope="gpu")
        if arrived == SPLITS - 1:
            tl.atomic_xchg(counters_ptr + row_head, 0, sem="relaxed", scope="gpu")
            out = _merge(part_acc_ptr, part_max_ptr, part_sum_ptr, row_head, group_rows, dims,
                         GROUP_PAD, HEAD_DIM, SPLITS, SPLITS_PAD)
            tl.store(out_ptr + out_offsets, out.to(dtype), mask=real_rows[:, None])


@triton.jit
def _merge(part_acc_ptr, part_max_ptr, part_sum_ptr, row_head, group_rows, dims,
           GROUP_PAD: tl.constexpr, HEAD_DIM: tl.constexpr, SPLITS: tl.constexpr, SPLITS_PAD: tl.constexpr):
    """The attention output [GROUP_PAD, HEAD_DIM] (fp32) of one row and KV head from its splits' partials."""
    splits = tl.arange(0, SPLITS_PAD)
    stats_offsets = (row_head * SPLITS + splits)[:, None] * GROUP_PAD + group_rows[None, :]
    real_splits = (splits < SPLITS)[:, None]
    # A split past the row's position saw no key: its max is -inf and its weight 0. Split 0 always
    # holds position 0, so every row's overall max is finite.
    maxima = tl.load(part_max_ptr + stats_offsets, mask=real_splits, other=float("-inf"),
                     cache_modifier=".cg")
    sums = tl.load(part_sum_ptr + stats_offsets, mask=real_splits, other=0.0, cache_modifier=".cg")
    overall = tl.max(maxima, 0)
    weights = tl.exp2(maxima - overall[None, :])  # [SPLITS_PAD, GROUP_PAD]
    total = tl.sum(weights * sums, 0)
    acc = tl.zeros([GROUP_PAD, HEAD_DIM], tl.float32)
    for split in tl.static_range(SPLITS):  # unrolled: every split's loads are in flight at once
        part = row_head * SPLITS + split
        split_max = tl.load(part_max_ptr + part * GROUP_PAD + group_rows, cache_modifier=".cg")
        weight = tl.exp2(split_max - overall)
        values = tl.load(part_acc_ptr + part * GROUP_PAD * HEAD_DIM + group_rows[:, None] * HEAD_DIM
                         + dims[None, :], cache_modifier=".cg")
        acc += tl.where(weight[:, None] > 0, weight[:, None] * values, 0.0)
    return acc / total[:, None]


def split_length(rows: int, kv_heads: int, kv_len: int) -> int:
    """Positions per program: `kv_len` split until rows x KV heads x splits reach `TARGET_PROGRAMS`
    (a multiple of `BLOCK_KEYS`, so only the last split of a row is partial).

    Chosen from H100 timings (`benchmarks/decode_kernels.py`, docs/benchmarks.md, sixth session): e.g.
    one row at 512 positions 5.4 µs per layer in 8 splits against 9.6 µs unsplit; 64 rows at 1024
    positions 17.8 µs in 4 splits against 25.1 µs unsplit.
    """
    splits = min(MAX_SPLITS, max(1, TARGET_PROGRAMS // (rows * kv_heads)))
    return min(triton.cdiv(triton.cdiv(kv_len, splits), BLOCK_KEYS) * BLOCK_KEYS, kv_len)


def supports(head_dim: int, dtype: torch.dtype) -> bool:
    """Whether the kernels handle this head size and cache dtype (else the general path runs)."""
    return head_dim >= 16 and head_dim & (head_dim - 1) == 0 and dtype in (torch.bfloat16, torch.float16)


def decode_attention(qkv: Tensor, rope: tuple[Tensor, Tensor], layer_cache: Tensor, first_slot: int,
                     positions: Tensor, kv_len: int, counters: Tensor,
                     split_len: int | None = None, programmatic_launch: bool = False) -> Tensor:
    """Attention output [B, Hq, D] of one decode query per row.

    `qkv` [B, Hq + 2 Hkv, D] is the qkv projection of the rows (before rope); `rope` the cos and signed
    sin tables [B, D] (`qwen2.rope_tables`) at the rows' `positions` [B] (int64); row b is cache slot
    `first_slot + b` of `layer_cache` [slots, 2 Hkv, max_len, D] and attends to positions
    `0..positions[b]` (below `kv_len`), after its new key and value are stored at `positions[b]`.
    `counters` (int32, at least B x Hkv, zero) is where the splits of a row count their arrival; each call
    leaves it zero again. `split_len` overrides `split_length` (for measurements).
    `programmatic_launch`: launched with PDL (programmatic_launch.py; the caller checks `supported`).
    """
    rows, heads, head_dim = qkv.shape
    kv_heads = layer_cache.shape[1] // 2
    q_heads = heads - 2 * kv_heads
    group = q_heads // kv_heads
    cos, sin = rope
    contiguous_heads = qkv.stride(2) == 1 and qkv.stride(1) == head_dim
    if not contiguous_heads or cos.stride(1) != 1 or sin.stride() != cos.stride():
        raise ValueError("decode_attention needs rows of contiguous heads and rope tables")
    if layer_cache.stride(3) != 1:
        raise ValueError("decode_attention needs a cache with contiguous head vectors")
    if counters.dtype != torch.int32 or counters.numel() < rows * kv_heads:
        raise ValueError(f"decode_attention needs {rows * kv_heads} int32 counters")
    split_len = split_len or split_length(rows, kv_heads, kv_len)
    splits = triton.cdiv(kv_len, split_len)
    group_pad = max(16, triton.next_power_of_2(group))
    out = torch.empty(rows, q_heads, head_dim, dtype=layer_cache.dtype, device=qkv.device)
    parts = rows * kv_heads * splits * group_pad
    part_acc = torch.empty(parts * head_dim if splits > 1 else 1, dtype=torch.float32, device=qkv.device)
    part_max = torch.empty(parts if splits > 1 else 1, dtype=torch.float32, device=qkv.device)
    part_sum = torch.empty_like(part_max)
    _split_kernel[(rows * kv_heads, splits)](
        qkv, cos, sin, positions, layer_cache, out, part_acc, part_max, part_sum, counters,
        first_slot, kv_len, qkv.stride(0), cos.stride(0), positions.stride(0),
        layer_cache.stride(0), layer_cache.stride(1), layer_cache.stride(2),
        math.log2(math.e) / math.sqrt(head_dim),
        Q_HEADS=q_heads, KV_HEADS=kv_heads, GROUP=group, GROUP_PAD=group_pad, HEAD_DIM=head_dim,
        BLOCK_N=min(BLOCK_KEYS, max(16, triton.next_power_of_2(split_len))), SPLIT_LEN=split_len,
        SPLITS=splits, SPLITS_PAD=triton.next_power_of_2(splits), PDL=programmatic_launch, num_warps=4,
        num_stages=2, **launch_options(programmatic_launch),
    )
    return out


class DecodeAttention:
    """`decode_attention` for up to `max_rows` rows with its own counters (allocated once, so CUDA
    graphs captured with it keep pointing at them); what `qwen2.LayerKernels.decode_attention` takes."""

    def __init__(self, max_rows: int, kv_heads: int, device: torch.device,
                 programmatic_launch: bool = False, programmatic_max_rows: int | None = None) -> None:
        """`programmatic_launch`: launched with PDL (programmatic_launch.py; the caller checks `supported`),
        at calls of at most `programmatic_max_rows` rows where given."""
        self.counters = torch.zeros(max_rows * kv_heads, dtype=torch.int32, device=device)
        self.programmatic_launch = programmatic_launch
        self.programmatic_max_rows = programmatic_max_rows

    def __call__(self, qkv: Tensor, rope: tuple[Tensor, Tensor], layer_cache: Tensor, first_slot: int,
                 positions: Tensor, kv_len: int) -> Tensor:
        limit = self.programmatic_max_rows
        programmatic = self.programmatic_launch and (limit is None or qkv.shape[0] <= limit)
        return decode_attention(qkv, rope, layer_cache, first_slot, positions, kv_len, self.counters,
                                programmatic_launch=programmatic)
