"""Kernel choices inside one DiT block of a batched streaming solve, timed alone on CUDA (replays of a CUDA
graph, as the solver runs them), each against the definition:

- the conv branch's windows: (channel, tap) order, as the checkpoint's Conv1d weight flattens, against
  (tap, channel) order with the weight permuted once (contiguous reads of each window's frames);
- attention with log-sum-exp (attention.py's two parts, prompt and own): the memory-efficient kernel
  against cuDNN's fused attention, both with the additive bias.

    python benchmarks/dit_kernels.py --streams 16 64 --frames 56 206 --own-frames 200
"""

from __future__ import annotations

import argparse
import math
import sys
from collections.abc import Callable
from functools import partial
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.dit_attention import time_us  # noqa: E402
from engines.token2wav.attention import aligned_bias  # noqa: E402


def windows_channel_tap(h: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    b, frames, channels = h.shape
    windows = h.unfold(1, 3, 1).reshape(b, frames - 2, channels * 3)
    return F.linear(windows, weight.view(weight.shape[0], -1), bias)


def windows_tap_channel(h: torch.Tensor, tap_weight: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    frames = h.shape[1] - 2
    windows = torch.cat([h[:, tap : tap + frames] for tap in range(3)], dim=2)
    return F.linear(windows, tap_weight, bias)


def efficient(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: torch.Tensor,
              ) -> tuple[torch.Tensor, torch.Tensor]:
    full = bias.expand(q.shape[0], q.shape[1], q.shape[2], k.shape[2])
    out, lse = torch.ops.aten._scaled_dot_product_efficient_attention(q, k, v, full, True)[:2]
    return out, lse[..., : q.shape[2]]


def cudnn(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: torch.Tensor,
          ) -> tuple[torch.Tensor, torch.Tensor]:
    full = bias.expand(q.shape[0], q.shape[1], q.shape[2], k.shape[2])
    out, lse = torch.ops.aten._scaled_dot_product_cudnn_attention(q, k, v, full, True, 0.0, False, False)[:2]
    return out, lse.reshape(q.shape[:3])


def reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: torch.Tensor,
              ) -> tuple[torch.Tensor, torch.Tensor]:
    scores = q.float() @ k.float().transpose(-2, -1) / math.sqrt(q.shape[3]) + bias.float()
    return torch.softmax(scores, -1) @ v.float(), torch.logsumexp(scores, -1)


AttentionFn = Callable[..., tuple[torch.Tensor, torch.Tensor]]


def first(kernel: AttentionFn, inputs: tuple[torch.Tensor, ...]) -> torch.Tensor:
    return kernel(*inputs)[0]


def compare_attention(name: str, kernels: dict[str, AttentionFn], *inputs: torch.Tensor) -> None:
    """One line: each kernel's µs per call and largest difference from `reference` (output or lse)."""
    cells = []
    with torch.inference_mode():
        want_out, want_lse = reference(*inputs)
        for label, kernel in kernels.items():
            try:
                out, lse = kernel(*inputs)
                error = max((out.float() - want_out).abs().max().item(),
                            (lse.float() - want_lse).abs().max().item())
                micros = time_us(partial(first, kernel, inputs))
                cells.append(f"{label} {micros:8.1f} µs (err {error:.1e})")
            except RuntimeError as exc:  # a kernel that refuses the shape says so
                cells.append(f"{label} refused: {str(exc).splitlines()[0][:80]}")
    print(f"{name:<44} " + " | ".join(cells))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--streams", type=int, nargs="+", default=[16, 64])
    parser.add_argument("--frames", type=int, nargs="+", default=[56, 206])
    parser.add_argument("--own-frames", type=int, default=200)
    parser.add_argument("--prompt-frames", type=int, default=256)
    args = parser.parse_args()
    device, dtype, hidden, heads, dim = torch.device("cuda"), torch.float16, 512, 8, 64
    generator = torch.Generator(device=device).manual_seed(0)

    def randn(*size: int) -> torch.Tensor:
        return torch.randn(*size, device=device, dtype=dtype, generator=generator)

    weight, conv_bias = randn(hidden, hidden, 3) / math.sqrt(3 * hidden), randn(hidden)
    tap_weight = weight.permute(0, 2, 1).reshape(hidden, 3 * hidden).contiguous()
    channel_tap = torch.compile(windows_channel_tap, dynamic=False)
    tap_channel = torch.compile(windows_tap_channel, dynamic=False)
    kernels: dict[str, AttentionFn] = {"efficient": efficient, "cudnn": cudnn}
    for streams in args.streams:
        for frames in args.frames:
            rows = 2 * streams
            h = randn(rows, frames + 2, hidden)
            with torch.inference_mode():
                want = F.conv1d(h.transpose(1, 2).float(), weight.float(), conv_bias.float()).transpose(1, 2)
                cells = []
                for label, fn, w in (("(c,k)", channel_tap, weight), ("(k,c)", tap_channel, tap_weight)):
                    call = partial(fn, h, w, conv_bias)
                    error = (call().float() - want).abs().max().item()
                    cells.append(f"{label} {time_us(call):8.1f} µs (err {error:.1e})")
            print(f"{f'conv, {rows} rows × {frames} frames':<44} " + " | ".join(cells))

            # The prompt part: all rows' queries of a guidance half against its prompt keys.
            q = randn(2, heads, streams * frames, dim).transpose(1, 2).contiguous().transpose(1, 2)
            k, v = randn(2, heads, args.prompt_frames, dim), randn(2, heads, args.prompt_frames, dim)
            mask = torch.rand(2, 1, streams * frames, args.prompt_frames, device=device) > 0.1
            compare_attention(f"prompt part, {streams * frames} queries × {args.prompt_frames}", kernels,
                              q, k, v, aligned_bias(mask, dtype))

            # The own part: each row's queries against its own cache and chunk.
            keys = args.own_frames + frames
            q2 = randn(rows, frames, heads, dim).transpose(1, 2)
            k2, v2 = randn(rows, heads, keys, dim), randn(rows, heads, keys, dim)
            own_mask = torch.arange(keys, device=device) >= torch.randint(0, args.own_frames, (rows, 1),
                                                                         device=device)
            compare_attention(f"own part, {rows} rows × {frames} q × {keys} keys", kernels,
                              q2, k2, v2, aligned_bias(own_mask[:, None, None, :], dtype))


if __name__ == "__main__":
    main()
