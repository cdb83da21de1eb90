"""HiFT on final-chunk shapes (a stream's last chunk carries whatever its segment left, any length):
host time to queue one call, and time until its audio is ready, the first time a (rows, frames) shape
comes and again.

- eager (the default): the exact shape, as final chunks ran before padded graphs. The first time pays
  for whatever the libraries build per shape (cuDNN's execution plans); `--no-cudnn` runs the
  convolutions without cuDNN (PyTorch's own kernels) to tell its share.
- `--padded-graphs`: as the service runs them now, rows right-padded to a bucket of lengths and run
  from the masked CUDA graphs (vocoder_graphs.GraphedVocoder), captured first as the warm-up does (the capture
  is timed: it is start-up time); shapes beyond the graphs' rows × frames run eagerly at the bucket.

    bash benchmarks/on_device.sh python3 benchmarks/hift_eager.py --models /tmp/m \
        [--no-cudnn] [--padded-graphs]

Prints a table; timings go to no test.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch

from engines.compilation import use_tf32_matmuls
from engines.config import ModelPaths, configs_for_models_dir
from engines.token2wav.hift import HiFTGenerator, load_hift
from engines.token2wav.torch_backend import GRAPH_HOPS, VOCODER_GRAPH_BATCHES, vocoder_graph_chunks
from engines.token2wav.vocoder_graphs import GraphedVocoder
from engines.transfer import upload

Call = Callable[[torch.Tensor, torch.Tensor | None, torch.Tensor], object]


def timed_call(hift: HiFTGenerator, call: Call, rows: int, frames: int, cached: int) -> tuple[float, float]:
    """(host ms to queue one call, ms until its output is on the device) for fresh inputs."""
    mel = torch.randn(rows, hift.cfg.in_channels, frames, device="cuda")
    source = torch.zeros(rows, 1, cached, device="cuda") if cached else None
    noise = torch.randn(rows, frames * hift.hop_samples - cached, hift.num_harmonics, device="cuda")
    torch.cuda.synchronize()
    started = time.perf_counter()
    with torch.inference_mode():
        call(mel, source, noise)
    queued = time.perf_counter()
    torch.cuda.synchronize()
    done = time.perf_counter()
    return (queued - started) * 1000, (done - started) * 1000


def padded_call(hift: HiFTGenerator, graphs: GraphedVocoder) -> Call:
    """The service's final-chunk path: pad to the bucket, pass each row's frames, graph or eager."""

    def call(mel: torch.Tensor, source: torch.Tensor | None, noise: torch.Tensor) -> object:
        rows, _, frames = mel.shape
        cached = 0 if source is None else source.shape[2]
        bucket = graphs.final_bucket(frames, cached)
        if bucket is None:
            return graphs.vocode(mel, source, noise)
        mel = torch.nn.functional.pad(mel, (0, bucket - frames))
        noise = torch.nn.functional.pad(noise, (0, 0, 0, (bucket - frames) * hift.hop_samples))
        return graphs.vocode(mel, source, noise, upload(torch.full((rows,), frames), mel.device))

    return call


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", type=Path, required=True)
    parser.add_argument("--shapes", type=int, default=24, help="distinct (rows, frames) final-chunk shapes")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--no-cudnn", action="store_true", help="convolutions without cuDNN")
    parser.add_argument("--padded-graphs", action="store_true", help="the masked graphs per length bucket")
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
    call: Call = hift.vocode_with_noise
    if args.padded_graphs:
        graphs = GraphedVocoder(hift, vocoder_graph_chunks(hift.cfg, GRAPH_HOPS), VOCODER_GRAPH_BATCHES)
        started = time.perf_counter()
        final_shapes = graphs.final_shapes(cached)
        graphs.capture(final_shapes)
        graphs.seal()
        seconds = time.perf_counter() - started
        print(f"captured {len(final_shapes)} padded final-chunk graphs in {seconds:.1f} s; "
              f"pool {torch.cuda.memory_reserved() / 2**30:.2f} GiB reserved")
        call = padded_call(hift, graphs)
    timed_call(hift, call, 2, frames_cached + 30, cached)  # the process's first call: lazy initialisation
    rows_out = []
    for label in ("first time", "again"):
        timings = [timed_call(hift, call, rows, frames, cached) for rows, frames in shapes]
        host, total = zip(*timings, strict=True)
        rows_out.append((label, statistics.mean(host), max(host), statistics.mean(total), max(total)))
    path = "padded graphs" if args.padded_graphs else "eagerly"
    print(f"HiFT {path}, {len(shapes)} final-chunk shapes (rows 1-64, 8 + 2·(1-200) frames), "
          f"{torch.cuda.get_device_name()}, torch {torch.__version__}, "
          f"cuDNN {'off' if args.no_cudnn else 'on'}")
    print(f"{'shape':>11} {'queue mean':>11} {'queue max':>10} {'ready mean':>11} {'ready max':>10}")
    for label, host_mean, host_max, total_mean, total_max in rows_out:
        print(f"{label:>11} {host_mean:>9.1f}ms {host_max:>8.1f}ms {total_mean:>9.1f}ms {total_max:>8.1f}ms")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
