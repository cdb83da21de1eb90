"""The DiT's batched streaming attention alone: the prompt laid out per row (one kernel) against the prompt
read in place (two kernels merged by log-sum-exp, engines/token2wav/attention.py), per call, eager kernels
replayed from a CUDA graph (as the solver runs them).

    python benchmarks/dit_attention.py --streams 2 16 64 --frames 30 --prompt-frames 512
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from functools import partial
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from engines.config import DiTConfig  # noqa: E402
from engines.token2wav.dit import Attention, DiT, SplitKeys  # noqa: E402

CALLS = 20  # per graph replay


def time_us(fn: Callable[[], torch.Tensor], replays: int = 20) -> float:
    """Median µs per call of `fn` captured CALLS times in one CUDA graph."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(CALLS):
            fn()
    times = []
    for _ in range(replays):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1000 / CALLS)
    return sorted(times)[len(times) // 2]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--streams", type=int, nargs="+", default=[2, 16, 64])
    parser.add_argument("--frames", type=int, default=30)
    parser.add_argument("--prompt-frames", type=int, default=512)
    parser.add_argument("--own-frames", type=int, nargs="+", default=[0, 100])
    args = parser.parse_args()
    cfg, device, dtype = DiTConfig(), torch.device("cuda"), torch.float16
    dit = DiT(cfg).to(device, dtype).eval()
    attention: Attention = dit.blocks[0].attn  # type: ignore[assignment]
    heads, dim = cfg.num_heads, cfg.head_dim
    print(f"{'streams':>7} {'own':>4} {'one call µs':>12} {'split µs':>9} {'max |diff|':>10}")
    for streams in args.streams:
        for own_frames in args.own_frames:
            rows, t, kp = 2 * streams, args.frames, args.prompt_frames
            q = torch.randn(rows, t, heads, dim, device=device, dtype=dtype)
            new_kv = torch.randn(rows, heads, t, 2 * dim, device=device, dtype=dtype)
            prompt = torch.randn(2, heads, kp, 2 * dim, device=device, dtype=dtype)
            own = torch.randn(rows, heads, own_frames, 2 * dim, device=device, dtype=dtype)
            mask = torch.ones(rows, kp + own_frames + t, dtype=torch.bool, device=device)
            lengths = torch.full((rows,), t, dtype=torch.int64, device=device)
            keys = SplitKeys(prompt, own, dit.ragged_layout(lengths, mask, kp, t))
            one_call = partial(attention._one_call_attention, q, new_kv, keys)
            split_call = partial(attention._split_attention, q, new_kv, keys)
            with torch.inference_mode():
                one, split = time_us(one_call), time_us(split_call)
                diff = (one_call() - split_call()).abs().max().item()
            print(f"{streams:>7} {own_frames:>4} {one:>12.1f} {split:>9.1f} {diff:>10.2e}")


if __name__ == "__main__":
    main()
