"""HiFT's decoder on CUDA as the service runs it (time-major activations: `hift.TimeMajorConv1d` calls
cuDNN's channels-last 2-D kernels on (B, C, 1, T) views) against PyTorch's conv1d on (B, C, T)
contiguous activations (cuDNN's Hopper float32 kernels then convert every input to NHWC and every output
back), timed alone (replays of a CUDA graph), same weights and inputs.

    bash benchmarks/on_device.sh python3 benchmarks/hift_layout.py --models /tmp/m \
        --rows 16 64 --frames 30 58 108 208

The twelfth session timed "time-major" through conv1d itself and found it slower: conv1d makes every
3-D input contiguous first, so each convolution paid a copy on top of cuDNN's conversions. Prints a
table; timings go to no test.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from functools import partial
from pathlib import Path

import torch
from torch import Tensor, nn

from benchmarks.dit_attention import time_us
from engines.compilation import use_tf32_matmuls
from engines.config import ModelPaths, configs_for_models_dir
from engines.token2wav.hift import TimeMajorConv1d, TimeMajorConvTranspose1d, load_hift


@contextmanager
def channel_major_convolutions() -> Iterator[None]:
    """HiFT's convolutions through PyTorch's conv1d / conv_transpose1d while inside."""
    forwards = TimeMajorConv1d.forward, TimeMajorConvTranspose1d.forward
    TimeMajorConv1d.forward = nn.Conv1d.forward  # type: ignore[method-assign,assignment]
    TimeMajorConvTranspose1d.forward = nn.ConvTranspose1d.forward  # type: ignore[method-assign,assignment]
    try:
        yield
    finally:
        TimeMajorConv1d.forward, TimeMajorConvTranspose1d.forward = forwards  # type: ignore[method-assign]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", type=Path, required=True)
    parser.add_argument("--rows", type=int, nargs="+", default=[16, 64])
    parser.add_argument("--frames", type=int, nargs="+", default=[30, 58, 108, 208])
    args = parser.parse_args()
    use_tf32_matmuls()
    paths = ModelPaths(args.models)
    cfg = configs_for_models_dir(paths.root).hift
    hift = load_hift(paths.hift, cfg, "cuda")
    print(f"{'rows':>5} {'frames':>6} {'conv1d (B, C, T) µs':>20} {'time-major µs':>14} {'max |diff|':>10}")
    for rows in args.rows:
        for frames in args.frames:
            mel = torch.randn(rows, cfg.in_channels, frames, device="cuda")
            source = torch.randn(rows, 1, frames * cfg.hop_samples, device="cuda") * 0.1
            decode: Callable[[], Tensor] = partial(hift.decode, mel, source)
            with torch.inference_mode():
                with channel_major_convolutions():
                    plain_us, plain = time_us(decode), decode()
                ours_us, ours = time_us(decode), decode()
            diff = (ours - plain).abs().max().item()
            print(f"{rows:>5} {frames:>6} {plain_us:>20.1f} {ours_us:>14.1f} {diff:>10.2e}")


if __name__ == "__main__":
    main()
