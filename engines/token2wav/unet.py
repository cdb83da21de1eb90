"""CosyVoice2 flow-matching estimator: a one-level causal 1-D UNet with transformers (MODEL_FACTS §6.2).

Velocity v(x, t | mu, spks, cond) on (B, 80, T) mel frames. Convolutions are causal (2 frames of left
context, none to the right), so every frame's output depends on later frames only through attention:
full bidirectional attention offline, 50-frame static chunks (counted from frame 0) when streaming.
Parameter names follow `decoder.estimator.*` of the released CosyVoice2-0.5B `flow.pt`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from engines.config import UNetConfig
from engines.token2wav.conformer import chunk_attention_mask

CAUSAL_KERNEL = 3
FF_MULT = 4


class CausalConv1d(nn.Conv1d):
    """Conv1d that sees only the current and the previous `kernel_size − 1` frames."""

    def __init__(self, in_channels: int, out_channels: int, kernel_size: int = CAUSAL_KERNEL) -> None:
        super().__init__(in_channels, out_channels, kernel_size)

    def forward(self, x: Tensor) -> Tensor:
        return super().forward(F.pad(x, (self.kernel_size[0] - 1, 0)))


class ChannelLayerNorm(nn.LayerNorm):
    """LayerNorm over the channels of a (B, C, T) tensor."""

    def forward(self, x: Tensor) -> Tensor:
        return super().forward(x.transpose(1, 2)).transpose(1, 2)


class CausalBlock(nn.Module):
    """masked x → causal conv → LayerNorm over channels → Mish → masked (`block.0` conv, `block.2` norm)."""

    def __init__(self, in_channels: int, out_channels: int) -> None:
        super().__init__()
        # Index 1 is free: the trained model had a transpose there and the norm at index 2.
        self.block = nn.Sequential(CausalConv1d(in_channels, out_channels), nn.Identity(),
                                   ChannelLayerNorm(out_channels), nn.Mish())

    def forward(self, x: Tensor, frames: Tensor) -> Tensor:
        return self.block(x * frames) * frames


class CausalResnetBlock(nn.Module):
    """Two causal blocks with the time embedding added between them, plus a 1×1 residual projection."""

    def __init__(self, in_channels: int, out_channels: int, time_embed_dim: int) -> None:
        super().__init__()
        self.mlp = nn.Sequential(nn.Mish(), nn.Linear(time_embed_dim, out_channels))
        self.block1 = CausalBlock(in_channels, out_channels)
        self.block2 = CausalBlock(out_channels, out_channels)
        self.res_conv = nn.Conv1d(in_channels, out_channels, 1)

    def forward(self, x: Tensor, frames: Tensor, temb: Tensor) -> Tensor:
        h = self.block1(x, frames) + self.mlp(temb)[:, :, None]
        return self.block2(h, frames) + self.res_conv(x * frames)


class Attention(nn.Module):
    """Multi-head self-attention without bias on q/k/v (diffusers `Attention` names)."""

    def __init__(self, channels: int, num_heads: int, head_dim: int) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.head_dim = head_dim
        inner = num_heads * head_dim
        self.to_q = nn.Linear(channels, inner, bias=False)
        self.to_k = nn.Linear(channels, inner, bias=False)
        self.to_v = nn.Linear(channels, inner, bias=False)
        self.to_out = nn.Sequential(nn.Linear(inner, channels))

    def _heads(self, x: Tensor) -> Tensor:
        b, t, _ = x.shape
        return x.view(b, t, self.num_heads, self.head_dim).transpose(1, 2)

    def forward(self, x: Tensor, mask: Tensor) -> Tensor:
        """x (B, T, C); mask bool (B, 1, T, T), True = query i may attend key j."""
        q, k, v = self._heads(self.to_q(x)), self._heads(self.to_k(x)), self._heads(self.to_v(x))
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        b, _, t, _ = out.shape
        return self.to_out(out.transpose(1, 2).reshape(b, t, -1))


class GELUProjection(nn.Module):
    def __init__(self, channels: int, hidden: int) -> None:
        super().__init__()
        self.proj = nn.Linear(channels, hidden)

    def forward(self, x: Tensor) -> Tensor:
        return F.gelu(self.proj(x))  # exact (erf) GELU


class FeedForward(nn.Module):
    def __init__(self, channels: int) -> None:
        super().__init__()
        hidden = FF_MULT * channels
        # Index 1 held the trained model's dropout.
        self.net = nn.Sequential(GELUProjection(channels, hidden), nn.Identity(), nn.Linear(hidden, channels))

    def forward(self, x: Tensor) -> Tensor:
        return self.net(x)


class TransformerBlock(nn.Module):
    """Pre-norm self-attention and feed-forward (diffusers `BasicTransformerBlock`, no cross-attention)."""

    def __init__(self, channels: int, num_heads: int, head_dim: int) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(channels)
        self.attn1 = Attention(channels, num_heads, head_dim)
        self.norm3 = nn.LayerNorm(channels)
        self.ff = FeedForward(channels)

    def forward(self, x: Tensor, mask: Tensor) -> Tensor:
        x = x + self.attn1(self.norm1(x), mask)
        return x + self.ff(self.norm3(x))


class TimestepMLP(nn.Module):
    def __init__(self, in_dim: int, out_dim: int) -> None:
        super().__init__()
        self.linear_1 = nn.Linear(in_dim, out_dim)
        self.linear_2 = nn.Linear(out_dim, out_dim)

    def forward(self, x: Tensor) -> Tensor:
        return self.linear_2(F.silu(self.linear_1(x)))


def sinusoidal_time_features(t: Tensor, dim: int) -> Tensor:
    """(B,) flow time → (B, dim) float32 [sin(1000·t·f_i) | cos(1000·t·f_i)], f_i = 10000^(−i/(half−1))."""
    half = dim // 2
    steps = torch.arange(half, device=t.device, dtype=torch.float32)
    freqs = torch.exp(steps * (-math.log(10000.0) / (half - 1)))
    angles = 1000.0 * t.float()[:, None] * freqs[None]
    return torch.cat([angles.sin(), angles.cos()], dim=1)


def streaming_mask(cfg: UNetConfig, frames: int, device: torch.device | None = None) -> Tensor:
    """Bool (1, T, T) for the estimator's streaming mode: frame i attends every frame before the end of
    its static chunk (`cfg.static_chunk_size` = 50 frames, counted from frame 0)."""
    return chunk_attention_mask(frames, cfg.static_chunk_size, device)[None]


@dataclass(frozen=True)
class UNetMask:
    """An estimator mask as the layers read it (`CausalConditionalDecoder.prepare_mask`).

    frames (B, 1, T): 1 for valid frames, 0 for padding, in the activations' dtype;
    attention bool (B, 1, T, T): True = query i may attend key j.
    """

    frames: Tensor
    attention: Tensor


class UNetStage(nn.ModuleList):
    """Resnet block, transformer blocks, then an optional causal conv — a ModuleList so the names are
    the checkpoint's `<stage>.0.*`, `<stage>.1.<j>.*` and `<stage>.2.*`."""

    def __init__(self, cfg: UNetConfig, in_channels: int, with_conv: bool) -> None:
        ch = cfg.channels
        modules: list[nn.Module] = [
            CausalResnetBlock(in_channels, ch, cfg.time_embed_dim),
            nn.ModuleList(TransformerBlock(ch, cfg.num_heads, cfg.attention_head_dim)
                          for _ in range(cfg.n_blocks)),
        ]
        if with_conv:
            modules.append(CausalConv1d(ch, ch))
        super().__init__(modules)

    def forward(self, h: Tensor, frames: Tensor, temb: Tensor, attention: Tensor) -> tuple[Tensor, Tensor]:
        """h (B, C_in, T) → (hidden after the transformers, stage output after the conv), both (B, C, T)."""
        h = self[0](h, frames, temb).transpose(1, 2)
        for block in self[1].children():
            h = block(h, attention)
        hidden = h.transpose(1, 2)
        return hidden, (self[2](hidden * frames) if len(self) > 2 else hidden)


class CausalConditionalDecoder(nn.Module):
    """The estimator: down block (resnet, transformers, causal conv) → mid blocks → up block on
    [h, skip] → final causal block → 1×1 projection to 80 mel bins. No resolution change (one level)."""

    def __init__(self, cfg: UNetConfig) -> None:
        super().__init__()
        self.cfg = cfg
        ch = cfg.channels
        self.time_mlp = TimestepMLP(cfg.in_channels, cfg.time_embed_dim)
        self.down_blocks = nn.ModuleList([UNetStage(cfg, cfg.in_channels, with_conv=True)])
        self.mid_blocks = nn.ModuleList(
            UNetStage(cfg, ch, with_conv=False) for _ in range(cfg.num_mid_blocks)
        )
        self.up_blocks = nn.ModuleList([UNetStage(cfg, 2 * ch, with_conv=True)])
        self.final_block = CausalBlock(ch, ch)
        self.final_proj = nn.Conv1d(ch, cfg.out_channels, 1)

    def prepare_mask(self, mask: Tensor, dtype: torch.dtype) -> UNetMask:
        """What the layers read of `mask` (see `forward`), for activations of `dtype`; the same for
        every Euler step of a solve, so the solver prepares it once."""
        mask = mask.bool()
        frames = mask.any(dim=1, keepdim=True).to(dtype)
        attention = mask.expand(-1, mask.shape[2], -1)
        # A query with no allowed key attends uniformly, like the reference's additive −1e10 bias; such
        # rows are padding and zeroed by `frames` anyway.
        attention = (attention | ~attention.any(dim=2, keepdim=True))[:, None]
        return UNetMask(frames, attention)

    def forward(
        self, x: Tensor, mask: Tensor | UNetMask, mu: Tensor, t: Tensor, spks: Tensor, cond: Tensor
    ) -> Tensor:
        """Velocity (B, 80, T).

        x, mu, cond (B, 80, T); t (B,) flow time (any float dtype); spks (B, 80).
        mask: bool (B, 1, T) valid frames → full attention among them (offline), or (B, T, T) per
        query (e.g. `streaming_mask(cfg, T)`); a frame is valid if any query may attend it. Or that
        mask already prepared (`prepare_mask`, for x's dtype).
        """
        prepared = mask if isinstance(mask, UNetMask) else self.prepare_mask(mask, x.dtype)
        frames, attention = prepared.frames, prepared.attention
        temb = self.time_mlp(sinusoidal_time_features(t, self.cfg.in_channels).to(x.dtype))
        speaker = spks[:, :, None].expand(-1, -1, x.shape[2])
        h = torch.cat([x, mu, speaker, cond], dim=1)

        skip, h = self.down_blocks[0](h, frames, temb, attention)
        for stage in self.mid_blocks:
            _, h = stage(h, frames, temb, attention)
        _, h = self.up_blocks[0](torch.cat([h, skip], dim=1), frames, temb, attention)
        h = self.final_block(h, frames)
        return self.final_proj(h * frames) * frames
