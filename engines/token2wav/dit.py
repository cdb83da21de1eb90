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
length, each row's cache split into a prompt part shared by rows of the same voice (stored once, laid
out per row only transiently inside each attention call) and the row's own part, one softmax over both.
Padded frames are masked as keys and come after the real ones, so the causal convs never read them; the
conv caches are taken at each row's real end.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import cast

import torch
import torch.fx.experimental._config as fx_config
import torch.nn.functional as F
from torch import nn

from engines.checkpoints import store_as_parts
from engines.config import DiTConfig
from engines.precompiled import PrecompiledFunction, TracedInProcess, seal_kept, supported, variant_folder
from engines.token2wav import attention as attention_module
from engines.token2wav.attention import aligned_bias, attention_with_lse, merge_attention
from engines.token2wav.batching import frame_index
from engines.word_copies import cat_words

CONV_CONTEXT = 2  # causal kernel-3 convs
MODULATIONS = 9  # shift/scale/gate for attention, MLP and conv branches
SCALES = (1, 4, 7)  # the scale entries among them (applied as 1 + scale)
RAGGED_SHAPE_CLASSES = 64  # compiled variants of the batched block (see DiT.compile_blocks)
# Inductor times a pointwise kernel's candidate launch configurations at its first run and keeps the
# fastest. The block's pointwise kernels take 2-20 µs, where that timing is noise: cold starts kept
# configurations up to 3x slower for one stream's kernels, differently from start to start. Off, each
# kernel has the heuristic's one configuration, the same in every start (docs/benchmarks.md,
# thirty-fourth session).
BLOCK_INDUCTOR_SETTINGS = {"triton.autotune_pointwise": False}
# Up to this many rows (4 streams' guidance rows) a batch's attention lays the shared prompt out per row
# and runs one kernel: the copies are small and the split's extra kernels would cost more (a lone stream
# runs in the 2-stream graph bucket: ~1 ms more per first chunk split, H100). Above, the prompt is read
# in place (attention.py), which at 16–64 streams saves copies as large as the attention itself.
ONE_CALL_MAX_ROWS = 8


def one_call_attention(streams: int) -> bool:
    """Whether a batch of `streams` (two guidance rows each) lays its attention out in one call: a shape
    class of the compiled block of its own, apart from the larger batches'."""
    return 2 * streams <= ONE_CALL_MAX_ROWS


def modulated_norm(
    norm: nn.LayerNorm, x: torch.Tensor, shift: torch.Tensor, scale1p: torch.Tensor
) -> torch.Tensor:
    """norm(x)·(1 + scale) + shift; one LayerNorm call when the modulation is a (C,) vector for all rows."""
    if shift.dim() == 1:
        return F.layer_norm(x, norm.normalized_shape, scale1p, shift, norm.eps)
    return norm(x) * scale1p + shift


@dataclass(frozen=True)
class DenseKeys:
    """What the queries of one attention call see besides themselves (one tensor per row).

    past: (B, heads, T_past, 2·head_dim) keys|values before the queries' own, or None;
    mask: bool broadcastable to (B, heads, T, T_past + T), True = attend, or None (attend to all).
    """

    past: torch.Tensor | None
    mask: torch.Tensor | None


@dataclass(frozen=True)
class RaggedLayout:
    """What the padding of a ragged batch implies, equal for every Euler step of one solve
    (see `DiT.ragged_layout`). With B streams, T chunk frames, K_p prompt and T_own own-cache frames:

    bias: (2B, K_p + T_own + T) 0 where a row attends, −inf elsewhere (over [prompt, own, chunk] keys);
    prompt_bias: (2, 1, B·T, K_p) the prompt part of `bias` per query, finite (`attention.aligned_bias`);
    own_bias: (2B, 1, 1, T_own + T) its own-cache and chunk part, finite;
    conv_context: (2B, 2) int64, see CausalConvBranch.forward_ragged.
    """

    bias: torch.Tensor
    prompt_bias: torch.Tensor
    own_bias: torch.Tensor
    conv_context: torch.Tensor


@dataclass(frozen=True)
class SplitKeys:
    """Keys of a padded batch of 2B rows (B streams, conditional rows first, then unconditional).

    prompt: (2, heads, K_p, 2·head_dim) keys|values shared by all conditional (index 0) resp.
      unconditional (1) rows, e.g. the prompts of the batch's voices side by side;
    own: (2B, heads, T_own, 2·head_dim) each row's own cached frames;
    layout: which of [prompt, own, the chunk's T frames] each row attends to; every row must attend to
      at least one own or chunk key.
    """

    prompt: torch.Tensor
    own: torch.Tensor
    layout: RaggedLayout


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
    """Multi-head attention with per-head LayerNorm on queries and keys; no positions.

    `to_qkv` is the checkpoint's `to_q`, `to_k` and `to_v` stacked: one matmul per call instead of three
    (a first chunk's call is launch-bound); state-dict hooks keep the checkpoint's names.
    """

    def __init__(self, cfg: DiTConfig) -> None:
        super().__init__()
        self.num_heads = cfg.num_heads
        self.head_dim = cfg.head_dim
        hidden = cfg.hidden_size
        self.to_qkv = nn.Linear(hidden, 3 * hidden)
        self.q_norm = nn.LayerNorm(cfg.head_dim, eps=1e-5)
        self.k_norm = nn.LayerNorm(cfg.head_dim, eps=1e-5)
        self.proj = nn.Linear(hidden, hidden)
        store_as_parts(self, "to_qkv", (("to_q", hidden), ("to_k", hidden), ("to_v", hidden)))

    def forward(self, x: torch.Tensor, keys: DenseKeys | SplitKeys) -> tuple[torch.Tensor, torch.Tensor]:
        """x (B, T, C) attends to itself and `keys`. Returns (B, T, C) and x's keys|values
        (B, heads, T, 2·head_dim)."""
        b, t, _ = x.shape
        # (B, T, heads, head_dim): the per-head norms run on contiguous rows.
        q, k, v = self.to_qkv(x).view(b, t, 3, self.num_heads, self.head_dim).unbind(2)
        q, k = self.q_norm(q), self.k_norm(k)
        new_kv = torch.cat([k, v], dim=-1).transpose(1, 2)
        if isinstance(keys, SplitKeys):
            return self.proj(self._split_attention(q, new_kv, keys)), new_kv
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        if keys.past is not None:
            past_k, past_v = keys.past.split(self.head_dim, dim=-1)
            k = torch.cat([past_k, k], dim=2)
            v = torch.cat([past_v, v], dim=2)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=keys.mask)
        return self.proj(out.transpose(1, 2).reshape(b, t, -1)), new_kv

    def _split_attention(self, q: torch.Tensor, new_kv: torch.Tensor, keys: SplitKeys) -> torch.Tensor:
        """Attention of q (2B, T, heads, head_dim) over [shared prompt, own cache, chunk] keys; new_kv
        (2B, heads, T, 2·head_dim) are the chunk's. Returns (2B, T, C).

        Up to `ONE_CALL_MAX_ROWS` rows, each row's keys are laid out once per call (one copy that reads
        the shared prompt in place) and one fused kernel serves the batch. Above, the prompt part runs
        once per guidance half over all its rows' queries and the own part once per row, merged by
        their log-sum-exps (attention.py): no per-row copy of the prompt.
        """
        rows, t, heads, dim = q.shape
        if rows <= ONE_CALL_MAX_ROWS:
            return self._one_call_attention(q, new_kv, keys)
        streams = rows // 2
        own = new_kv if keys.own.shape[2] == 0 else torch.cat([keys.own, new_kv], dim=2)
        halves = q.reshape(2, streams * t, heads, dim).transpose(1, 2)
        prompt, prompt_lse = attention_with_lse(halves, keys.prompt[..., :dim], keys.prompt[..., dim:],
                                                keys.layout.prompt_bias)
        chunk, chunk_lse = attention_with_lse(q.transpose(1, 2), own[..., :dim], own[..., dim:],
                                              keys.layout.own_bias)
        out = merge_attention(prompt.transpose(1, 2).reshape(rows, t, heads, dim),
                              prompt_lse.view(rows, t, heads, 1),
                              chunk.transpose(1, 2), chunk_lse.unsqueeze(-1))
        return out.reshape(rows, t, heads * dim)

    def _one_call_attention(self, q: torch.Tensor, new_kv: torch.Tensor, keys: SplitKeys) -> torch.Tensor:
        rows, t, heads, dim = q.shape
        halves = (2, rows // 2)
        prompt = keys.prompt.unsqueeze(1).expand(*halves, *keys.prompt.shape[1:])
        own, new = keys.own.view(*halves, *keys.own.shape[1:]), new_kv.view(*halves, *new_kv.shape[1:])
        kv = torch.cat([prompt, own, new], dim=3).view(rows, heads, -1, 2 * dim)
        bias = keys.layout.bias[:, None, None, :]
        out = F.scaled_dot_product_attention(q.transpose(1, 2), kv[..., :dim], kv[..., dim:], attn_mask=bias)
        return out.transpose(1, 2).reshape(rows, t, heads * dim)


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
        # The conv weights (C_out, C_in, taps) are stored tap-major, so that `_matmul_conv` reads each tap's
        # (C_out, C_in) matrix in place; loading copies into this storage and `.to()` keeps it.
        for name in ("1", "6"):
            conv = cast(nn.Conv1d, self.block[name])
            conv.weight = nn.Parameter(conv.weight.detach().permute(2, 0, 1).contiguous().permute(1, 2, 0))

    def forward(self, x: torch.Tensor, cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x (B, T, C); cache (B, 2·C, 2) = last input frames of conv1 | conv2. Returns (B, T, C), cache."""
        first_ctx, second_ctx = cache.chunk(2, dim=1)
        h = torch.cat([first_ctx, x.transpose(1, 2)], dim=2)
        new_first = h[:, :, -CONV_CONTEXT:]
        h = F.mish(self.block["3"](self.block["1"](h).transpose(1, 2))).transpose(1, 2)
        h = torch.cat([second_ctx, h], dim=2)
        new_second = h[:, :, -CONV_CONTEXT:]
        return self.block["6"](h).transpose(1, 2), torch.cat([new_first, new_second], dim=1)

    def forward_ragged(
        self, x: torch.Tensor, cache: torch.Tensor, context: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """`forward` for right-padded rows; context (B, 2) int64: positions of each row's last 2 real
        frames in [cache, x] (batching.frame_index), where the new cache is taken.

        Runs time-major, each conv as one matmul (`_matmul_conv`): on GPUs that avoids the layout
        transforms cuDNN adds around 1-D convs (`forward` keeps Conv1d, which exporters map natively).
        """
        first_ctx, second_ctx = cache.chunk(2, dim=1)
        h = torch.cat([first_ctx.transpose(1, 2), x], dim=1)
        new_first = self._frames(h, context)
        h = F.mish(self.block["3"](self._matmul_conv(cast(nn.Conv1d, self.block["1"]), h)))
        h = torch.cat([second_ctx.transpose(1, 2), h], dim=1)
        new_second = self._frames(h, context)
        new_cache = torch.cat([new_first, new_second], dim=2).transpose(1, 2)
        return self._matmul_conv(cast(nn.Conv1d, self.block["6"]), h), new_cache

    @staticmethod
    def _frames(h: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
        """Frames `index` (B, n) of each row of time-major h (B, T, C) → (B, n, C)."""
        return h.gather(1, index[:, :, None].expand(-1, -1, h.shape[2]))

    @staticmethod
    def _matmul_conv(conv: nn.Conv1d, h: torch.Tensor) -> torch.Tensor:
        """Valid conv of time-major h (B, T + taps − 1, C) → (B, T, C_out): one matmul of every frame with
        all taps' weights (taps·C_out outputs), then output frame t sums tap k's product of frame t + k.

        No window of frames is laid out (an unfold writes taps copies of h, which compiled code with
        dynamic shapes did at a fraction of the bandwidth), and the sum fuses into what reads the output.
        """
        b, frames, _ = h.shape
        out_channels, _, taps = conv.weight.shape
        # (taps·C_out, C_in): a view of the tap-major storage (__init__), a copy of any other.
        products = F.linear(h, conv.weight.permute(2, 0, 1).reshape(taps * out_channels, -1))
        products = products.view(b, frames, taps, out_channels)
        out_frames = frames - taps + 1
        out = products[:, :out_frames, 0] + cast(torch.Tensor, conv.bias)
        for tap in range(1, taps):
            out = out + products[:, tap : tap + out_frames, tap]
        return out


class Mlp(nn.Module):
    def __init__(self, channels: int, hidden: int) -> None:
        super().__init__()
        self.fc1 = nn.Linear(channels, hidden)
        self.fc2 = nn.Linear(hidden, channels)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if torch.onnx.is_in_onnx_export():  # ONNX has no fused op for it: the same function, unfused
            return self.fc2(F.gelu(self.fc1(x), approximate="tanh"))
        # fc1, its bias and the tanh GELU in one GEMM (cuBLASLt's epilogue on CUDA; a CPU applies the
        # same GELU after the matmul): one kernel less per block, whose output is the MLP's widest tensor.
        flat = torch._addmm_activation(self.fc1.bias, x.reshape(-1, x.shape[-1]), self.fc1.weight.t(),
                                       use_gelu=True)
        return self.fc2(flat.view(*x.shape[:-1], -1))


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

    def modulation(self, c: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """The 9 modulation vectors of conditioning c (…, C), scales as 1 + scale."""
        parts = list(self.adaLN_modulation(c).chunk(MODULATIONS, dim=-1))
        for i in SCALES:
            parts[i] = 1 + parts[i]
        return tuple(parts)

    def forward(
        self,
        x: torch.Tensor,
        modulation: tuple[torch.Tensor, ...],
        keys: DenseKeys | SplitKeys,
        conv_cache: torch.Tensor,
        conv_context: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x (B, T, C) → x, x's attention keys|values, new conv cache.

        modulation: `self.modulation(c)` for c (B, 1, C), or for c (C,) shared by all rows (cheaper);
        conv_context: for right-padded rows, see CausalConvBranch.forward_ragged.
        """
        (shift_msa, scale_msa, gate_msa, shift_mlp, scale_mlp, gate_mlp,
         shift_conv, scale_conv, gate_conv) = modulation
        attended, kv = self.attn(modulated_norm(self.norm1, x, shift_msa, scale_msa), keys)
        x = torch.addcmul(x, gate_msa, attended)
        conv_in = modulated_norm(self.norm3, x, shift_conv, scale_conv)
        if conv_context is None:
            convolved, conv_cache = self.conv(conv_in, conv_cache)
        else:
            convolved, conv_cache = self.conv.forward_ragged(conv_in, conv_cache, conv_context)
        x = torch.addcmul(x, gate_conv, convolved)
        x = torch.addcmul(x, gate_mlp, self.mlp(modulated_norm(self.norm2, x, shift_mlp, scale_mlp)))
        return x, kv, conv_cache


class FinalLayer(nn.Module):
    def __init__(self, hidden: int, out_channels: int) -> None:
        super().__init__()
        self.norm_final = nn.LayerNorm(hidden, elementwise_affine=False, eps=1e-6)
        self.adaLN_modulation = nn.Sequential(nn.SiLU(), nn.Linear(hidden, 2 * hidden))
        self.linear = nn.Linear(hidden, out_channels)

    def modulation(self, c: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(shift, 1 + scale) of conditioning c (…, C)."""
        shift, scale = self.adaLN_modulation(c).chunk(2, dim=-1)
        return shift, 1 + scale

    def forward(self, x: torch.Tensor, modulation: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        return self.linear(modulated_norm(self.norm_final, x, *modulation))


@dataclass(frozen=True)
class StepConditioning:
    """What the time t of one Euler step contributes, shared by every row (see `DiT.conditioning`)."""

    blocks: tuple[tuple[torch.Tensor, ...], ...]  # per block, its 9 modulation vectors (C,)
    final: tuple[torch.Tensor, torch.Tensor]


def block_folder(root: Path, cfg: DiTConfig, dtype: torch.dtype, device: torch.device) -> Path | None:
    """Where `DiT.compile_blocks(precompiled=root)` keeps the batched block's variants for a DiT of `cfg`
    in `dtype` on `device` (None: not kept, logged): one folder per what the saved graphs bake in, the
    code they compiled, the sizes, the dtype and the GPU."""
    modules = (sys.modules[__name__], attention_module)
    return variant_folder(root, "dit-block", modules, (str(cfg), str(dtype)), device)


class DiT(nn.Module):
    """Velocity estimator v(x, t | mu, spks, cond); tensors are (B, 80, T) channel-first at the edges."""

    def __init__(self, cfg: DiTConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.t_embedder = TimestepEmbedder(cfg.hidden_size, cfg.time_embed_dim)
        self.in_proj = nn.Linear(cfg.in_channels, cfg.hidden_size)
        self.blocks = nn.ModuleList(DiTBlock(cfg) for _ in range(cfg.depth))
        self.final_layer = FinalLayer(cfg.hidden_size, cfg.out_channels)
        self._ragged_block: Callable[..., tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = DiTBlock.forward

    @property
    def _blocks(self) -> list[DiTBlock]:
        return cast(list[DiTBlock], self.blocks)

    def _in(self, x: torch.Tensor, mu: torch.Tensor, spks: torch.Tensor, cond: torch.Tensor) -> torch.Tensor:
        speaker = spks[:, :, None].expand(-1, -1, x.shape[2])
        return self.in_proj(torch.cat([x, mu, speaker, cond], dim=1).transpose(1, 2))

    def _run_blocks(
        self, x: torch.Tensor, mu: torch.Tensor, t: torch.Tensor, spks: torch.Tensor, cond: torch.Tensor,
        keys: list[DenseKeys], cnn_cache: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        h, c = self._in(x, mu, spks, cond), self.t_embedder(t)[:, None, :]
        new_cnn, new_kv = [], []
        for block, block_keys, conv_cache in zip(self._blocks, keys, cnn_cache, strict=True):
            h, kv, conv_cache = block(h, block.modulation(c), block_keys, conv_cache)
            new_cnn.append(conv_cache)
            new_kv.append(kv)
        v = self.final_layer(h, self.final_layer.modulation(c)).transpose(1, 2)
        return v, torch.stack(new_cnn), torch.stack(new_kv)

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
        keys = [DenseKeys(past=None, mask=mask.bool()[:, None])] * self.cfg.depth
        conv_cache = x.new_zeros(self.cfg.depth, x.shape[0], 2 * self.cfg.hidden_size, CONV_CONTEXT)
        return self._run_blocks(x, mu, t, spks, cond, keys, conv_cache)[0]

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
        keys = [DenseKeys(past=past, mask=None) for past in att_cache]
        return self._run_blocks(x, mu, t, spks, cond, keys, cnn_cache)

    def compile_blocks(self, backend: str = "inductor", precompiled: Path | None = None) -> None:
        """Run the blocks of `forward_ragged` (the batched streaming path that CUDA graphs replay) through
        torch.compile (Inductor, dynamic shapes): the elementwise work between the matmuls (norms,
        modulation, gates, the conv branch's padding and activation) fuses into a few kernels. All 16
        blocks share the compiled code of a shape class; a new class compiles on its first call, so run
        each shape once before capturing it in a CUDA graph (as `graphs.capture_graph` does). The other
        paths stay eager: a voice prepared or a chunk run alone never waits for a compilation.
        `backend`: another torch.compile backend, e.g. "aot_eager" to check the tracing on a CPU.

        Shape classes: own cache empty or not, one row or more, and on CUDA whether the key and chunk
        lengths are multiples of 8 (the fused attention's alignment); the warm-up alone meets more than
        torch.compile's default of 8 recompilations, past which a shape would run uncompiled. Duck
        shaping is off: with it, a batch whose row count equals another size of the call (128 rows =
        2·head_dim at 64 streams) was compiled as a class of its own, once per batch bucket.

        `precompiled`: a folder where each class's compiled block is kept (engines/precompiled.py), so a
        later process loads it instead of tracing the block again; Inductor only."""
        import torch._inductor.config as inductor_config  # Inductor's import: only where blocks compile

        compiled = torch.compile(DiTBlock.forward, dynamic=True, backend=backend)
        # Floats (the norms' eps) are constants: as dynamic inputs Dynamo converts them to tensors and
        # restarts its analysis, one more trace of the block in every process.
        limited = torch._dynamo.config.patch(recompile_limit=RAGGED_SHAPE_CLASSES,
                                             specialize_float=True)(compiled)
        jit = fx_config.patch(use_duck_shape=False)(limited)  # type: ignore[attr-defined]
        jit = inductor_config.patch(BLOCK_INDUCTOR_SETTINGS)(jit)
        self._ragged_block = TracedInProcess(jit)
        if precompiled is not None and backend == "inductor" and supported():
            weight = self.in_proj.weight
            folder = block_folder(precompiled, self.cfg, weight.dtype, weight.device)
            if folder is not None:
                self._ragged_block = PrecompiledFunction(DiTBlock.forward, folder, jit,
                                                         inductor=BLOCK_INDUCTOR_SETTINGS)

    @property
    def kept_block(self) -> PrecompiledFunction | None:
        """The batched block kept ahead of time (`compile_blocks(precompiled=...)`), if it is."""
        block = self._ragged_block
        return block if isinstance(block, PrecompiledFunction) else None

    def seal_compilation(self) -> None:
        """Compile no more block variants (see `compile_blocks`): a class met later runs uncompiled."""
        seal_kept(self._ragged_block)

    def conditioning(self, t: float) -> StepConditioning:
        """The modulation vectors of time t for every block and the final layer (for `forward_ragged`)."""
        c = self.t_embedder(torch.tensor([t], device=self.in_proj.weight.device))[0]
        return StepConditioning(tuple(block.modulation(c) for block in self._blocks),
                                self.final_layer.modulation(c))

    def ragged_layout(
        self, lengths: torch.Tensor, mask: torch.Tensor, prompt_frames: int, frames: int
    ) -> RaggedLayout:
        """The attention biases and conv contexts of a padded batch, for every step of its solve.

        lengths (2B,) int64: real chunk frames per row; mask (2B, K_p + T_own + T) bool, True = attend
        (over [prompt, own cache, chunk] keys, as in `SplitKeys`); prompt_frames K_p; frames T.
        """
        dtype = self.in_proj.weight.dtype
        bias = torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill_(~mask, float("-inf"))
        rows = mask.shape[0]
        per_query = mask[:, :prompt_frames].view(2, rows // 2, 1, prompt_frames).expand(-1, -1, frames, -1)
        prompt_bias = aligned_bias(per_query.reshape(2, 1, rows // 2 * frames, prompt_frames), dtype)
        own_bias = aligned_bias(mask[:, None, None, prompt_frames:], dtype)
        return RaggedLayout(bias, prompt_bias, own_bias, frame_index(lengths + CONV_CONTEXT, CONV_CONTEXT))

    def forward_ragged(
        self,
        x: torch.Tensor,
        mu: torch.Tensor,
        spks: torch.Tensor,
        conditioning: StepConditioning,
        layout: RaggedLayout,
        cnn_cache: torch.Tensor,
        prompt_kv: torch.Tensor,
        own_kv: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """One Euler step of a padded batch of streaming chunks (cond = 0: the prompt is in the caches).

        x, mu (2B, 80, T) right-padded; spks (2B, 80); conditioning: of the step's time t, shared by all
        rows; layout: `ragged_layout` of the batch; cnn_cache (depth, 2B, 2·hidden, 2); prompt_kv
        (depth, 2, heads, K_p, 2·hd) and own_kv (depth, 2B, heads, T_own, 2·hd), as in `SplitKeys`.
        Returns velocity (2B, 80, T), the new cnn cache (each row's last real frames) and the chunk's
        keys|values (depth, 2B, heads, T, 2·hd), padded frames included.
        """
        h = self._in(x, mu, spks, torch.zeros_like(x))
        new_cnn, new_kv = [], []
        run_block = self._ragged_block
        for block, modulation, conv_cache, prompt, own in zip(
            self._blocks, conditioning.blocks, cnn_cache, prompt_kv, own_kv, strict=True
        ):
            keys = SplitKeys(prompt, own, layout)
            h, kv, conv_cache = run_block(block, h, modulation, keys, conv_cache, layout.conv_context)
            new_cnn.append(conv_cache)
            new_kv.append(kv)
        v = self.final_layer(h, conditioning.final).transpose(1, 2)
        # Stacked as 8-byte words: PyTorch's batched copy moves one 2-byte element per access otherwise.
        return v, torch.stack(new_cnn), cat_words(tuple(kv[None] for kv in new_kv), dim=0)
