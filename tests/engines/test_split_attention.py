"""The DiT's batched attention with the shared prompt read in place (two key sets merged by their
log-sum-exps, engines/token2wav/attention.py) equals the one-call attention over each row's laid-out keys,
on a CPU (matmuls) and on CUDA (the memory-efficient kernel), with per-row prompt masks, padded rows that
see no prompt key, and own caches empty or not."""

from __future__ import annotations

import pytest
import torch
from weights import randomize

from engines.config import ModelConfigs
from engines.token2wav.attention import attention_with_lse
from engines.token2wav.dit import DiT, SplitKeys

TINY = ModelConfigs.tiny().dit_flow.dit


def split_and_one_call(
    device: torch.device, dtype: torch.dtype, streams: int, own_frames: int
) -> tuple[torch.Tensor, torch.Tensor]:
    dit = DiT(TINY).eval()
    randomize(dit, seed=0)
    dit.to(device, dtype)
    attention = dit.blocks[0].attn
    generator = torch.Generator().manual_seed(streams + own_frames)
    rows, frames, prompt_frames, heads, dim = 2 * streams, 6, 24, TINY.num_heads, TINY.head_dim

    def draw(*size: int) -> torch.Tensor:
        return torch.randn(size, generator=generator).to(device, dtype)

    q, new_kv = draw(rows, frames, heads, dim), draw(rows, heads, frames, 2 * dim)
    prompt, own = draw(2, heads, prompt_frames, 2 * dim), draw(rows, heads, own_frames, 2 * dim)
    # Two voices' prompts side by side, some rows seeing a part of theirs, the last stream none (padding).
    mask = torch.zeros(rows, prompt_frames + own_frames + frames, dtype=torch.bool)
    for row in range(rows):
        stream = row % streams
        if stream < streams - 1:
            start = 0 if stream % 2 else 16
            stop = 16 if stream % 2 else prompt_frames
            mask[row, start + stream % 3 : stop] = True
        mask[row, prompt_frames + own_frames // (1 + stream % 2) :] = True
        mask[row, prompt_frames + own_frames + 1 + stream % frames :] = False  # right-padded chunk
    lengths = torch.full((rows,), frames, dtype=torch.int64)
    layout = dit.ragged_layout(lengths.to(device), mask.to(device), prompt_frames, frames)
    keys = SplitKeys(prompt, own, layout)
    with torch.inference_mode():
        return attention._split_attention(q, new_kv, keys), attention._one_call_attention(q, new_kv, keys)


@pytest.mark.parametrize("own_frames", [0, 10])
def test_split_attention_equals_one_call_on_cpu(own_frames: int) -> None:
    split, one_call = split_and_one_call(torch.device("cpu"), torch.float32, 6, own_frames)
    torch.testing.assert_close(split, one_call, atol=1e-5, rtol=1e-5)


def test_attention_with_lse_returns_the_log_sum_exp() -> None:
    generator = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 3, 5, 8, generator=generator) for _ in range(3))
    bias = torch.zeros(2, 1, 5, 5)
    bias[..., 0] = -1e30
    out, lse = attention_with_lse(q, k, v, bias)
    scores = q @ k.transpose(-2, -1) / 8**0.5 + bias
    torch.testing.assert_close(lse, torch.logsumexp(scores, dim=-1).transpose(1, 2))
    torch.testing.assert_close(out, torch.softmax(scores, dim=-1) @ v)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
@pytest.mark.parametrize("own_frames", [0, 10])
def test_split_attention_equals_one_call_on_cuda(dtype: torch.dtype, own_frames: int) -> None:
    """The memory-efficient kernel's output and log-sum-exp, merged, against the fused one-call kernel:
    fp16 to its rounding (values ~1, so ~1e-3), fp32 closer."""
    split, one_call = split_and_one_call(torch.device("cuda"), dtype, 6, own_frames)
    tolerance = 2e-3 if dtype == torch.float16 else 1e-4
    torch.testing.assert_close(split, one_call, atol=tolerance, rtol=tolerance)
