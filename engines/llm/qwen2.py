"""Qwen2 decoder stack over a preallocated slot KV cache (MODEL_FACTS §3.1).

The cache holds `slots` independent sequences. One forward call serves a batch of slots: one
request's prompt chunk (one row, many positions) or one decode step of many requests (many rows, one
position each, every row at its own position). The same code runs both, eagerly or inside a CUDA graph:
shapes depend only on the number of rows, the query length and `kv_len`.

Module names follow Hugging Face's `Qwen2Model`, so a state dict of `embed_tokens`, `layers.N.*` and
`norm` loads unchanged. Inside, the q/k/v projections and the gate/up projections are each one fused
linear layer (fewer, larger kernels per decode step); state-dict hooks store them as the checkpoint's
separate tensors.
"""

from __future__ import annotations

import dataclasses
import itertools
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, cast

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from engines.checkpoints import store_as_parts
from engines.config import Qwen2Config
from engines.precompiled import compile_kept, seal_kept

# The memory-efficient attention kernel reads mask rows whose stride is a multiple of this (elements).
MASK_ALIGNMENT = 16


@dataclass(frozen=True)
class KVCache:
    """Keys and values of every layer in one tensor `kv` [layers, slots, 2 * kv_heads, max_len, head_dim]:
    the first `kv_heads` heads of a layer hold keys, the others values (one write stores both).

    A slot belongs to one sequence at a time. Positions past a sequence's current length hold stale
    values; the attention mask hides them, so a slot is reused without clearing.
    """

    kv: Tensor

    @staticmethod
    def allocate(
        cfg: Qwen2Config, slots: int, max_len: int, device: torch.device, dtype: torch.dtype
    ) -> KVCache:
        shape = (cfg.num_layers, slots, 2 * cfg.num_kv_heads, max_len, cfg.head_dim)
        return KVCache(torch.zeros(shape, device=device, dtype=dtype))

    @property
    def slots(self) -> int:
        return self.kv.shape[1]

    @property
    def max_len(self) -> int:
        return self.kv.shape[3]


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
    # Every row's queries sit at positions 0..T-1 (a prompt's first chunk): then a query attends only to
    # keys of its own chunk, causally, and attention runs on them without reading the cache or a mask
    # (the keys and values are still written).
    from_start: bool = False

    def row_index(self) -> Tensor:
        """Index [B, 1] of each row along the slot axis of what `update` writes into."""
        if isinstance(self.slots, int):
            return torch.arange(self.positions.shape[0], device=self.positions.device).unsqueeze(1)
        return self.slots.unsqueeze(1)

    def write(self, layer_cache: Tensor, new: Tensor, row_index: Tensor) -> None:
        """Write `new` [B, T, H, D] into one layer's cache [slots, H, max_len, D] at the batch's positions."""
        if isinstance(self.slots, int):
            rows = layer_cache[self.slots : self.slots + self.positions.shape[0]]
            rows[row_index, :, self.positions] = new
        else:
            layer_cache[row_index, :, self.positions] = new

    def update(self, layer_cache: Tensor, new: Tensor, row_index: Tensor) -> Tensor:
        """`write`, then return the rows' first `kv_len` positions [B, H, kv_len, D] (a view for
        consecutive slots, a gathered copy for listed ones)."""
        self.write(layer_cache, new, row_index)
        if isinstance(self.slots, int):
            return layer_cache[self.slots : self.slots + self.positions.shape[0], :, : self.kv_len]
        return layer_cache[self.slots, :, : self.kv_len]


@dataclass(frozen=True)
class _LayerInputs:
    """Per-forward tensors (and the kernels) every layer shares."""

    ops: LayerKernels
    rope: tuple[Tensor, Tensor]
    # [B, 1, group * T, kv_len] additive (0 or -inf), query heads folded as in grouped_attention; None
    # when the decode attention kernel runs instead
    mask: Tensor | None
    batch: CacheBatch
    row_index: Tensor

    @property
    def decode_kernel(self) -> DecodeAttentionFn | None:
        """The decode attention kernel, if it serves this call: one query per row over consecutive slots."""
        batch = self.batch
        if batch.positions.shape[1] == 1 and isinstance(batch.slots, int):
            return self.ops.decode_attention
        return None

    @property
    def decode_linears(self) -> DecodeProjections | None:
        """The fused decode projections, if they serve this call: a decode step through the decode
        attention kernel, of few enough rows."""
        linears = self.ops.decode_linears
        if linears is None or self.decode_kernel is None:
            return None
        return linears if linears.serves(self.batch.positions.shape[0]) else None


def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    # One fused kernel on CUDA. Statistics in fp32 as in Hugging Face's implementation; the weight is
    # applied before the result is rounded to the model dtype (HF rounds first).
    return F.rms_norm(x, weight.shape, weight, eps)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: Tensor, kernel: Callable[[Tensor, Tensor, float], Tensor] = rms_norm) -> Tensor:
        """`kernel` is `rms_norm` or a compiled copy (`LayerKernels`)."""
        return kernel(x, self.weight, self.eps)


def rope_tables(positions: Tensor, head_dim: int, theta: float, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """cos and signed sin [B, T, 1, head_dim] for the half-split rotary layout, computed in fp32.

    The first half of the sin table is negated, so `apply_rope_` needs no negation of its own.
    """
    exponents = torch.arange(0, head_dim, 2, device=positions.device, dtype=torch.float32) / head_dim
    inv_freq = 1.0 / (theta**exponents)
    angles = positions.float().unsqueeze(-1) * inv_freq  # [B, T, head_dim / 2]
    sin, cos = angles.sin(), angles.cos()
    cos = torch.cat((cos, cos), dim=-1).unsqueeze(2)
    return cos.to(dtype), torch.cat((-sin, sin), dim=-1).unsqueeze(2).to(dtype)


def apply_rope_(x: Tensor, cos: Tensor, signed_sin: Tensor) -> None:
    """Rotate heads `x` [B, T, H, D] (may be a view) in place by the tables of `rope_tables`."""
    half = x.shape[-1] // 2
    swapped = torch.cat((x[..., half:], x[..., :half]), dim=-1)
    x.mul_(cos).addcmul_(swapped, signed_sin)


def silu_mul(gate_up: Tensor) -> Tensor:
    """SwiGLU's silu(gate) · up of the stacked [gate | up] projection."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


# An `engines.llm.decode_attention.DecodeAttention`: (qkv [B, Hq + 2 Hkv, D], (cos, sin) [B, D], layer
# cache, first slot, positions [B], kv_len) -> attention output [B, Hq, D], the new keys and values stored.
DecodeAttentionFn = Callable[[Tensor, tuple[Tensor, Tensor], Tensor, int, Tensor, int], Tensor]


class DecodeProjections(Protocol):
    """A decode step's projections with the norms, SwiGLU and residual sums fused in
    (`engines.llm.decode_linear.DecodeLinears`); rows are [B, features]."""

    def serves(self, rows: int) -> bool: ...

    def norm_linear(self, x: Tensor, norm_weight: Tensor, eps: float, weight: Tensor, bias: Tensor | None,
                    gated: bool = False) -> Tensor:
        """rms_norm(x) @ weight^T + bias; `gated`: weight is [gate | up], the result silu(gate) · up."""
        ...

    def add_linear_(self, residual: Tensor, x: Tensor, weight: Tensor) -> Tensor:
        """`residual += x @ weight^T`, in place; returns residual."""
        ...


@dataclass(frozen=True)
class LayerKernels:
    """The steps of a layer besides its matmuls: eager, or fused kernels (on CUDA a decode step is
    launch-bound, and each fused kernel saves a few microseconds per layer).

    `decode_attention`, when set, replaces rope, the cache write and SDPA of decode calls (one query
    per row over consecutive slots) by one kernel; other calls take the general path. `decode_linears`,
    when set too, runs such calls' norms and projections (4 launches per layer besides attention) for
    the row counts it serves.
    """

    rope_: Callable[[Tensor, Tensor, Tensor], None]
    silu_mul: Callable[[Tensor], Tensor]
    rms_norm: Callable[[Tensor, Tensor, float], Tensor]
    decode_attention: DecodeAttentionFn | None = None
    decode_linears: DecodeProjections | None = None

    @staticmethod
    def compiled(precompiled: Path | None = None, device: torch.device | None = None) -> LayerKernels:
        """The same functions through torch.compile (Inductor): one kernel each instead of 3 and 2 for
        rope and SwiGLU; for RMSNorm one kernel still, with the same results (H100, 2026-11-24: 1.7 µs
        against 2.2 µs for one row).

        Shapes are dynamic so the batch and length buckets share the compiled code; a call compiles on
        its first shape, so run each shape once before capturing it in a CUDA graph. `precompiled`: a
        folder where each function's compiled shape classes are kept for later processes
        (engines/precompiled.py; `device` names the GPU they are for); `seal` once warmed up.
        """

        def compile_(fn: Callable[..., Any], row_wise: bool = False) -> Callable[..., Any]:
            return compile_kept(fn, precompiled, f"llm-{fn.__name__}", (sys.modules[__name__],), device,
                                inference=False, size_oblivious=row_wise)

        # SwiGLU and RMSNorm work along the last axis alone: one compiled class serves decode steps (one
        # position) and prefills, one row and many (four classes each otherwise, ~2 s of a cold start
        # apiece). Rope broadcasts its tables over the heads: specialised as before.
        return LayerKernels(rope_=compile_(apply_rope_), silu_mul=compile_(silu_mul, row_wise=True),
                            rms_norm=compile_(rms_norm, row_wise=True))

    def seal(self) -> None:
        """Compile no more variants of the kept functions (`compiled(precompiled=...)`)."""
        seal_kept(self.rope_, self.silu_mul, self.rms_norm)


EAGER_KERNELS = LayerKernels(rope_=apply_rope_, silu_mul=silu_mul, rms_norm=rms_norm)


def add_linear_(residual: Tensor, x: Tensor, layer: nn.Linear) -> Tensor:
    """`residual += layer(x)` for a bias-free layer, with the sum done by the matmul (one kernel).

    `residual` [..., out] must be contiguous; it is returned.
    """
    flat = residual.view(-1, residual.shape[-1])
    flat.addmm_(x.reshape(-1, x.shape[-1]), layer.weight.t())
    return residual


def attention_mask(positions: Tensor, kv_len: int, group: int, dtype: torch.dtype) -> Tensor:
    """Additive causal mask [B, 1, group * T, kv_len] for queries at `positions` [B, T], laid out for
    `grouped_attention` (the `group` query heads of a KV head stacked along the query axis)."""
    key_positions = torch.arange(kv_len, device=positions.device)
    allowed = key_positions <= positions.unsqueeze(-1)  # [B, T, kv_len]
    mask = torch.zeros(allowed.shape, dtype=dtype, device=positions.device)
    mask.masked_fill_(~allowed, float("-inf"))
    batch, length = positions.shape
    return mask.unsqueeze(1).expand(batch, group, length, kv_len).reshape(batch, 1, group * length, kv_len)


def grouped_attention(q: Tensor, k: Tensor, v: Tensor, mask: Tensor) -> Tensor:
    """SDPA with grouped KV heads: q [B, Hq, T, D], k/v [B, Hkv, L, D], mask from `attention_mask`.

    The query heads sharing a KV head are folded into the query-length axis, so keys and values are read
    once per KV head instead of being repeated.
    """
    batch, q_heads, length, head_dim = q.shape
    q = q.reshape(batch, k.shape[1], -1, head_dim)
    if q.is_cuda and mask.shape[-1] % MASK_ALIGNMENT == 0:
        # The memory-efficient kernel, called directly, not SDPA's pick (cuDNN's on an H100): cuDNN
        # builds an execution plan for every new shape on its first call (~50 ms of host time), once per
        # prefill graph at every start (44 graphs: 2.2 s), for a small part of a prefill's time. (SDPA's
        # backend switch, `sdpa_kernel`, sets flags of the whole process, which the DiT's threads read.)
        bias = mask.expand(batch, k.shape[1], mask.shape[2], mask.shape[3])
        out = torch.ops.aten._scaled_dot_product_efficient_attention(q, k, v, bias, False)[0]
    else:
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    return out.reshape(batch, q_heads, length, head_dim)


def causal_attention(q: Tensor, k: Tensor, v: Tensor) -> Tensor:
    """Causal self-attention of a chunk starting at position 0: q [B, Hq, T, D], k/v [B, Hkv, T, D]
    (grouped heads); returns [B, Hq, T, D].

    On CUDA this is the flash kernel, called directly for the reason given in `grouped_attention`
    (reading no mask: a one-row prompt's attention took 31 µs per layer through the masked
    memory-efficient kernel against 512 keys; H100, 2026-11-27). The kernel serves grouped key/value
    heads as they are. Elsewhere (the CPU, fp32, GPUs before Ampere, which the kernel does not serve)
    SDPA picks a kernel.
    """
    if (q.is_cuda and q.dtype in (torch.float16, torch.bfloat16)
            and torch.cuda.get_device_capability(q.device) >= (8, 0)):
        return torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, 0.0, True)[0]
    return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)


class Qwen2Attention(nn.Module):
    """Self-attention; `qkv_proj` is the checkpoint's `q_proj`, `k_proj` and `v_proj` stacked."""

    def __init__(self, cfg: Qwen2Config) -> None:
        super().__init__()
        self.num_heads = cfg.num_heads
        self.num_kv_heads = cfg.num_kv_heads
        self.head_dim = cfg.head_dim
        q_size, kv_size = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        self.qkv_proj = nn.Linear(cfg.hidden_size, q_size + 2 * kv_size, bias=True)
        self.o_proj = nn.Linear(q_size, cfg.hidden_size, bias=False)
        store_as_parts(self, "qkv_proj", (("q_proj", q_size), ("k_proj", kv_size), ("v_proj", kv_size)))

    def forward(self, x: Tensor, inputs: _LayerInputs, layer_cache: Tensor, residual: Tensor) -> Tensor:
        """`residual` + attention output of normalised `x` [B, T, hidden], added into `residual` in place."""
        rows, length, _ = x.shape
        heads, kv_heads = self.num_heads, self.num_kv_heads
        qkv = self.qkv_proj(x).view(rows, length, -1, self.head_dim)  # [B, T, Hq + 2 Hkv, D]
        batch, decode_kernel = inputs.batch, inputs.decode_kernel
        if decode_kernel is not None:
            out = self.decode_attention(qkv[:, 0], decode_kernel, inputs, layer_cache)
            return add_linear_(residual, out.view(rows, length, -1), self.o_proj)
        inputs.ops.rope_(qkv[:, :, : heads + kv_heads], *inputs.rope)  # in place: k and v stay side by side
        queries = qkv[:, :, :heads].transpose(1, 2)
        if batch.from_start:  # stored for later chunks and decode steps, not read back
            batch.write(layer_cache, qkv[:, :, heads:], inputs.row_index)
            keys, values = qkv[:, :, heads:].transpose(1, 2).split(kv_heads, dim=1)
            out = causal_attention(queries, keys, values)
        else:
            kv = batch.update(layer_cache, qkv[:, :, heads:], inputs.row_index)
            keys, values = kv.split(kv_heads, dim=1)
            assert inputs.mask is not None
            out = grouped_attention(queries, keys, values, inputs.mask)
        return add_linear_(residual, out.transpose(1, 2).reshape(rows, length, -1), self.o_proj)

    @staticmethod
    def decode_attention(qkv: Tensor, kernel: DecodeAttentionFn, inputs: _LayerInputs, layer_cache: Tensor
                         ) -> Tensor:
        """Attention output [B, Hq, D] of a decode step's rows from their projections `qkv` [B, Hq + 2 Hkv, D]
        (before rope), their keys and values stored."""
        cos, sin = inputs.rope
        batch = inputs.batch
        return kernel(qkv, (cos[:, 0, 0], sin[:, 0, 0]), layer_cache, cast(int, batch.slots),
                      batch.positions[:, 0], batch.kv_len)


class Qwen2MLP(nn.Module):
    """SwiGLU feed-forward; `gate_up_proj` is the checkpoint's `gate_proj` and `up_proj` stacked."""

    def __init__(self, cfg: Qwen2Config) -> None:
        super().__init__()
        self.gate_up_proj = nn.Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)
        size = cfg.intermediate_size
        store_as_parts(self, "gate_up_proj", (("gate_proj", size), ("up_proj", size)))

    def forward(self, x: Tensor, ops: LayerKernels, residual: Tensor) -> Tensor:
        """`residual` + feed-forward output of normalised `x`, added into `residual` in place."""
        return add_linear_(residual, ops.silu_mul(self.gate_up_proj(x)), self.down_proj)


class Qwen2DecoderLayer(nn.Module):
    def __init__(self, cfg: Qwen2Config) -> None:
        super().__init__()
        self.self_attn = Qwen2Attention(cfg)
        self.mlp = Qwen2MLP(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x: Tensor, inputs: _LayerInputs, layer_cache: Tensor) -> Tensor:
        """Update the residual stream `x` [B, T, hidden] (contiguous) in place; return it."""
        linears = inputs.decode_linears
        if linears is not None:
            return self._fused_decode(x, inputs, layer_cache, linears)
        norm = inputs.ops.rms_norm
        x = self.self_attn(self.input_layernorm(x, norm), inputs, layer_cache, residual=x)
        return self.mlp(self.post_attention_layernorm(x, norm), inputs.ops, residual=x)

    def _fused_decode(self, x: Tensor, inputs: _LayerInputs, layer_cache: Tensor, linears: DecodeProjections
                      ) -> Tensor:
        """`forward` of a decode step through the fused projections and the decode attention kernel."""
        attention, mlp = self.self_attn, self.mlp
        first_norm, second_norm = self.input_layernorm, self.post_attention_layernorm
        rows = x.shape[0]
        residual = x.view(rows, -1)
        qkv = linears.norm_linear(residual, first_norm.weight, first_norm.eps, attention.qkv_proj.weight,
                                  attention.qkv_proj.bias)
        out = attention.decode_attention(qkv.view(rows, -1, attention.head_dim),
                                         cast(DecodeAttentionFn, inputs.decode_kernel), inputs, layer_cache)
        linears.add_linear_(residual, out.view(rows, -1), attention.o_proj.weight)
        hidden = linears.norm_linear(residual, second_norm.weight, second_norm.eps, mlp.gate_up_proj.weight,
                                     None, gated=True)
        linears.add_linear_(residual, hidden, mlp.down_proj.weight)
        return x


class Qwen2Model(nn.Module):
    """Embedding table, decoder layers and final norm; runs on input embeddings, not token ids."""

    def __init__(self, cfg: Qwen2Config) -> None:
        super().__init__()
        self.cfg = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(Qwen2DecoderLayer(cfg) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.ops = EAGER_KERNELS

    def forward(self, x: Tensor, batch: CacheBatch, cache: KVCache, layers: int | None = None) -> Tensor:
        """Final hidden states [B, T, hidden] of input embeddings `x` [B, T, hidden].

        Writes the keys and values of every query position into `cache` at `batch.positions`.
        layers: run only the first `layers` decoder layers (None: all). Every layer launches the same
        kernels on the same shapes, so one layer is a CUDA graph's warm-up run; the output is then not
        the model's.
        """
        positions, cfg = batch.positions, self.cfg
        inputs = _LayerInputs(
            ops=self.ops,
            rope=rope_tables(positions, cfg.head_dim, cfg.rope_theta, x.dtype),
            mask=None,
            batch=batch,
            row_index=batch.row_index(),
        )
        if inputs.decode_kernel is None and not batch.from_start:
            mask = attention_mask(positions, batch.kv_len, cfg.num_heads // cfg.num_kv_heads, x.dtype)
            inputs = dataclasses.replace(inputs, mask=mask)
        x = x.clone(memory_format=torch.contiguous_format)  # the residual stream, updated in place
        for layer, layer_cache in itertools.islice(zip(self.layers, cache.kv, strict=True), layers):
            x = layer(x, inputs, layer_cache)
        return self.norm(x, self.ops.rms_norm)


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
