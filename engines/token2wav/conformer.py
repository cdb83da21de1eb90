"""Upsample conformer encoder shared by both flows (MODEL_FACTS §4.2–4.4).

Embedded speech tokens (B, N, D) → encoder frames (B, 2N, D): linear embed, PreLookahead (3 tokens of
right context), 6 relative-position conformer layers at the token rate, ×2 causal upsampling, 4 more
layers at the mel rate, final LayerNorm. Parameter names match the released `flow.pt` files.

Two ways to run it:
- `forward`: whole padded sequences, with an optional token-level attention mask (the UNet flow's static
  chunk masks, `chunk_attention_mask`) and optional lookahead `context` tokens (CosyVoice2 streaming).
- `forward_chunk`: one chunk with a `ConformerCache` holding the conv contexts and every layer's keys and
  values of the frames seen so far (Step-Audio2 streaming). Chunk mode equals `forward` with a
  block-causal mask over the same chunks (`blocks_attention_mask`).
- `forward_chunks`: chunks of several streams at once, padded as batching.py lays them out; each row
  equals its own `forward_chunk`.

Cache layout (chosen for clarity; only the DiT estimator needs an exportable tensor layout): the token
layers' keys|values stacked as (num_blocks, B, H, T_tokens, 2·head_dim) and the mel layers' as
(num_up_blocks, B, H, 2·T_tokens, 2·head_dim), oldest frame first, instead of the reference's single
tensor with the token layers tiled twice along time.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from engines.config import ConformerConfig
from engines.token2wav.batching import frames_before, span_mask
from engines.word_copies import cat_words

PRE_LOOKAHEAD_LEFT = 2  # conv2 of PreLookahead: kernel 3, causal
UPSAMPLE_KERNEL_GROWTH = 2  # Upsample1D conv kernel = 2·stride + 1, left context 2·stride


def chunk_attention_mask(length: int, chunk_size: int, device: torch.device | None = None) -> torch.Tensor:
    """Bool (length, length): frame i sees frame j iff j lies in i's chunk or an earlier one."""
    chunk_end = (torch.arange(length, device=device) // chunk_size + 1) * chunk_size
    return torch.arange(length, device=device)[None, :] < chunk_end[:, None]


def blocks_attention_mask(block_lengths: Sequence[int], device: torch.device | None = None) -> torch.Tensor:
    """Bool (T, T), T = sum of lengths: frame i sees frame j iff j's block is i's block or earlier."""
    lengths = torch.tensor(list(block_lengths), device=device)
    block_of = torch.repeat_interleave(torch.arange(len(lengths), device=device), lengths)
    return block_of[None, :] <= block_of[:, None]


def rel_shift(scores: torch.Tensor) -> torch.Tensor:
    """Map (…, T, 2L−1) scores against relative distances L−1 … −(L−1) to (…, T, L) key scores.

    Query i is the (L − T + i)-th frame of L keys, so key j sits at distance L − T + i − j, table column
    T − 1 − i + j. The zero-pad-and-reshape trick does that gather with views only.
    """
    *lead, rows, cols = scores.shape
    padded = F.pad(scores, (1, 0)).view(*lead, cols + 1, rows)
    return padded[..., 1:, :].reshape(*lead, rows, cols)[..., : (cols + 1) // 2]


class RelativePositionTable(nn.Module):
    """Sinusoidal vectors for relative distances max_len−1 … −(max_len−1) (ESPnet 'rel_pos', flipped)."""

    table: torch.Tensor

    def __init__(self, d_model: int, max_len: int) -> None:
        super().__init__()
        self.max_len = max_len
        distances = torch.arange(max_len - 1, -max_len, -1, dtype=torch.float32)[:, None]
        even_dims = torch.arange(0, d_model, 2, dtype=torch.float32)
        inv_freq = torch.exp(even_dims * (-math.log(10000.0) / d_model))
        table = torch.zeros(2 * max_len - 1, d_model)
        table[:, 0::2] = torch.sin(distances * inv_freq)
        table[:, 1::2] = torch.cos(distances * inv_freq)
        self.register_buffer("table", table, persistent=False)

    def forward(self, length: int) -> torch.Tensor:
        """(2·length − 1, d_model) for distances length−1 … −(length−1)."""
        if length > self.max_len:
            raise ValueError(f"attention span of {length} frames exceeds the position table ({self.max_len})")
        centre = self.max_len - 1
        return self.table[centre - length + 1 : centre + length]


class LinearEmbed(nn.Module):
    """Linear → LayerNorm → ×sqrt(d) (ESPnet LinearNoSubsampling; positions are relative, not added)."""

    def __init__(self, d_model: int) -> None:
        super().__init__()
        self.out = nn.Sequential(nn.Linear(d_model, d_model), nn.LayerNorm(d_model, eps=1e-5))
        self.scale = math.sqrt(d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(x) * self.scale


class RelPositionAttention(nn.Module):
    """Transformer-XL style multi-head attention with learned content/position biases u and v."""

    def __init__(self, d_model: int, num_heads: int) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.head_dim = d_model // num_heads
        self.pos_bias_u = nn.Parameter(torch.zeros(num_heads, self.head_dim))
        self.pos_bias_v = nn.Parameter(torch.zeros(num_heads, self.head_dim))
        self.linear_q = nn.Linear(d_model, d_model)
        self.linear_k = nn.Linear(d_model, d_model)
        self.linear_v = nn.Linear(d_model, d_model)
        self.linear_out = nn.Linear(d_model, d_model)
        self.linear_pos = nn.Linear(d_model, d_model, bias=False)

    def forward(
        self, x: torch.Tensor, pos: torch.Tensor, mask: torch.Tensor | None, past_kv: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Attend from x (B, T, D) to [past frames, x].

        pos: (2L − 1, D) table for L = past + T; mask: bool (B, T, L), True = may attend, or None;
        past_kv: (B, H, T_past, 2·head_dim) or None. Returns (B, T, D) and x's keys|values (B, H, T, 2·hd).
        """
        b, t, _ = x.shape
        q = self.linear_q(x).view(b, t, self.num_heads, self.head_dim)
        k = self.linear_k(x).view(b, t, self.num_heads, self.head_dim).transpose(1, 2)
        v = self.linear_v(x).view(b, t, self.num_heads, self.head_dim).transpose(1, 2)
        new_kv = torch.cat([k, v], dim=-1)
        kv = new_kv if past_kv is None else torch.cat([past_kv, new_kv], dim=2)
        keys, values = kv.split(self.head_dim, dim=-1)
        p = self.linear_pos(pos).view(-1, self.num_heads, self.head_dim).transpose(0, 1)
        content = (q + self.pos_bias_u).transpose(1, 2) @ keys.transpose(-2, -1)
        position = rel_shift((q + self.pos_bias_v).transpose(1, 2) @ p.transpose(-2, -1))
        scores = (content + position) / math.sqrt(self.head_dim)
        if mask is not None:
            # Fully masked rows (padding queries) give zeros instead of NaN.
            scores = scores.masked_fill(~mask[:, None], float("-inf"))
            weights = torch.softmax(scores, dim=-1).masked_fill(~mask[:, None], 0.0)
        else:
            weights = torch.softmax(scores, dim=-1)
        out = (weights @ values).transpose(1, 2).reshape(b, t, -1)
        return self.linear_out(out), new_kv


class FeedForward(nn.Module):
    def __init__(self, d_model: int, hidden: int) -> None:
        super().__init__()
        self.w_1 = nn.Linear(d_model, hidden)
        self.w_2 = nn.Linear(hidden, d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w_2(F.silu(self.w_1(x)))


class ConformerLayer(nn.Module):
    """Pre-norm layer without conv module or macaron FFN: x + MHA(LN(x)), then x + FFN(LN(x))."""

    def __init__(self, cfg: ConformerConfig) -> None:
        super().__init__()
        self.self_attn = RelPositionAttention(cfg.d_model, cfg.num_heads)
        self.feed_forward = FeedForward(cfg.d_model, cfg.linear_units)
        self.norm_ff = nn.LayerNorm(cfg.d_model, eps=1e-12)
        self.norm_mha = nn.LayerNorm(cfg.d_model, eps=1e-12)

    def forward(
        self, x: torch.Tensor, pos: torch.Tensor, mask: torch.Tensor | None, past_kv: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        attended, new_kv = self.self_attn(self.norm_mha(x), pos, mask, past_kv)
        x = x + attended
        return x + self.feed_forward(self.norm_ff(x)), new_kv


class PreLookaheadLayer(nn.Module):
    """Residual conv pair: conv1 reads `lookahead` tokens to the right, conv2 two frames to the left."""

    def __init__(self, d_model: int, lookahead: int) -> None:
        super().__init__()
        self.lookahead = lookahead
        self.conv1 = nn.Conv1d(d_model, d_model, kernel_size=lookahead + 1)
        self.conv2 = nn.Conv1d(d_model, d_model, kernel_size=PRE_LOOKAHEAD_LEFT + 1)

    def forward(
        self, x: torch.Tensor, right: torch.Tensor, left: torch.Tensor, lengths: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """x (B, T, D), right (B, lookahead, D) frames after x, left (B, D, 2) conv2 context.

        Returns (B, T, D) and the new conv2 context (its last 2 input frames; with `lengths` (B,), the
        last 2 before each row's padding).
        """
        h = F.leaky_relu(self.conv1(torch.cat([x, right], dim=1).transpose(1, 2)))
        h = torch.cat([left, h], dim=2)
        if lengths is None:
            context = h[:, :, -PRE_LOOKAHEAD_LEFT:]
        else:
            context = frames_before(h, lengths + PRE_LOOKAHEAD_LEFT, PRE_LOOKAHEAD_LEFT)
        return self.conv2(h).transpose(1, 2) + x, context


class Upsample1D(nn.Module):
    """Nearest ×stride along time, then a causal conv (kernel 2·stride + 1)."""

    def __init__(self, d_model: int, stride: int) -> None:
        super().__init__()
        self.stride = stride
        self.context = UPSAMPLE_KERNEL_GROWTH * stride
        self.conv = nn.Conv1d(d_model, d_model, kernel_size=self.context + 1)

    def forward(
        self, x: torch.Tensor, left: torch.Tensor, lengths: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """x (B, D, T), left (B, D, 2·stride) context → (B, D, stride·T) and the new context (taken
        before each row's padding when `lengths` (B,) gives its real frames)."""
        h = torch.cat([left, x.repeat_interleave(self.stride, dim=2)], dim=2)
        if lengths is None:
            context = h[:, :, -self.context :]
        else:
            context = frames_before(h, self.stride * lengths + self.context, self.context)
        return self.conv(h), context


@dataclass(frozen=True)
class ConformerCache:
    """Streaming state of the encoder after T tokens (batch B).

    lookahead: (B, D, 2) PreLookahead conv2 context; upsample: (B, D, 2·stride) Upsample1D context;
    token_kv: (num_blocks, B, H, T, 2·head_dim) keys|values of the token layers;
    frame_kv: (num_up_blocks, B, H, stride·T, 2·head_dim) keys|values of the mel-rate layers.
    """

    lookahead: torch.Tensor
    upsample: torch.Tensor
    token_kv: torch.Tensor
    frame_kv: torch.Tensor

    @staticmethod
    def empty(cfg: ConformerConfig, batch: int, device: torch.device, dtype: torch.dtype) -> ConformerCache:
        def zeros(*shape: int) -> torch.Tensor:
            return torch.zeros(*shape, device=device, dtype=dtype)

        kv = (cfg.num_heads, 0, 2 * cfg.head_dim)
        return ConformerCache(
            lookahead=zeros(batch, cfg.d_model, PRE_LOOKAHEAD_LEFT),
            upsample=zeros(batch, cfg.d_model, UPSAMPLE_KERNEL_GROWTH * cfg.up_stride),
            token_kv=zeros(cfg.num_blocks, batch, *kv),
            frame_kv=zeros(cfg.num_up_blocks, batch, *kv),
        )

    @property
    def num_tokens(self) -> int:
        return self.token_kv.shape[3]

    @property
    def nbytes(self) -> int:
        tensors = (self.lookahead, self.upsample, self.token_kv, self.frame_kv)
        return sum(t.nbytes for t in tensors)

    def extend(self, newer: ConformerCache) -> ConformerCache:
        """`newer`'s conv contexts, with its keys/values appended after ours."""
        return ConformerCache(
            lookahead=newer.lookahead,
            upsample=newer.upsample,
            token_kv=cat_words((self.token_kv, newer.token_kv), dim=3),
            frame_kv=cat_words((self.frame_kv, newer.frame_kv), dim=3),
        )


class UpsampleConformerEncoder(nn.Module):
    """CosyVoice2 `UpsampleConformerEncoder` / Step-Audio2 `UpsampleConformerEncoderV2` (same weights)."""

    def __init__(self, cfg: ConformerConfig) -> None:
        super().__init__()
        self.cfg = cfg
        # Attribute order = the checkpoints' tensor order.
        self.embed = LinearEmbed(cfg.d_model)
        self.after_norm = nn.LayerNorm(cfg.d_model, eps=1e-5)
        self.pre_lookahead_layer = PreLookaheadLayer(cfg.d_model, cfg.pre_lookahead)
        self.encoders = nn.ModuleList(ConformerLayer(cfg) for _ in range(cfg.num_blocks))
        self.up_layer = Upsample1D(cfg.d_model, cfg.up_stride)
        self.up_embed = LinearEmbed(cfg.d_model)
        self.up_encoders = nn.ModuleList(ConformerLayer(cfg) for _ in range(cfg.num_up_blocks))
        self.positions = RelativePositionTable(cfg.d_model, cfg.max_relative_len)

    def forward(
        self,
        xs: torch.Tensor,
        lengths: torch.Tensor,
        attn_mask: torch.Tensor | None = None,
        context: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Encode whole sequences.

        xs: (B, N, D) embedded tokens, padded after `lengths` (B,). attn_mask: bool (N, N) or (B, N, N)
        token-level mask, True = may attend (None = full attention); the mel-rate layers use it repeated
        `up_stride` times along both axes. context: (B, lookahead, D) embedded tokens that follow xs
        (replacing PreLookahead's zero right padding; they produce no output). Padded frames are zeroed
        before PreLookahead so a padded sequence encodes exactly like the unpadded one.
        Returns (B, stride·N, D) and the output lengths (B,).
        """
        cfg = self.cfg
        b, n, _ = xs.shape
        valid = torch.arange(n, device=xs.device)[None, :] < lengths[:, None]
        mask = valid[:, None, :].expand(b, n, n)
        if attn_mask is not None:
            mask = mask & attn_mask
        x = self.embed(xs) * valid[:, :, None]
        right = (
            self.embed(context)
            if context is not None
            else x.new_zeros(b, cfg.pre_lookahead, cfg.d_model)
        )
        left = x.new_zeros(b, cfg.d_model, PRE_LOOKAHEAD_LEFT)
        x, _ = self.pre_lookahead_layer(x, right, left)
        pos = self.positions(n)
        for layer in self.encoders:
            x, _ = layer(x, pos, mask, None)
        upsampled, _ = self.up_layer(x.transpose(1, 2), x.new_zeros(b, cfg.d_model, self.up_layer.context))
        x = self.up_embed(upsampled.transpose(1, 2))
        frame_mask = mask.repeat_interleave(cfg.up_stride, dim=1).repeat_interleave(cfg.up_stride, dim=2)
        pos = self.positions(cfg.up_stride * n)
        for layer in self.up_encoders:
            x, _ = layer(x, pos, frame_mask, None)
        return self.after_norm(x), cfg.up_stride * lengths

    def forward_chunk(
        self, xs: torch.Tensor, cache: ConformerCache, last: bool
    ) -> tuple[torch.Tensor, ConformerCache]:
        """Encode one chunk after the frames in `cache`; no padding, no mask.

        xs: (B, N, D) embedded tokens; unless `last`, the final `lookahead` of them are right context
        only (they come again in the next chunk). The chunk attends to every cached frame and to itself.
        Returns (B, stride·N_out, D) with N_out = N − lookahead (N if last), and the chunk's update:
        its new conv contexts and the keys/values of its N_out tokens (`cache.extend(update)`).
        """
        cfg = self.cfg
        x = self.embed(xs)
        if last:
            x, right = x, x.new_zeros(x.shape[0], cfg.pre_lookahead, cfg.d_model)
        else:
            x, right = x[:, : -cfg.pre_lookahead], x[:, -cfg.pre_lookahead :]
        x, lookahead = self.pre_lookahead_layer(x, right, cache.lookahead)
        pos = self.positions(cache.num_tokens + x.shape[1])
        token_kv = []
        for layer, past in zip(self.encoders, cache.token_kv, strict=True):
            x, kv = layer(x, pos, None, past)
            token_kv.append(kv)
        upsampled, upsample = self.up_layer(x.transpose(1, 2), cache.upsample)
        x = self.up_embed(upsampled.transpose(1, 2))
        pos = self.positions(cache.frame_kv.shape[3] + x.shape[1])
        frame_kv = []
        for layer, past in zip(self.up_encoders, cache.frame_kv, strict=True):
            x, kv = layer(x, pos, None, past)
            frame_kv.append(kv)
        update = ConformerCache(lookahead, upsample, torch.stack(token_kv), torch.stack(frame_kv))
        return self.after_norm(x), update

    def forward_chunks(
        self,
        xs: torch.Tensor,
        token_lengths: torch.Tensor,
        out_lengths: torch.Tensor,
        cache: ConformerCache,
        cache_lengths: torch.Tensor,
    ) -> tuple[torch.Tensor, ConformerCache]:
        """`forward_chunk` for B streams at once (batching.py: padded layout).

        xs: (B, M + lookahead, D) embedded tokens, the first token_lengths[i] of row i real; out_lengths
        (B,): tokens each row encodes (its token count minus the lookahead, or all of them for a final
        chunk), at most M. cache: the rows' conv contexts and histories left-padded to a common length,
        cache_lengths[i] real tokens in row i. Returns (B, stride·M, D), row i's first stride·m_i frames
        real, and the update: each row's new conv contexts and the keys/values of its M tokens (real
        ones first).
        """
        cfg, stride = self.cfg, self.cfg.up_stride
        tokens = xs.shape[1] - cfg.pre_lookahead
        valid = torch.arange(xs.shape[1], device=xs.device) < token_lengths[:, None]
        # Zeroed padding is a final chunk's zero right context.
        x = self.embed(xs) * valid[:, :, None]
        x, lookahead = self.pre_lookahead_layer(x[:, :tokens], x[:, tokens:], cache.lookahead, out_lengths)
        history = cache.num_tokens
        mask = span_mask(history, tokens, cache_lengths, out_lengths)[:, None, :]
        pos = self.positions(history + tokens)
        token_kv = []
        for layer, past in zip(self.encoders, cache.token_kv, strict=True):
            x, kv = layer(x, pos, mask, past)
            token_kv.append(kv)
        upsampled, upsample = self.up_layer(x.transpose(1, 2), cache.upsample, out_lengths)
        x = self.up_embed(upsampled.transpose(1, 2))
        mask = span_mask(stride * history, stride * tokens, stride * cache_lengths, stride * out_lengths)
        pos = self.positions(stride * (history + tokens))
        frame_kv = []
        for layer, past in zip(self.up_encoders, cache.frame_kv, strict=True):
            x, kv = layer(x, pos, mask[:, None, :], past)
            frame_kv.append(kv)
        update = ConformerCache(lookahead, upsample, torch.stack(token_kv), torch.stack(frame_kv))
        return self.after_norm(x), update
