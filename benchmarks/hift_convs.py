"""HiFT's residual blocks at a chunk's shapes: cuDNN's convolutions (as served, `ResBlock.fused`) against
the Triton convolution with the blocks' elementwise work in its epilogue (engines/token2wav/conv_kernel.py).

Per decoder stage (channels C, samples per row L = mel frames × the upsampling so far), on a full-size
HiFT with random weights (weight norm folded, as loaded):
1. convolutions alone: each stride-1 convolution of the stage's residual blocks (3 + the source block's,
   6 each) timed as one CUDA graph: cuDNN TF32 (the served path), cuDNN bf16 (what half precision would
   cost; not served: HiFT stays float32 as in the reference), Triton TF32 at each tile configuration;
2. the stage's 4 residual blocks as served against the Triton path (2 launches per dilation step), each a
   CUDA graph, and the largest difference between their outputs.

    bash benchmarks/on_device.sh python3 benchmarks/hift_convs.py --rows 1 16 64 --frames 30 58 \
        --json $OUT/hift-convs.json

Prints tables; timings go to no test.
"""

from __future__ import annotations

import argparse
import functools
import json
import math
from collections.abc import Callable
from pathlib import Path
from typing import cast

import torch
import torch.nn.functional as F

from engines.compilation import use_tf32_matmuls
from engines.config import HiFTConfig
from engines.token2wav.conv_kernel import ConvTiles, conv_time_major, tap_major_weight
from engines.token2wav.hift import HiFTGenerator, ResBlock, Snake, TimeMajorConv1d, fold_weight_norm
from engines.token2wav.snake import snake

TILES = (ConvTiles(128, 64, 32, 4, 3), ConvTiles(64, 64, 32, 4, 3), ConvTiles(128, 128, 32, 8, 3),
         ConvTiles(64, 128, 64, 4, 3), ConvTiles(128, 64, 64, 4, 2))


def graph_us(fn: Callable[[], object], replays: int = 20) -> float:
    """µs per call of `fn` replayed from a CUDA graph of 5 calls."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(5):
            fn()
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1000 / (replays * 5)


def time_major(rows: int, channels: int, length: int) -> torch.Tensor:
    return torch.randn(rows, length, channels, device="cuda").transpose(1, 2)


class TritonBlock:
    """`ResBlock.fused` with each dilation step as two `conv_time_major` launches."""

    def __init__(self, block: ResBlock, tiles: ConvTiles) -> None:
        self.tiles = tiles
        self.steps = []
        for conv1, conv2, act1, act2 in zip(block.convs1, block.convs2, block.activations1,
                                            block.activations2, strict=True):
            conv1, conv2 = cast(TimeMajorConv1d, conv1), cast(TimeMajorConv1d, conv2)
            self.steps.append((tap_major_weight(conv1.weight.detach()), conv1.bias, conv1.dilation[0],
                               cast(int, conv1.padding[0]), tap_major_weight(conv2.weight.detach()),
                               conv2.bias, cast(int, conv2.padding[0]), cast(Snake, act1).alpha,
                               cast(Snake, act2).alpha))

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        activated = snake(x, self.steps[0][7])
        for index, (w1, b1, dilation, pad1, w2, b2, pad2, _, alpha2) in enumerate(self.steps):
            _, hidden = conv_time_major(activated, w1, b1, dilation, pad1, alpha=alpha2, write_sum=False,
                                        tiles=self.tiles)
            following = self.steps[index + 1][7] if index + 1 < len(self.steps) else None
            total, after = conv_time_major(cast(torch.Tensor, hidden), w2, b2, 1, pad2, residual=x,
                                           alpha=following, tiles=self.tiles)
            x = cast(torch.Tensor, total)
            if after is not None:
                activated = after
        return x


def stage_blocks(hift: HiFTGenerator, stage: int) -> list[ResBlock]:
    k = hift.num_kernels
    blocks = [cast(ResBlock, b) for b in hift.resblocks[stage * k:(stage + 1) * k]]
    return [*blocks, cast(ResBlock, hift.source_resblocks[stage])]


def measure_stage(hift: HiFTGenerator, stage: int, rows: int, frames: int) -> dict[str, object]:
    """One stage's convolutions and residual blocks at `rows` × `frames` mel frames (see the docstring)."""
    cfg = hift.cfg
    channels = cfg.base_channels // 2 ** (stage + 1)
    length = frames * math.prod(cfg.upsample_rates[:stage + 1]) + (stage == len(cfg.upsample_rates) - 1)
    blocks = stage_blocks(hift, stage)
    convs = [cast(TimeMajorConv1d, conv) for b in blocks for conv in (*b.convs1, *b.convs2)]
    x = time_major(rows, channels, length)
    x16 = x.to(torch.bfloat16)
    w16 = [conv.weight.to(torch.bfloat16) for conv in convs]
    geometry = [(conv.dilation[0], cast(int, conv.padding[0])) for conv in convs]
    weights = [tap_major_weight(conv.weight.detach()) for conv in convs]

    def cudnn_tf32() -> None:
        for conv in convs:
            conv.time_major(x, with_bias=False)

    def cudnn_bf16() -> None:
        for w, (dilation, padding) in zip(w16, geometry, strict=True):
            F.conv2d(x16.unsqueeze(2), w.unsqueeze(2), None, 1, (0, padding), (1, dilation))

    def triton_convs(tiles: ConvTiles) -> None:
        for w, (dilation, padding) in zip(weights, geometry, strict=True):
            conv_time_major(x, w, None, dilation, padding, tiles=tiles)

    triton_us = {str(tiles): graph_us(functools.partial(triton_convs, tiles)) for tiles in TILES
                 if not (channels % tiles.outputs or channels % tiles.inputs)}
    best_name = min(triton_us, key=lambda name: triton_us[name])
    best = next(t for t in TILES if str(t) == best_name)
    triton_blocks = [TritonBlock(b, best) for b in blocks]
    return {"rows": rows, "frames": frames, "stage": stage, "channels": channels, "length": length,
            "cudnn_tf32_us": graph_us(cudnn_tf32), "cudnn_bf16_us": graph_us(cudnn_bf16),
            "triton_us": triton_us, "triton_best": best_name,
            "blocks_served_us": graph_us(lambda: [b.fused(x) for b in blocks]),
            "blocks_triton_us": graph_us(lambda: [b(x) for b in triton_blocks]),
            "max_diff": max((b.fused(x) - tb(x)).abs().max().item()
                            for b, tb in zip(blocks, triton_blocks, strict=True))}


def random_hift(cfg: HiFTConfig) -> HiFTGenerator:
    """A full-size HiFT on the GPU with weights where nothing is zero, weight norm folded (as loaded)."""
    torch.manual_seed(0)
    hift = HiFTGenerator(cfg)
    with torch.no_grad():
        for name, p in hift.named_parameters():
            if name.endswith("alpha"):
                p.copy_(torch.rand(p.shape) * 1.5 + 0.1)
            elif p.dim() >= 2:
                p.copy_(torch.randn(p.shape) / p[0].numel() ** 0.5)
            else:
                p.copy_(0.1 * torch.randn(p.shape))
    fold_weight_norm(hift)
    return hift.cuda().eval()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 16, 64])
    parser.add_argument("--frames", type=int, nargs="+", default=[30, 58],
                        help="mel frames per row (a first chunk of 15 tokens: 30; a later 25: 50 + 8 cached)")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    use_tf32_matmuls()
    hift = random_hift(HiFTConfig())
    report: list[dict[str, object]] = []
    print(f"{'rows':>4} {'frames':>6} {'stage':>5} {'C':>4} {'L':>6}  convs: cuDNN tf32  cuDNN bf16  "
          f"Triton best (tiles)        blocks: served  Triton  max diff")
    with torch.inference_mode():
        for rows in args.rows:
            for frames in args.frames:
                for stage in range(len(hift.cfg.upsample_rates)):
                    row = measure_stage(hift, stage, rows, frames)
                    report.append(row)
                    best = cast(str, row["triton_best"])
                    print(f"{rows:>4} {frames:>6} {stage:>5} {row['channels']:>4} {row['length']:>6}  "
                          f"{row['cudnn_tf32_us']:>16.1f} {row['cudnn_bf16_us']:>11.1f} "
                          f"{cast(dict[str, float], row['triton_us'])[best]:>12.1f} ({best})"
                          f" {row['blocks_served_us']:>14.1f} {row['blocks_triton_us']:>7.1f} "
                          f"{row['max_diff']:>9.2e}", flush=True)
    print("µs per stage: the convolutions of its 4 residual blocks (24), then the 4 blocks whole")
    if args.json:
        args.json.write_text(json.dumps({"device": torch.cuda.get_device_name(), "rows": report}, indent=1))


if __name__ == "__main__":
    main()
