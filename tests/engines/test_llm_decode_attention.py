"""The decode attention kernel (Triton, CUDA only) against the model's general path: rope, cache write
and masked SDPA, on random inputs, with and without splitting the positions; and a tiny model's decode
logits with and without it."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from engines.config import ModelConfigs
from engines.llm.model import CosyVoice2LM
from engines.llm.qwen2 import (
    EAGER_KERNELS,
    CacheBatch,
    KVCache,
    attention_mask,
    grouped_attention,
    rope_tables,
)

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]
CUDA = torch.device("cuda")


def relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return ((actual.float() - expected.float()).norm() / expected.float().norm()).item()


def general_path(qkv: torch.Tensor, cache: torch.Tensor, first_slot: int, positions: torch.Tensor,
                 kv_len: int, q_heads: int, theta: float) -> torch.Tensor:
    """Attention output [B, Hq, D] of decode rows as Qwen2Attention computes it without the kernel."""
    kv_heads, head_dim = cache.shape[1] // 2, cache.shape[3]
    qkv = qkv.clone().unsqueeze(1)
    cos, sin = rope_tables(positions[:, None], head_dim, theta, qkv.dtype)
    EAGER_KERNELS.rope_(qkv[:, :, : q_heads + kv_heads], cos, sin)
    batch = CacheBatch(first_slot, positions[:, None], kv_len)
    keys, values = batch.update(cache, qkv[:, :, q_heads:], batch.row_index()).split(kv_heads, dim=1)
    mask = attention_mask(positions[:, None], kv_len, q_heads // kv_heads, qkv.dtype)
    return grouped_attention(qkv[:, :, :q_heads].transpose(1, 2), keys, values, mask).transpose(1, 2)[:, 0]


@pytest.mark.parametrize(("rows", "q_heads", "kv_heads", "head_dim", "kv_len", "split_len"), [
    (1, 14, 2, 64, 512, None),  # the full model's heads; split over the positions
    (3, 14, 2, 64, 256, 256),  # one split
    (5, 14, 2, 64, 1024, 128),
    (4, 4, 2, 16, 48, None),  # the tiny model's heads, a bucket below one block
    (64, 14, 2, 64, 512, None),
])
def test_kernel_equals_the_general_path(rows: int, q_heads: int, kv_heads: int, head_dim: int, kv_len: int,
                                        split_len: int | None) -> None:
    from engines.llm.decode_attention import decode_attention

    generator = torch.Generator(device=CUDA).manual_seed(rows * 1000 + kv_len)
    slots, first_slot, max_len, theta = rows + 2, 1, kv_len + 64, 1e6

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(shape, generator=generator, device=CUDA).to(torch.bfloat16)

    cache = randn(slots, 2 * kv_heads, max_len, head_dim)
    qkv = randn(rows, q_heads + 2 * kv_heads, head_dim)
    positions = torch.randint(0, kv_len, (rows,), generator=generator, device=CUDA)
    positions[0] = kv_len - 1  # the bucket's last position
    expected_cache = cache.clone()
    expected = general_path(qkv, expected_cache, first_slot, positions, kv_len, q_heads, theta)
    cos, sin = rope_tables(positions[:, None], head_dim, theta, torch.bfloat16)
    counters = torch.zeros(rows * kv_heads, dtype=torch.int32, device=CUDA)
    out = decode_attention(qkv, (cos[:, 0, 0], sin[:, 0, 0]), cache, first_slot, positions, kv_len, counters,
                           split_len)
    assert out.isfinite().all()
    assert relative_error(out, expected) < 1e-2
    # The counters are zero again, and a second call (which stores the same keys again) repeats the output.
    assert not counters.any()
    again = decode_attention(qkv, (cos[:, 0, 0], sin[:, 0, 0]), cache, first_slot, positions, kv_len,
                             counters, split_len)
    assert torch.equal(again, out)
    # The new keys and values are stored (rope rounded once instead of twice); nothing else moves.
    written = torch.zeros(slots, max_len, dtype=torch.bool, device=CUDA)
    written[first_slot + torch.arange(rows, device=CUDA), positions] = True
    assert relative_error(cache.transpose(1, 2)[written], expected_cache.transpose(1, 2)[written]) < 1e-2
    assert torch.equal(cache.transpose(1, 2)[~written], expected_cache.transpose(1, 2)[~written])


def test_tiny_model_decode_logits_equal_the_general_path() -> None:
    from engines.llm.decode_attention import DecodeAttention

    torch.manual_seed(0)
    cfg = ModelConfigs.tiny().llm
    general = CosyVoice2LM(cfg).eval().requires_grad_(False)
    with torch.no_grad():
        for param in general.backbone.layers.parameters():
            param.normal_(0.0, 0.15)
    general = general.to(CUDA, torch.bfloat16)
    kernel = CosyVoice2LM(cfg).to(CUDA, torch.bfloat16).eval().requires_grad_(False)
    kernel.load_state_dict(general.state_dict())
    attention = DecodeAttention(3, cfg.qwen.num_kv_heads, CUDA)
    kernel.backbone.ops = dataclasses.replace(EAGER_KERNELS, decode_attention=attention)
    prompt = torch.randn(3, 20, cfg.qwen.hidden_size, device=CUDA, dtype=torch.bfloat16)
    logits = []
    with torch.no_grad():
        for model in (general, kernel):
            cache = KVCache.allocate(cfg.qwen, 3, 64, CUDA, torch.bfloat16)
            model(prompt, CacheBatch(0, torch.arange(20, device=CUDA).expand(3, -1), 32), cache)
            steps = [model(prompt[:, i : i + 1], CacheBatch(0, torch.full((3, 1), 20 + i, device=CUDA), 32),
                           cache) for i in range(6)]
            logits.append(torch.stack(steps))
    assert relative_error(logits[1], logits[0]) < 2e-2
