"""Batched speech-token sampling on device, every row with its own parameters (MODEL_FACTS §3.3-3.4).

Per row, in order: repetition penalty over the tokens the request has generated, stop-token bans (eos
while below the minimum length; every stop token for fixed-length requests), temperature, then either
plain top-k/top-p sampling or RAS: a nucleus candidate that already occurs `ras_window * ras_tau` times
among the last `ras_window` generated tokens is masked and the token is drawn from the full
distribution instead.

Randomness is counter-based: a row's uniforms are a hash of (seed, step), so a seeded request samples the
same tokens alone or in any batch, and sampling needs no generator state (it can live in a CUDA graph).
Everything here is tensor code without host synchronisation.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, fields
from pathlib import Path

import torch
from torch import Tensor

from engines.llm.base import SamplingParams
from engines.precompiled import compile_kept, seal_kept
from engines.transfer import upload

_MASK32 = 0xFFFFFFFF
# The per-slot settings stored as rows of one table per dtype (see `SamplingSlots`).
_FLOAT_FIELDS = ("temperature", "top_p", "repetition_penalty")
_INT_FIELDS = ("top_k", "ras_threshold", "ras_window", "min_len", "seed", "step")
_EMPTY = -1  # history entry before any token was generated
# Largest top_k a request may ask for: the fused sampler's nucleus walk keeps at most this many tokens
# (sampling_kernel.py; CosyVoice2 samples with 25).
MAX_TOP_K = 128
RowIndex = slice | Tensor  # consecutive slots (views of the state) or an int64 tensor of slot ids


def _mix32(x: Tensor) -> Tensor:
    """A 32-bit integer hash (xor-shift-multiply) of int64 values in [0, 2^32).

    The multipliers are below 2^31, so products stay below 2^63 and int64 arithmetic is exact.
    """
    x = x ^ (x >> 16)
    x = (x * 0x21F0AAAD) & _MASK32
    x = x ^ (x >> 15)
    x = (x * 0x735A2D97) & _MASK32
    return x ^ (x >> 15)


def draw_uniforms(seed: Tensor, step: Tensor, lanes: int = 2) -> Tensor:
    """Uniforms [B, lanes] in [0, 1) that depend only on each row's (seed, step) and the lane."""
    lane = torch.arange(lanes, device=seed.device)
    counter = (step.unsqueeze(1) * lanes + lane) & _MASK32
    bits = _mix32(_mix32(counter) ^ (seed.unsqueeze(1) & _MASK32))
    return (bits >> 8).to(torch.float32) * 2.0**-24  # 24 bits: exact in fp32


def ras_threshold(params: SamplingParams) -> int:
    """Smallest repeat count that triggers the RAS fallback (count >= ras_window * ras_tau)."""
    return math.ceil(params.ras_window * params.ras_tau)


@dataclass(frozen=True)
class SamplingRows:
    """Per-row sampling parameters and state for a batch of B rows (all on one device)."""

    temperature: Tensor  # [B] float32
    top_k: Tensor  # [B] int64
    top_p: Tensor  # [B] float32
    repetition_penalty: Tensor  # [B] float32
    ras_threshold: Tensor  # [B] int64; above the history length when RAS is off
    ras_window: Tensor  # [B] int64
    min_len: Tensor  # [B] int64; eos is banned while step < min_len
    ignore_stop: Tensor  # [B] bool; every stop token banned (fixed-length requests)
    seed: Tensor  # [B] int64 in [0, 2^32)
    step: Tensor  # [B] int64, tokens generated so far
    history: Tensor  # [B, H] int64, last H generated tokens, newest last, -1 before the first
    seen: Tensor  # [B, V] bool, tokens generated so far (for the repetition penalty)


def _inverse_cdf(weights: Tensor, u: Tensor) -> Tensor:
    """Index drawn from each row of unnormalised non-negative `weights` [B, N] with uniforms `u` [B]."""
    cumulative = weights.cumsum(dim=-1)
    target = (u * cumulative[:, -1]).unsqueeze(1)
    index = torch.searchsorted(cumulative, target, right=True)
    return index.clamp(max=weights.shape[-1] - 1).squeeze(1)


def sample(logits: Tensor, rows: SamplingRows, is_stop: Tensor, eos: int,
           uniforms: Tensor | None = None) -> Tensor:
    """One token per row of `logits` [B, V] (int64 [B]); `is_stop` [V] (bool) marks the stop tokens.

    `uniforms` [B, 2] are `draw_uniforms(rows.seed, rows.step)`, computed here when not given.
    """
    scores = logits.float()
    penalised = torch.where(scores > 0, scores / rows.repetition_penalty[:, None],
                            scores * rows.repetition_penalty[:, None])
    scores = torch.where(rows.seen, penalised, scores)

    vocab = torch.arange(scores.shape[-1], device=scores.device)
    eos_banned = (rows.step < rows.min_len)[:, None] & (vocab == eos)
    stop_banned = rows.ignore_stop[:, None] & is_stop
    scores = scores.masked_fill(eos_banned | stop_banned, float("-inf"))
    scores = scores / rows.temperature[:, None]
    probs = scores.softmax(dim=-1)

    # Nucleus walk: keep sorted tokens while the mass before them is below top_p and fewer than top_k
    # are kept, so the token that crosses top_p is included; sample among them unrenormalised. (A full
    # sort of the 6564 probabilities costs less on the GPU than `topk` with an exact tie order.)
    sorted_probs, sorted_ids = probs.sort(dim=-1, descending=True, stable=True)
    mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
    keep = (mass_before < rows.top_p[:, None]) & (vocab < rows.top_k[:, None])
    if uniforms is None:
        uniforms = draw_uniforms(rows.seed, rows.step)
    picked = _inverse_cdf(sorted_probs * keep, uniforms[:, 0])
    candidate = sorted_ids.gather(1, picked.unsqueeze(1))  # [B, 1]

    # RAS: a candidate repeated too often within the window is masked; draw from the full distribution.
    history_len = rows.history.shape[1]
    in_window = torch.arange(history_len, device=scores.device) >= history_len - rows.ras_window[:, None]
    repeats = ((rows.history == candidate) & in_window).sum(dim=-1)
    fallback_probs = scores.scatter(1, candidate, float("-inf")).softmax(dim=-1)
    fallback = _inverse_cdf(fallback_probs, uniforms[:, 1])
    return torch.where(repeats >= rows.ras_threshold, fallback, candidate.squeeze(1))


class SamplingSlots:
    """Sampling parameters and state of every engine slot, as static device tensors.

    `rows(index)` selects slots for `sample`: a slice gives views, a tensor of slot ids gives copies.
    `record` appends sampled tokens to the rows that are active and leaves the others untouched, so it
    can run over a fixed batch that contains idle slots. Every call is free of host synchronisation.
    """

    def __init__(self, slots: int, vocab: int, history: int, stop_tokens: Sequence[int], eos: int,
                 device: torch.device, compiled: bool = False, precompiled: Path | None = None,
                 fused: bool = False) -> None:
        """`compiled`: draw the uniforms with one Inductor kernel instead of ~30 tiny ones (integer
        arithmetic: the same values; on CUDA, where each launch costs more than the arithmetic), kept in
        `precompiled` for later processes when given (engines/precompiled.py; `seal` once warmed up).
        `fused` (CUDA): `sample_and_record` runs as one Triton kernel (sampling_kernel.py)."""
        self.history_len = history
        self._fused_step: Callable[..., Tensor] | None = None
        if fused:
            from engines.llm.sampling_kernel import sample_and_record  # Triton: CUDA builds of torch

            self._fused_step = sample_and_record
        self._draw_uniforms = (
            # Row-wise (the rows never broadcast): one compiled class serves one row and many.
            compile_kept(draw_uniforms, precompiled, "llm-draw_uniforms", (sys.modules[__name__],), device,
                         inference=False, size_oblivious=True)
            if compiled else draw_uniforms
        )
        self.eos = eos
        self.is_stop = torch.zeros(vocab, dtype=torch.bool, device=device)
        self.is_stop[list(stop_tokens)] = True
        self._slot_ids = torch.arange(slots, device=device)

        def zeros(*shape: int, dtype: torch.dtype) -> Tensor:
            return torch.zeros(shape, dtype=dtype, device=device)

        # The per-slot settings are rows of one table per dtype (`_FLOAT_FIELDS`, `_INT_FIELDS`): a new
        # request's column of each is written by one copy, and every field is a contiguous row (what the
        # fused kernel reads). Defaults: temperature, top_p, penalty, top_k, window 1; RAS off.
        self._floats = zeros(len(_FLOAT_FIELDS), slots, dtype=torch.float32) + 1
        self._ints = zeros(len(_INT_FIELDS), slots, dtype=torch.int64)
        for field, default in (("top_k", 1), ("ras_threshold", history + 1), ("ras_window", 1)):
            self._ints[_INT_FIELDS.index(field)] = default
        self._state = SamplingRows(
            **dict(zip(_FLOAT_FIELDS, self._floats, strict=True)),
            **dict(zip(_INT_FIELDS, self._ints, strict=True)),
            ignore_stop=zeros(slots, dtype=torch.bool),
            history=zeros(slots, history, dtype=torch.int64) + _EMPTY,
            seen=zeros(slots, vocab, dtype=torch.bool),
        )

    def seal(self) -> None:
        """Compile no more variants of the kept uniforms' function (see the constructor)."""
        seal_kept(self._draw_uniforms)

    def configure(self, slots: Tensor, settings: Sequence[tuple[SamplingParams, int, int]]) -> None:
        """Reset `slots` (int64 [n] on the device) for new requests: `settings[i]` is the (params,
        min_len, seed) of slot i. Eight small kernels for any n (the first token of a lone request waits
        for them on the host), and no wait for the device: the values travel in two pinned copies."""
        for params, _, _ in settings:
            if params.use_ras and params.ras_window > self.history_len:
                raise ValueError(
                    f"ras_window {params.ras_window} exceeds the sampler history {self.history_len}")
            if params.top_k > MAX_TOP_K:
                raise ValueError(f"top_k {params.top_k} exceeds the sampler's limit {MAX_TOP_K}")
        floats = torch.tensor([(params.temperature, params.top_p, params.repetition_penalty)
                               for params, _, _ in settings], dtype=torch.float32).T
        # `_INT_FIELDS` (the step starts at 0), then whether stop tokens are ignored.
        ints = torch.tensor([
            (params.top_k, ras_threshold(params) if params.use_ras else self.history_len + 1,
             min(params.ras_window, self.history_len), min_len, seed & _MASK32, 0,
             params.fixed_length is not None)
            for params, min_len, seed in settings
        ], dtype=torch.int64).T
        floats, ints = upload(floats.contiguous(), slots.device), upload(ints.contiguous(), slots.device)
        self._floats.index_copy_(1, slots, floats)
        self._ints.index_copy_(1, slots, ints[: len(_INT_FIELDS)])
        state = self._state
        state.ignore_stop.index_copy_(0, slots, ints[len(_INT_FIELDS)] != 0)
        state.history.index_fill_(0, slots, _EMPTY)
        state.seen.index_fill_(0, slots, False)

    def rows(self, rows: RowIndex) -> SamplingRows:
        state = self._state
        return SamplingRows(**{f.name: getattr(state, f.name)[rows] for f in fields(SamplingRows)})

    def sample(self, logits: Tensor, rows: RowIndex) -> Tensor:
        selected = self.rows(rows)
        uniforms = self._draw_uniforms(selected.seed, selected.step)
        return sample(logits, selected, self.is_stop, self.eos, uniforms)

    def sample_and_record(self, logits: Tensor, rows: RowIndex, active: Tensor) -> Tensor:
        """`sample` then `record` (one kernel when `fused`)."""
        if self._fused_step is not None:
            slots = self._slot_ids[rows] if isinstance(rows, slice) else rows
            return self._fused_step(logits, slots, active, self._state, self.is_stop, self.eos)
        tokens = self.sample(logits, rows)
        self.record(tokens, rows, active)
        return tokens

    def record(self, tokens: Tensor, rows: RowIndex, active: Tensor) -> None:
        """Append `tokens` [B] to the state of the `active` [B] (bool) rows among `rows`, in place.

        A slot may appear more than once in `rows` only in inactive rows (padding rows on a scratch slot):
        an inactive row writes back what it read.
        """
        state = self._state
        step, history = state.step[rows], state.history[rows]
        state.step[rows] = step + active.long()
        shifted = torch.cat((history[:, 1:], tokens.unsqueeze(1)), dim=1)
        state.history[rows] = torch.where(active.unsqueeze(1), shifted, history)
        slot_ids, token_ids = self._slot_ids[rows].unsqueeze(1), tokens.unsqueeze(1)
        state.seen[slot_ids, token_ids] = state.seen[slot_ids, token_ids] | active.unsqueeze(1)
