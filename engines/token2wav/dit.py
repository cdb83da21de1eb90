"""Step-Audio2 DiT estimator: the velocity field of the flow, one Euler step at a time (MODEL_FACTS §5.2).

16 adaLN-modulated blocks (attention → causal conv → MLP) over mel frames, conditioned on the flow time
t. The attention has no positional encoding, so a chunk can attend to cached keys/values of earlier
frames in any order; the causal convs continue from a 2-frame input cache.

`forward` runs whole sequences with a mask; `forward_chunk` runs one chunk after explicit cache tensors
and is written to be exported as is (no data-dependent Python control flow; caches are plain tensors):
  cnn_cache (depth, B, 2·hidden, 2): per block, the last 2 input frames of conv1 | of conv2;
  att_cache (depth, B, heads, T_cache, 2·head_dim): per block, keys | values of the cached frames.
It returns the chunk's velocity, the new cnn cache and the chunk's own keys|values
(depth, B, heads, T, 2·head_dim), which the caller appends to its cache (cache order is irrelevant to
the result, so the caller chooses where to keep shared prompt frames and which frames to drop).

`forward_ragged` runs chunks of many streams at once (`SplitKeys`): chunks right-padded to a common
length, each row's cache split into a prompt part shared by rows of the same voice (never copied per
row) and the row's own part, one softmax over both. Padded frames are masked as keys and come after the
real ones, so the causal convs never read them; the conv caches are taken at each row's real end.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from engines.config import DiTConfig
from engines.token2wav.batching import frames_before

CONV_CONTEXT = 2  # causal kernel-3 convs
MODULATIONS = 9  # shift/scale/gate for attention, MLP and conv branches


def modulate(x: torch.Tensor, shift: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return x * (1 + scale) + shift


@dataclass(frozen=True)
class DenseKeys:
    """What the queries of one attention call see besides themselves (one tensor per row).

    past: (B, heads, T_past, 2·head_dim) keys|values before the queries' own, or None;
    mask: bool broadcastable to (B, heads, T, T_past + T), True = attend, or None (attend to all).
    """

    past: torch.Tensor | None
    mask: torch.Tensor | None


@dataclass(frozen=True)
class SplitKeys:
    """Keys of a padded batch of 2B rows (B streams, conditional rows first, then unconditional).

    prompt: (2, heads, K_p, 2·head_dim) keys|values shared by all conditional (index 0) resp.
      unconditional (1) rows, e.g. the prompts of the batch's voices side by side;
    own: (2B, heads, T_own, 2·head_dim) each row's own cached frames;
    mask: bool (2B, K_p + T_own + T) over [prompt, own, the chunk's T frames], True = attend; every row
      must attend to at least one key.
    """

    prompt: torch.Tensor
    own: torch.Tensor
    mask: torch.Tensor


class TimestepEmbedder(nn.Module):
    """t ∈ [0, 1] → (B, hidden): [cos | sin] of 1000·t at geometric frequencies, then an MLP."""

    def __init__(self, hidden: int, freq_dim: int) -> None:
        super().__init__()
        self.half_dim = freq_dim // 2
        self.mlp = nn.Sequential(nn.Linear(freq_dim, hidden), nn.SiLU(), nn.Linear(hidden, hidden))

    def forward(self, t: torch.Tensor) -> torch.Tensor:
        # Angles reach 1000 rad: computed in fp32 whatever the module dtype.
        steps = torch.arange(self.half_dim, device=t.device, dtype=torch.float32)
        freqs = torch.exp(steps * (-math.log(10000.0) / self.half_dim))
        angles = 1000.0 * t.float()[:, None] * freqs[None]
        features = torch.cat([torch.cos(angles), torch.sin(angles)], dim=-1)
        return self.mlp(features.to(next(self.mlp.parameters()).dtype))


class Attention(nn.Module):
    """Multi-head attention with per-head LayerNorm on queries and keys; no positions."""

    def __init__(self, cfg: DiTConfig) -> None:
        super().__init__()
        self.num_heads = cfg.num_heads
        self.head_dim = cfg.head_dim
        self.to_q = nn.Linear(cfg.hidden_size, cfg.hidden_size)
        self.to_k = nn.Linear(cfg.hidden_size, cfg.hidden_size)
        self.to_v = nn.Linear(cfg.hidden_size, cfg.hidden_size)
        self.q_norm = nn.LayerNorm(cfg.head_dim, eps=1e-5)
        self.k_norm = nn.LayerNorm(cfg.head_dim, eps=1e-5)
        self.proj = nn.Linear(cfg.hidden_size, cfg.hidden_size)

    def _heads(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        return x.view(b, t, self.num_heads, self.head_dim).transpose(1, 2)

    def forward(self, x: torch.Tensor, keys: DenseKeys | SplitKeys) -> tuple[torch.Tensor, torch.Tensor]:
        """x (B, T, C) attends to itself and `keys`. Returns (B, T, C) and x's keys|values
        (B, heads, T, 2·head_dim)."""
        q = self.q_norm(self._heads(self.to_q(x)))
        k = self.k_norm(self._heads(self.to_k(x)))
        v = self._heads(self.to_v(x))
        new_kv = torch.cat([k, v], dim=-1)
        if isinstance(keys, SplitKeys):
            out = self._split_attention(q, k, v, keys)
        else:
            if keys.past is not None:
                past_k, past_v = keys.past.split(self.head_dim, dim=-1)
                k = torch.cat([past_k, k], dim=2)
                v = torch.cat([past_v, v], dim=2)
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=keys.mask)
        b, _, t, _ = out.shape
        return self.proj(out.transpose(1, 2).reshape(b, t, -1)), new_kv

    def _split_attention(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, keys: SplitKeys
    ) -> torch.Tensor:
        """One softmax over [shared prompt, own cache, chunk] keys; q, k, v (2B, heads, T, head_dim).

        The prompt part is one matmul of every row's queries against the shared prompt keys (batched over
        the two guidance halves), so the prompt is read once per call, not once per row.
        """
        rows, heads, t, dim = q.shape
        batch = rows // 2
        scale = dim**-0.5
        prompt_k, prompt_v = keys.prompt.split(self.head_dim, dim=-1)
        own_k, own_v = keys.own.split(self.head_dim, dim=-1)
        own_k = torch.cat([own_k, k], dim=2)
        own_v = torch.cat([own_v, v], dim=2)
        prompt_frames = prompt_k.shape[2]

        def by_half(z: torch.Tensor) -> torch.Tensor:  # (2B, H, T, n) → (2, H, B·T, n)
            return z.view(2, batch, heads, t, -1).transpose(1, 2).reshape(2, heads, batch * t, -1)

        def by_row(z: torch.Tensor) -> torch.Tensor:  # (2, H, B·T, n) → (2B, H, T, n)
            return z.view(2, heads, batch, t, -1).transpose(1, 2).reshape(rows, heads, t, -1)

        prompt_scores = by_row(by_half(q) @ prompt_k.transpose(-1, -2))
        own_scores = q @ own_k.transpose(-1, -2)
        scores = torch.cat([prompt_scores, own_scores], dim=-1).float() * scale
        scores = scores.masked_fill(~keys.mask[:, None, None, :], float("-inf"))
        weights = torch.softmax(scores, dim=-1).to(q.dtype)
        prompt_weights, own_weights = weights.split([prompt_frames, own_k.shape[2]], dim=-1)
        return by_row(by_half(prompt_weights) @ prompt_v) + own_weights @ own_v


class CausalConvBranch(nn.Module):
    """Causal Conv1d(k3) → LayerNorm over channels → Mish → causal Conv1d(k3), on (B, T, C)."""

    def __init__(self, channels: int) -> None:
        super().__init__()
        # Keys mirror the reference Sequential's positions; its other slots are transposes and Mish.
        self.block = nn.ModuleDict(
            {
                "1": nn.Conv1d(channels, channels, kernel_size=CONV_CONTEXT + 1),
                "3": nn.LayerNorm(channels, eps=1e-5),
                "6": nn.Conv1d(channels, channels, kernel_size=CONV_CONTEXT + 1),
            }
        )

    def forward(
        self, x: torch.Tensor, cache: torch.Tensor, lengths: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """x (B, T, C); cache (B, 2·C, 2) = last input frames of conv1 | conv2. Returns (B, T, C), cache.

        lengths (B,) int64: real frames per row (right padding after them); the new cache holds each
        row's last real frames. None: every frame is real.
        """
        first_ctx, second_ctx = cache.chunk(2, dim=1)
        h = torch.cat([first_ctx, x.transpose(1, 2)], dim=2)
        new_first = self._context(h, lengths)
        h = F.mish(self.block["3"](self.block["1"](h).transpose(1, 2))).transpose(1, 2)
        h = torch.cat([second_ctx, h], dim=2)
        new_second = self._context(h, lengths)
        return self.block["6"](h).transpose(1, 2), torch.cat([new_first, new_second], dim=1)

    @staticmethod
    def _context(h: torch.Tensor, lengths: torch.Tensor | None) -> torch.Tensor:
        """The last CONV_CONTEXT real frames of h = [context, frames]."""
        if lengths is None:
            return h[:, :, -CONV_CONTEXT:]
        return frames_before(h, lengths + CONV_CONTEXT, CONV_CONTEXT)


class Mlp(nn.Module):
    def __init__(self, channels: int, hidden: int) -> None:
        super().__init__()
        self.fc1 = nn.Linear(channels, hidden)
        self.fc2 = nn.Linear(hidden, channels)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(x), approximate="tanh"))


class DiTBlock(nn.Module):
    def __init__(self, cfg: DiTConfig) -> None:
        super().__init__()
        hidden = cfg.hidden_size
        self.norm1 = nn.LayerNorm(hidden, elementwise_affine=False, eps=1e-6)
        self.attn = Attention(cfg)
        self.norm2 = nn.LayerNorm(hidden, elementwise_affine=False, eps=1e-6)
        self.mlp = Mlp(hidden, int(hidden * cfg.mlp_ratio))
        self.norm3 = nn.LayerNorm(hidden, elementwise_affine=False, eps=1e-6)
        self.conv = CausalConvBranch(hidden)
        self.adaLN_modulation = nn.Sequential(nn.SiLU(), nn.Linear(hidden, MODULATIONS * hidden))

    def forward(
        self,
        x: torch.Tensor,
        c: torch.Tensor,
        keys: DenseKeys | SplitKeys,
        conv_cache: torch.Tensor,
        lengths: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x (B, T, C), c (B, 1, C) → x, x's attention keys|values, new conv cache.

        lengths: real frames per row when rows are right-padded (see CausalConvBranch).
        """
        (shift_msa, scale_msa, gate_msa, shift_mlp, scale_mlp, gate_mlp,
         shift_conv, scale_conv, gate_conv) = self.adaLN_modulation(c).chunk(MODULATIONS, dim=-1)
        attended, kv = self.attn(modulate(self.norm1(x), shift_msa, scale_msa), keys)
        x = x + gate_msa * attended
        convolved, conv_cache = self.conv(
            modulate(self.norm3(x), shift_conv, scale_conv), conv_cache, lengths)
        x = x + gate_conv * convolved
        x = x + gate_mlp * self.mlp(modulate(self.norm2(x), shift_mlp, scale_mlp))
        return x, kv, conv_cache


class FinalLayer(nn.Module):
    def __init__(self, hidden: int, out_channels: int) -> None:
        super().__init__()
        self.norm_final = nn.LayerNorm(hidden, elementwise_affine=False, eps=1e-6)
        self.adaLN_modulation = nn.Sequential(nn.SiLU(), nn.Linear(hidden, 2 * hidden))
        self.linear = nn.Linear(hidden, out_channels)

    def forward(self, x: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
        shift, scale = self.adaLN_modulation(c).chunk(2, dim=-1)
        return self.linear(modulate(self.norm_final(x), shift, scale))


class DiT(nn.Module):
    """Velocity estimator v(x, t | mu, spks, cond); tensors are (B, 80, T) channel-first at the edges."""

    def __init__(self, cfg: DiTConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.t_embedder = TimestepEmbedder(cfg.hidden_size, cfg.time_embed_dim)
        self.in_proj = nn.Linear(cfg.in_channels, cfg.hidden_size)
        self.blocks = nn.ModuleList(DiTBlock(cfg) for _ in range(cfg.depth))
        self.final_layer = FinalLayer(cfg.hidden_size, cfg.out_channels)

    def _inputs(
        self, x: torch.Tensor, mu: torch.Tensor, t: torch.Tensor, spks: torch.Tensor, cond: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        speaker = spks[:, :, None].expand(-1, -1, x.shape[2])
        h = self.in_proj(torch.cat([x, mu, speaker, cond], dim=1).transpose(1, 2))
        return h, self.t_embedder(t)[:, None, :]

    def forward(
        self,
        x: torch.Tensor,
        mask: torch.Tensor,
        mu: torch.Tensor,
        t: torch.Tensor,
        spks: torch.Tensor,
        cond: torch.Tensor,
    ) -> torch.Tensor:
        """Velocity (B, 80, T) of whole sequences.

        x, mu, cond (B, 80, T); t (B,) float32 whatever the module dtype; spks (B, 80);
        mask bool (B, 1, T) valid frames (keys), or (B, T, T) per query (e.g. block-causal, as streaming).
        """
        h, c = self._inputs(x, mu, t, spks, cond)
        attn_mask = mask.bool()[:, None]
        conv_cache = h.new_zeros(h.shape[0], 2 * self.cfg.hidden_size, CONV_CONTEXT)
        keys = DenseKeys(past=None, mask=attn_mask)
        for block in self.blocks:
            h, _, _ = block(h, c, keys, conv_cache)
        return self.final_layer(h, c).transpose(1, 2)

    def forward_chunk(
        self,
        x: torch.Tensor,
        mu: torch.Tensor,
        t: torch.Tensor,
        spks: torch.Tensor,
        cond: torch.Tensor,
        cnn_cache: torch.Tensor,
        att_cache: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """One Euler step of a chunk after cached frames (module docstring: cache layouts).

        x, mu, cond (B, 80, T); t (B,) float32 whatever the module dtype; spks (B, 80). The chunk
        attends to every cached frame and to itself. Returns velocity (B, 80, T), the new cnn cache and
        the chunk's keys|values (depth, B, heads, T, 2·head_dim).
        """
        h, c = self._inputs(x, mu, t, spks, cond)
        new_cnn, new_kv = [], []
        for block, conv_cache, past_kv in zip(self.blocks, cnn_cache, att_cache, strict=True):
            h, kv, conv_cache = block(h, c, DenseKeys(past=past_kv, mask=None), conv_cache)
            new_cnn.append(conv_cache)
            new_kv.append(kv)
        return self.final_layer(h, c).transpose(1, 2), torch.stack(new_cnn), torch.stack(new_kv)

    def forward_ragged(
        self,
        x: torch.Tensor,
        mu: torch.Tensor,
        t: torch.Tensor,
        spks: torch.Tensor,
        lengths: torch.Tensor,
        cnn_cache: torch.Tensor,
        prompt_kv: torch.Tensor,
        own_kv: torch.Tensor,
        mask: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """One Euler step of a padded batch of streaming chunks (cond = 0: the prompt is in the caches).

        x, mu (2B, 80, T) right-padded after lengths (2B,) int64; t (2B,); spks (2B, 80);
        cnn_cache (depth, 2B, 2·hidden, 2); prompt_kv (depth, 2, heads, K_p, 2·hd) and
        own_kv (depth, 2B, heads, T_own, 2·hd) with `mask` (2B, K_p + T_own + T) as in `SplitKeys`.
        Returns velocity (2B, 80, T), the new cnn cache (each row's last real frames) and the chunk's
        keys|values (depth, 2B, heads, T, 2·hd), padded frames included.
        """
        h, c = self._inputs(x, mu, t, spks, torch.zeros_like(x))
        new_cnn, new_kv = [], []
        for block, conv_cache, prompt, own in zip(self.blocks, cnn_cache, prompt_kv, own_kv, strict=True):
            h, kv, conv_cache = block(h, c, SplitKeys(prompt, own, mask), conv_cache, lengths)
            new_cnn.append(conv_cache)
            new_kv.append(kv)
        return self.final_layer(h, c).transpose(1, 2), torch.stack(new_cnn), torch.stack(new_kv)
