"""HiFT's decoder in the two memory layouts cuDNN can run its convolutions in, timed alone on CUDA
(replays of a CUDA graph, as the service runs it): channel-major (B, C, L) contiguous, which cuDNN's
Hopper kernels convert to and from time-major around every convolution, against time-major storage of
the same (B, C, L) tensors and weights (no conversions). Both with PyTorch's four-kernel Snake, so that
only the layout differs; the Triton Snake kernel (channel-major) is timed too, as the service runs now.

    bash benchmarks/on_device.sh python3 benchmarks/hift_layout.py --models /tmp/m \
        --rows 16 64 --frames 58 108

Prints a table; timings go to no test.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from functools import partial
from pathlib import Path

import torch
from torch import Tensor, nn

from benchmarks.dit_attention import time_us
from engines.compilation import use_tf32_matmuls
from engines.config import ModelPaths, configs_for_models_dir
from engines.token2wav.hift import HiFTGenerator, Snake, load_hift


def time_major(t: Tensor) -> Tensor:
    """The same (B, C, L) values stored time-major (strides (L·C, 1, C))."""
    return t.transpose(1, 2).contiguous().transpose(1, 2)


def eager_snake(module: Snake, x: Tensor, ends: Tensor | None = None) -> Tensor:
    alpha = module.alpha[None, :, None]
    return torch.addcmul(x, torch.sin(alpha * x).square(), (alpha + 1e-9).reciprocal())


def with_time_major_weights(hift: HiFTGenerator) -> HiFTGenerator:
    for module in hift.modules():
        if isinstance(module, (nn.Conv1d, nn.ConvTranspose1d)):
            module.weight.data = time_major(module.weight.data)
    return hift


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", type=Path, required=True)
    parser.add_argument("--rows", type=int, nargs="+", default=[16, 64])
    parser.add_argument("--frames", type=int, nargs="+", default=[58, 108])
    args = parser.parse_args()
    use_tf32_matmuls()
    paths = ModelPaths(args.models)
    cfg = configs_for_models_dir(paths.root).hift
    channel_major = load_hift(paths.hift, cfg, "cuda")
    time_major_hift = with_time_major_weights(load_hift(paths.hift, cfg, "cuda"))
    triton_snake = Snake.forward
    print(f"{'rows':>5} {'frames':>6} {'Triton Snake µs':>16} {'channel-major µs':>17} {'time-major µs':>14} "
          f"{'max |diff|':>10}")
    for rows in args.rows:
        for frames in args.frames:
            mel = torch.randn(rows, cfg.in_channels, frames, device="cuda")
            source = torch.randn(rows, 1, frames * cfg.hop_samples, device="cuda") * 0.1
            calls: list[Callable[[], Tensor]] = [partial(channel_major.decode, mel, source)]
            with torch.inference_mode():
                Snake.forward = triton_snake  # type: ignore[method-assign]
                micros = [time_us(calls[0])]
                Snake.forward = eager_snake  # type: ignore[assignment]
                reference = channel_major.decode(mel, source)
                calls.append(partial(time_major_hift.decode, time_major(mel), time_major(source)))
                micros += [time_us(calls[0]), time_us(calls[1])]
                diff = (calls[1]() - reference).abs().max().item()
            Snake.forward = triton_snake  # type: ignore[method-assign]
            print(f"{rows:>5} {frames:>6} {micros[0]:>16.1f} {micros[1]:>17.1f} {micros[2]:>14.1f} "
                  f"{diff:>10.2e}")


if __name__ == "__main__":
    main()
