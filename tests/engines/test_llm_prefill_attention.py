"""First prompt chunks attend among themselves (`CacheBatch.from_start`: causal attention over the
chunk's own keys, the flash kernel on CUDA) exactly as through the cache with the position mask: on a
tiny model with large random weights (CPU, fp32) and, on CUDA, with the full model's heads in bf16."""

from __future__ import annotations

import pytest
import torch

from engines.config import ModelConfigs
from engines.llm.model import CosyVoice2LM
from engines.llm.qwen2 import CacheBatch, KVCache, attention_mask, causal_attention, grouped_attention

TINY = ModelConfigs.tiny().llm
on_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return ((actual.float() - expected.float()).norm() / expected.float().norm()).item()


def tiny_model(device: torch.device, dtype: torch.dtype) -> CosyVoice2LM:
    torch.manual_seed(0)
    model = CosyVoice2LM(TINY).eval().requires_grad_(False)
    with torch.no_grad():  # every weight and bias non-zero, attention far from uniform
        for param in model.backbone.parameters():
            param.normal_(0.0, 0.15)
    return model.to(device, dtype)


LENGTHS = (16, 9, 3)  # real positions of three first chunks padded to 16


def first_chunks(device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """Inputs [3, 16, hidden] with `LENGTHS` real positions; the padding is large, unlike any embedding."""
    x = torch.randn(3, 16, TINY.qwen.hidden_size, device=device, dtype=dtype)
    for row, length in enumerate(LENGTHS):
        x[row, length:] *= 50
    return x


def both_paths(device: torch.device, dtype: torch.dtype, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Hidden states and caches of first chunks `x` on gathered slots (a stale cache) through the cache
    with the mask, and among themselves."""
    model = tiny_model(device, dtype)
    slots = torch.tensor([3, 0, 2], device=device)
    positions = torch.arange(16, device=device).expand(3, -1)
    outputs = []
    shape = KVCache.allocate(TINY.qwen, 4, 48, device, dtype).kv.shape
    for from_start in (False, True):
        stale = torch.randn(shape, generator=torch.Generator().manual_seed(1))
        cache = KVCache(stale.to(device, dtype))
        with torch.no_grad():
            hidden = model.backbone(x, CacheBatch(slots, positions, 32, from_start), cache)
        outputs += [hidden, cache.kv]
    return tuple(outputs)


def test_first_chunks_among_themselves_equal_the_masked_path() -> None:
    cpu = torch.device("cpu")
    x = first_chunks(cpu, torch.float32)
    masked, masked_cache, own, own_cache = both_paths(cpu, torch.float32, x)
    # Every position, padding included: both paths read positions 0..t only.
    torch.testing.assert_close(own, masked, atol=1e-5, rtol=1e-4)
    # The same keys and values are stored: later chunks and decode steps read them.
    torch.testing.assert_close(own_cache, masked_cache, atol=1e-5, rtol=1e-4)
    # Other padding leaves the real positions as they were.
    repadded = x.clone()
    for row, length in enumerate(LENGTHS):
        repadded[row, length:] = -repadded[row, length:]
    again = both_paths(cpu, torch.float32, repadded)[2]
    for row, length in enumerate(LENGTHS):
        torch.testing.assert_close(again[row, :length], own[row, :length], atol=1e-5, rtol=1e-4)


@pytest.mark.gpu
@on_cuda
@pytest.mark.parametrize("rows", [1, 4, 32])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_flash_kernel_equals_the_masked_kernel_on_cuda(rows: int, dtype: torch.dtype) -> None:
    cuda = torch.device("cuda")
    torch.manual_seed(rows)
    q_heads, kv_heads, length, kv_len = 14, 2, 192, 512  # the full model's heads, a bench prompt
    q = torch.randn(rows, q_heads, length, 64, device=cuda, dtype=dtype)
    k, v = (torch.randn(rows, kv_heads, length, 64, device=cuda, dtype=dtype) for _ in range(2))
    own = causal_attention(q, k, v)
    # The masked path reads a cache of kv_len positions: the chunk's keys first, stale values after.
    stale = torch.randn(rows, kv_heads, kv_len - length, 64, device=cuda, dtype=dtype)
    keys, values = torch.cat((k, stale), dim=2), torch.cat((v, stale), dim=2)
    positions = torch.arange(length, device=cuda).expand(rows, -1)
    masked = grouped_attention(q, keys, values, attention_mask(positions, kv_len, q_heads // kv_heads, dtype))
    assert relative_error(own, masked) < 1e-2


@pytest.mark.gpu
@on_cuda
def test_tiny_model_first_chunks_on_cuda_equal_the_masked_path() -> None:
    cuda, bf16 = torch.device("cuda"), torch.bfloat16
    masked, masked_cache, own, own_cache = both_paths(cuda, bf16, first_chunks(cuda, bf16))
    for row, length in enumerate(LENGTHS):
        assert relative_error(own[row, :length], masked[row, :length]) < 2e-2
    assert relative_error(own_cache, masked_cache) < 2e-2
