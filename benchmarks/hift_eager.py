"""HiFT run eagerly on shapes it has not met, as a stream's final chunk runs (its length has no CUDA
graph): host time to queue one call, and time until its audio is ready, the first time a (rows, frames)
shape comes and again. The first time pays for whatever the libraries build per shape (cuFFT plans,
cuDNN's execution plans); `--no-cudnn` runs the convolutions without cuDNN (PyTorch's own kernels) to
tell its share.

    bash benchmarks/on_device.sh python3 benchmarks/hift_eager.py --models /tmp/m [--no-cudnn]

Prints a table; timings go to no test.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from pathlib import Path

import torch

from engines.compilation import use_tf32_matmuls
from engines.config import ModelPaths, configs_for_models_dir
from engines.token2wav.hift import HiFTGenerator, load_hift


def timed_call(hift: HiFTGenerator, rows: int, frames: int, cached: int) -> tuple[float, float]:
    """(host ms to queue one eager call, ms until its output is on the device) for fresh inputs."""
    mel = torch.randn(rows, hift.cfg.in_channels, frames, device="cuda")
    source = torch.zeros(rows, 1, cached, device="cuda") if cached else None
    noise = torch.randn(rows, frames * hift.hop_samples - cached, hift.num_harmonics, device="cuda")
    torch.cuda.synchronize()
    started = time.perf_counter()
    with torch.inference_mode():
        hift.vocode_with_noise(mel, source, noise)
    queued = time.perf_counter()
    torch.cuda.synchronize()
    done = time.perf_counter()
    return (queued - started) * 1000, (done - started) * 1000


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", type=Path, required=True)
    parser.add_argument("--shapes", type=int, default=24, help="distinct (rows, frames) final-chunk shapes")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--no-cudnn", action="store_true", help="convolutions without cuDNN")
    args = parser.parse_args()
    use_tf32_matmuls()  # as `serve` runs
    torch.backends.cudnn.enabled = not args.no_cudnn
    paths = ModelPaths(args.models)
    hift = load_hift(paths.hift, configs_for_models_dir(paths.root).hift, "cuda")
    cached = hift.cfg.source_cache_samples
    frames_cached = hift.cfg.mel_cache_frames
    picks = random.Random(args.seed)
    # A final chunk: the cached frames plus 2 frames per remaining token (1 … 200), 1 … 64 streams.
    shapes = [(picks.randint(1, 64), frames_cached + 2 * picks.randint(1, 200)) for _ in range(args.shapes)]
    timed_call(hift, 2, frames_cached + 30, cached)  # the process's first call: lazy initialisation
    rows_out = []
    for label in ("first time", "again"):
        host, total = zip(*(timed_call(hift, rows, frames, cached) for rows, frames in shapes), strict=True)
        rows_out.append((label, statistics.mean(host), max(host), statistics.mean(total), max(total)))
    print(f"HiFT eagerly, {len(shapes)} final-chunk shapes (rows 1-64, 8 + 2·(1-200) frames), "
          f"{torch.cuda.get_device_name()}, torch {torch.__version__}, "
          f"cuDNN {'off' if args.no_cudnn else 'on'}")
    print(f"{'shape':>11} {'queue mean':>11} {'queue max':>10} {'ready mean':>11} {'ready max':>10}")
    for label, host_mean, host_max, total_mean, total_max in rows_out:
        print(f"{label:>11} {host_mean:>9.1f}ms {host_max:>8.1f}ms {total_mean:>9.1f}ms {total_max:>8.1f}ms")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
