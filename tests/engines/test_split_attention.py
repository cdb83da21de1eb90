"""The DiT's batched attention with the shared prompt read in place (two key sets merged by their
log-sum-exps, engines/token2wav/attention.py) equals the one-call attention over each row's laid-out keys,
on a CPU (matmuls) and on CUDA (cuDNN's or the memory-efficient kernel), with per-row prompt masks, padded
rows that see no prompt key, and own caches empty or not; and each CUDA kernel's output and log-sum-exp
equal the definition in float64."""

from __future__ import annotations

import pytest
import torch
from weights import randomize

from engines.config import ModelConfigs
from engines.token2wav.attention import aligned_bias, attention_with_lse
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


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_attention_with_lse_on_cuda_equals_the_definition(dtype: torch.dtype) -> None:
    """At a DiT shape (8 heads of 64; queries of all rows against a shared prompt, rows laid out as in
    the solver): the output and the log-sum-exp against float64 matmuls, with a query that sees no key
    (its output is not read; its log-sum-exp must sit near the masked bias, far below the others)."""
    generator = torch.Generator().manual_seed(1)
    n, heads, queries, keys, dim = 2, 8, 200, 136, 64
    q = torch.randn(n, queries, heads, dim, generator=generator).transpose(1, 2)
    k, v = (torch.randn(n, heads, keys, dim, generator=generator) for _ in range(2))
    mask = torch.rand(n, 1, queries, keys, generator=generator) > 0.3
    mask[0, 0, 7] = False
    q, k, v = (t.to(dtype) for t in (q, k, v))  # the reference sees the inputs the kernel sees
    bias = aligned_bias(mask, dtype)
    cuda = torch.device("cuda")
    out, lse = attention_with_lse(q.to(cuda), k.to(cuda), v.to(cuda), bias.to(cuda))
    assert out.transpose(1, 2).is_contiguous() and lse.dtype == torch.float32
    assert lse.shape == (n, queries, heads)
    scores = q.double() @ k.double().transpose(-2, -1) / dim**0.5 + bias.double()
    want_out = torch.softmax(scores, dim=-1) @ v.double()
    want_lse = torch.logsumexp(scores, dim=-1).transpose(1, 2)
    seen = mask.any(dim=-1).squeeze(1)[:, :, None].expand(-1, -1, heads)  # (n, queries, heads)
    tolerance = {torch.float16: 2e-3, torch.bfloat16: 2e-2, torch.float32: 1e-4}[dtype]
    got_out = out.double().cpu().transpose(1, 2)[seen]
    torch.testing.assert_close(got_out, want_out.transpose(1, 2)[seen], atol=tolerance, rtol=tolerance)
    torch.testing.assert_close(lse.double().cpu()[seen], want_lse[seen], atol=tolerance, rtol=tolerance)
    assert lse[0, 7].max().item() < lse[seen.to(cuda)].min().item() - 1000
