"""Qwen2 decoder stack over a preallocated slot KV cache (MODEL_FACTS §3.1).

The cache holds `slots` independent sequences. One forward call serves a batch of slots: one
request's prompt chunk (one row, many positions) or one decode step of many requests (many rows, one
position each, every row at its own position). The same code runs both, eagerly or inside a CUDA graph:
shapes depend only on the number of rows, the query length and `kv_len`.

Module names follow Hugging Face's `Qwen2Model`, so a state dict of `embed_tokens`, `layers.N.*` and
`norm` loads unchanged.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from engines.config import Qwen2Config


@dataclass(frozen=True)
class KVCache:
    """Keys and values of every layer: `k`, `v` are [layers, slots, kv_heads, max_len, head_dim].

    A slot belongs to one sequence at a time. Positions past a sequence's current length hold stale
    values; the attention mask hides them, so a slot is reused without clearing.
    """

    k: Tensor
    v: Tensor

    @staticmethod
    def allocate(
        cfg: Qwen2Config, slots: int, max_len: int, device: torch.device, dtype: torch.dtype
    ) -> KVCache:
        shape = (cfg.num_layers, slots, cfg.num_kv_heads, max_len, cfg.head_dim)
        return KVCache(torch.zeros(shape, device=device, dtype=dtype),
                       torch.zeros(shape, device=device, dtype=dtype))

    @property
    def slots(self) -> int:
        return self.k.shape[1]

    @property
    def max_len(self) -> int:
        return self.k.shape[3]


@dataclass(frozen=True)
class CacheBatch:
    """Where a batch of query rows lives in the cache.

    `slots` names the cache slot of each row: an int s means rows are slots s, s+1, ... (read as views
    of the cache, no copy); an int64 tensor [B] lists them (gathered, and the ids may change between
    replays of a CUDA graph). `positions[b, t]` is the absolute position of query t of row b: its key and
    value are written there and it attends to positions `0..positions[b, t]` of its own slot. Attention
    reads the first `kv_len` positions, so real queries must sit below `kv_len`; queries whose output is
    discarded may point anywhere in the cache.
    """

    slots: int | Tensor
    positions: Tensor  # [B, T] int64
    kv_len: int

    def row_index(self) -> Tensor:
        """Index [B, 1] of each row along the slot axis of what `update` writes into."""
        if isinstance(self.slots, int):
            return torch.arange(self.positions.shape[0], device=self.positions.device).unsqueeze(1)
        return self.slots.unsqueeze(1)

    def update(self, layer_cache: Tensor, new: Tensor, row_index: Tensor) -> Tensor:
        """Write `new` [B, T, Hkv, D] into one layer's cache [slots, Hkv, max_len, D] at the batch's
        positions; return the rows' first `kv_len` positions [B, Hkv, kv_len, D]."""
        if isinstance(self.slots, int):
            rows = layer_cache[self.slots : self.slots + self.positions.shape[0]]
            rows[row_index, :, self.positions] = new
            return rows[:, :, : self.kv_len]
        layer_cache[row_index, :, self.positions] = new
        return layer_cache[self.slots, :, : self.kv_len]


@dataclass(frozen=True)
class _LayerInputs:
    """Per-forward tensors every layer shares."""

    rope: tuple[Tensor, Tensor]
    mask: Tensor  # [B, 1, T, kv_len], True = attend
    batch: CacheBatch
    row_index: Tensor


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: Tensor) -> Tensor:
        # Normalise in fp32, scale in the model dtype (Hugging Face's numerics).
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)


def rope_tables(positions: Tensor, head_dim: int, theta: float, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """cos and sin [B, 1, T, head_dim] for the half-split rotary layout, computed in fp32."""
    exponents = torch.arange(0, head_dim, 2, device=positions.device, dtype=torch.float32) / head_dim
    inv_freq = 1.0 / (theta**exponents)
    angles = positions.float().unsqueeze(-1) * inv_freq  # [B, T, head_dim / 2]
    angles = torch.cat((angles, angles), dim=-1).unsqueeze(1)
    return angles.cos().to(dtype), angles.sin().to(dtype)


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


def grouped_attention(q: Tensor, k: Tensor, v: Tensor, mask: Tensor) -> Tensor:
    """SDPA with grouped KV heads: q [B, Hq, T, D], k/v [B, Hkv, L, D], mask [B, 1, T, L] (True = attend).

    The query heads sharing a KV head are folded into the query-length axis, so keys and values are read
    once per KV head instead of being repeated.
    """
    batch, q_heads, length, head_dim = q.shape
    kv_heads = k.shape[1]
    group = q_heads // kv_heads
    q = q.reshape(batch, kv_heads, group * length, head_dim)
    kv_len = mask.shape[-1]
    mask = mask.unsqueeze(2).expand(batch, 1, group, length, kv_len).reshape(batch, 1, group * length, kv_len)
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    return out.reshape(batch, q_heads, length, head_dim)


class Qwen2Attention(nn.Module):
    def __init__(self, cfg: Qwen2Config) -> None:
        super().__init__()
        self.num_heads = cfg.num_heads
        self.num_kv_heads = cfg.num_kv_heads
        self.head_dim = cfg.head_dim
        self.q_proj = nn.Linear(cfg.hidden_size, cfg.num_heads * cfg.head_dim, bias=True)
        self.k_proj = nn.Linear(cfg.hidden_size, cfg.num_kv_heads * cfg.head_dim, bias=True)
        self.v_proj = nn.Linear(cfg.hidden_size, cfg.num_kv_heads * cfg.head_dim, bias=True)
        self.o_proj = nn.Linear(cfg.num_heads * cfg.head_dim, cfg.hidden_size, bias=False)

    def forward(self, x: Tensor, inputs: _LayerInputs, k_cache: Tensor, v_cache: Tensor) -> Tensor:
        rows, length, _ = x.shape
        q = self.q_proj(x).view(rows, length, self.num_heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(rows, length, self.num_kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(rows, length, self.num_kv_heads, self.head_dim)
        q = apply_rope(q, *inputs.rope)
        k = apply_rope(k, *inputs.rope)
        keys = inputs.batch.update(k_cache, k.transpose(1, 2), inputs.row_index)
        values = inputs.batch.update(v_cache, v, inputs.row_index)
        out = grouped_attention(q, keys, values, inputs.mask)
        return self.o_proj(out.transpose(1, 2).reshape(rows, length, -1))


class Qwen2MLP(nn.Module):
    def __init__(self, cfg: Qwen2Config) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Qwen2DecoderLayer(nn.Module):
    def __init__(self, cfg: Qwen2Config) -> None:
        super().__init__()
        self.self_attn = Qwen2Attention(cfg)
        self.mlp = Qwen2MLP(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x: Tensor, inputs: _LayerInputs, k_cache: Tensor, v_cache: Tensor) -> Tensor:
        x = x + self.self_attn(self.input_layernorm(x), inputs, k_cache, v_cache)
        return x + self.mlp(self.post_attention_layernorm(x))


class Qwen2Model(nn.Module):
    """Embedding table, decoder layers and final norm; runs on input embeddings, not token ids."""

    def __init__(self, cfg: Qwen2Config) -> None:
        super().__init__()
        self.cfg = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(Qwen2DecoderLayer(cfg) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x: Tensor, batch: CacheBatch, cache: KVCache) -> Tensor:
        """Final hidden states [B, T, hidden] of input embeddings `x` [B, T, hidden].

        Writes the keys and values of every query position into `cache` at `batch.positions`.
        """
        positions = batch.positions
        key_positions = torch.arange(batch.kv_len, device=x.device)
        inputs = _LayerInputs(
            rope=rope_tables(positions, self.cfg.head_dim, self.cfg.rope_theta, x.dtype),
            mask=(key_positions <= positions.unsqueeze(-1)).unsqueeze(1),
            batch=batch,
            row_index=batch.row_index(),
        )
        for layer, k_cache, v_cache in zip(self.layers, cache.k, cache.v, strict=True):
            x = layer(x, inputs, k_cache, v_cache)
        return self.norm(x)


class Qwen2ForCausalLM(nn.Module):
    """The backbone plus its text `lm_head`, tied to `embed_tokens` as in the released checkpoint.

    Speech decoding never uses the text head; it exists so the checkpoint loads strictly.
    """

    def __init__(self, cfg: Qwen2Config) -> None:
        super().__init__()
        self.model = Qwen2Model(cfg)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.tie_weights()

    def tie_weights(self) -> None:
        """Share one tensor between `lm_head` and `embed_tokens` (again after moving to another device)."""
        self.lm_head.weight = self.model.embed_tokens.weight
