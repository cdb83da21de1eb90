"""Speech-token sampling and its bookkeeping in one Triton kernel per decode step (CUDA only).

`sampling.sample` and `SamplingSlots.record` are ~50 small kernels on a GPU (a radix sort of the 6564
probabilities, softmaxes, scans, searches, elementwise steps): 130 µs of a one-row decode step's 860 on
an H200, as much as four of its 24 layers; this kernel takes 19 µs (39 µs once some row of the step
falls back to RAS's full-distribution draw; docs/benchmarks.md, 26th session). One program per row does
the same work on the row held in registers:

- repetition penalty, stop-token bans, temperature and the softmax as `sample` defines them;
- the nucleus walk takes the most probable remaining token (ties to the lower id, as the stable sort
  orders them) while fewer than top_k are kept and the mass before it is below top_p: at most
  `MAX_TOP_K` reductions over the row instead of a sort, usually top_k (25) or fewer;
- the inverse-CDF draws with the uniforms of `draw_uniforms`, hashed in the kernel from (seed, step);
- RAS's repeat count over the history window and, only where it triggers, the draw from the full
  distribution without the candidate;
- and for the rows marked active, `record`: step + 1, the history shifted by the new token, `seen` set.

Tokens equal `sample`'s up to the order of fp32 sums (a draw within ~1e-6 of a cumulative boundary may
fall on the neighbouring token) and Triton's exp; where a draw lands on the exact total through rounding
it takes the last token with weight rather than one without (tests/engines/test_llm_sampling_kernel.py).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from engines.llm.sampling import MAX_TOP_K, SamplingRows

# A program's warps: 16 hold the row in 16 values a thread (H200, `decode_kernels.py --parts sampling`:
# 19.3 µs a step at one row against 21.1 with 8 warps and 29.7 with 4).
NUM_WARPS = 16


@triton.jit
def _mix32(x):
    """`sampling._mix32` on uint32 values: products wrap modulo 2^32, as the int64 version masks them."""
    x = x ^ (x >> 16)
    x = x * 0x21F0AAAD
    x = x ^ (x >> 15)
    x = x * 0x735A2D97
    return x ^ (x >> 15)


@triton.jit
def _uniform(seed, step, lane: tl.constexpr):
    """`sampling.draw_uniforms` of one row and lane: 24 random bits as a float in [0, 1)."""
    counter = (step * 2 + lane).to(tl.uint32)  # truncation: the definition's `& 0xFFFFFFFF`
    bits = _mix32(_mix32(counter) ^ seed.to(tl.uint32))
    return (bits >> 8).to(tl.float32) * 5.9604644775390625e-08  # 2^-24


@triton.jit
def _sample_kernel(
    logits_ptr, stride_logits, slots_ptr, active_ptr, tokens_ptr,
    temperature_ptr, top_k_ptr, top_p_ptr, penalty_ptr, ras_threshold_ptr, ras_window_ptr, min_len_ptr,
    ignore_stop_ptr, seed_ptr, step_ptr, history_ptr, seen_ptr, is_stop_ptr, eos,
    V: tl.constexpr, H: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_H: tl.constexpr, MAX_K: tl.constexpr,
):
    row = tl.program_id(0)
    slot = tl.load(slots_ptr + row)
    ids = tl.arange(0, BLOCK_V)
    in_vocab = ids < V

    # Scores as `sample` makes them, in fp32.
    x = tl.load(logits_ptr + row * stride_logits + ids, mask=in_vocab, other=0.0).to(tl.float32)
    seen = tl.load(seen_ptr + slot * V + ids, mask=in_vocab, other=0) != 0
    penalty = tl.load(penalty_ptr + slot)
    x = tl.where(seen, tl.where(x > 0, tl.div_rn(x, penalty), x * penalty), x)
    step = tl.load(step_ptr + slot)
    is_stop = tl.load(is_stop_ptr + ids, mask=in_vocab, other=0) != 0
    banned = ((ids == eos) & (step < tl.load(min_len_ptr + slot))) | (
        is_stop & (tl.load(ignore_stop_ptr + slot) != 0))
    x = tl.div_rn(tl.where(banned | ~in_vocab, float("-inf"), x), tl.load(temperature_ptr + slot))
    weights = tl.exp(x - tl.max(x, 0))
    probs = tl.div_rn(weights, tl.sum(weights, 0))

    # Nucleus walk. A key orders tokens as the stable descending sort does: the probability's bits
    # (non-negative floats order as their bit patterns) above the id counted down from the top.
    keys = (probs.to(tl.int32, bitcast=True).to(tl.int64) << 32) | (V - 1 - ids).to(tl.int64)
    keys = tl.where(in_vocab, keys, -1)
    positions = tl.arange(0, MAX_K)
    kept_ids = tl.zeros([MAX_K], tl.int32)
    kept_probs = tl.zeros([MAX_K], tl.float32)
    limit = tl.minimum(tl.load(top_k_ptr + slot), MAX_K).to(tl.int32)
    top_p = tl.load(top_p_ptr + slot)
    kept = tl.full([], 0, tl.int32)
    mass = tl.full([], 0.0, tl.float32)
    while (kept < limit) & (mass < top_p):
        best = tl.max(keys, 0)
        prob = (best >> 32).to(tl.int32).to(tl.float32, bitcast=True)
        kept_ids = tl.where(positions == kept, V - 1 - (best - ((best >> 32) << 32)).to(tl.int32), kept_ids)
        kept_probs = tl.where(positions == kept, prob, kept_probs)
        keys = tl.where(keys == best, -1, keys)
        mass += prob
        kept += 1
    seed = tl.load(seed_ptr + slot)
    cumulative = tl.cumsum(kept_probs, 0)
    target = _uniform(seed, step, 0) * tl.max(cumulative, 0)
    picked = tl.minimum(tl.sum((cumulative <= target).to(tl.int32), 0), kept - 1)
    token = tl.sum(tl.where(positions == picked, kept_ids, 0), 0)

    # RAS: a candidate repeated too often in the window is masked; draw from the full distribution.
    history_positions = tl.arange(0, BLOCK_H)
    in_history = history_positions < H
    history = tl.load(history_ptr + slot * H + history_positions, mask=in_history, other=-1)
    in_window = in_history & (history_positions >= H - tl.load(ras_window_ptr + slot))
    repeats = tl.sum(((history == token) & in_window).to(tl.int32), 0)
    if repeats >= tl.load(ras_threshold_ptr + slot):
        others = tl.where(ids == token, float("-inf"), x)
        weights = tl.exp(others - tl.max(others, 0))
        cumulative_all = tl.cumsum(tl.div_rn(weights, tl.sum(weights, 0)), 0)
        target = _uniform(seed, step, 1) * tl.max(cumulative_all, 0)
        below = tl.sum((cumulative_all <= target).to(tl.int32), 0)
        token = tl.minimum(below, tl.max(tl.where(weights > 0, ids, 0), 0))
    tl.store(tokens_ptr + row, token.to(tl.int64))

    # `SamplingSlots.record` for an active row. The shifted history comes from the registers (a shifted
    # load would race with other threads' stores).
    active = tl.load(active_ptr + row) != 0
    tl.store(step_ptr + slot, step + 1, mask=active)
    following = tl.where(history_positions[:, None] + 1 == history_positions[None, :], history[None, :], 0)
    shifted = tl.where(history_positions == H - 1, token.to(tl.int64), tl.sum(following, 1))
    tl.store(history_ptr + slot * H + history_positions, shifted, mask=in_history & active)
    tl.store(seen_ptr + slot * V + token, 1, mask=active)


def sample_and_record(logits: Tensor, slots: Tensor, active: Tensor, state: SamplingRows, is_stop: Tensor,
                      eos: int) -> Tensor:
    """Tokens (int64 [B]) for `logits` [B, V] of the rows on `slots` (int64 [B]) of the sampler `state`
    (all slots, as `SamplingSlots` holds them), recorded in `state` for the `active` [B] (bool) rows.

    A slot may appear more than once only in inactive rows. Rows must ask for top_k <= MAX_TOP_K."""
    rows, vocab = logits.shape
    history = state.history.shape[1]
    if logits.stride(1) != 1 or not slots.is_contiguous():
        raise ValueError("logits need contiguous rows and slots a contiguous index")
    tokens = torch.empty(rows, dtype=torch.int64, device=logits.device)
    _sample_kernel[(rows,)](
        logits, logits.stride(0), slots, active.view(torch.uint8), tokens,
        state.temperature, state.top_k, state.top_p, state.repetition_penalty, state.ras_threshold,
        state.ras_window, state.min_len, state.ignore_stop.view(torch.uint8), state.seed, state.step,
        state.history, state.seen.view(torch.uint8), is_stop.view(torch.uint8), eos,
        V=vocab, H=history, BLOCK_V=triton.next_power_of_2(vocab), BLOCK_H=triton.next_power_of_2(history),
        MAX_K=MAX_TOP_K, num_warps=NUM_WARPS,
    )
    return tokens
