"""What a new input shape costs HiFT's convolutions on the host the first time (cuDNN picks and builds an
execution plan per shape), against the same call once the plan is cached, per convolution layout and
cuDNN setting. The warm-up meets ~150 HiFT shapes (a graph each), so this cost recurs at every start.
With `--sdpa`, the same for the LLM's prefill attention (engines/llm/qwen2.grouped_attention) over the
44 prefill graph shapes, cuDNN's fused attention against the memory-efficient kernel, then each kernel's
device time per call once planned (what a prefill graph replays, 24 layers per prefill call).

    bash benchmarks/on_device.sh python3 benchmarks/cudnn_first_calls.py --models /tmp/m
    bash benchmarks/on_device.sh python3 benchmarks/cudnn_first_calls.py --sdpa

Each variant runs in a process of its own (cuDNN's plan cache lives in the process): the decoder on
56 shapes (rows x frames, all distinct), every shape called twice, synchronised; the table gives the
first calls' total, the second calls' total, and the device time of a few shapes from CUDA graphs (the
serving cost of the plans each setting picks). Prints a table; timings go to no test.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import torch

VARIANTS = {  # name: (environment, time-major convolutions)
    "time-major (service)": ({}, True),
    "conv1d (B, C, T)": ({}, False),
    "time-major, cuDNN v7 API": ({"TORCH_CUDNN_V8_API_DISABLED": "1"}, True),
    "conv1d, cuDNN v7 API": ({"TORCH_CUDNN_V8_API_DISABLED": "1"}, False),
}
DEFAULT_SHAPES = [(rows, frames) for rows in (64, 32, 16, 8, 4, 2, 1)
                  for frames in (30, 58, 108, 208, 16, 48, 96, 160)]
TIMED = [(64, 208), (16, 58), (1, 30)]


def one_variant(models: Path, time_major: bool, shapes: list[tuple[int, int]]) -> dict[str, object]:
    from benchmarks.dit_attention import time_us
    from benchmarks.hift_layout import channel_major_convolutions
    from engines.compilation import use_tf32_matmuls
    from engines.config import ModelPaths, configs_for_models_dir
    from engines.token2wav.hift import load_hift

    use_tf32_matmuls()
    paths = ModelPaths(models)
    cfg = configs_for_models_dir(paths.root).hift
    hift = load_hift(paths.hift, cfg, "cuda")

    def inputs(rows: int, frames: int) -> tuple[torch.Tensor, torch.Tensor]:
        return (torch.randn(rows, cfg.in_channels, frames, device="cuda"),
                torch.randn(rows, 1, frames * cfg.hop_samples, device="cuda") * 0.1)

    def timed_call(mel: torch.Tensor, source: torch.Tensor) -> float:
        torch.cuda.synchronize()
        started = time.perf_counter()
        hift.decode(mel, source)
        torch.cuda.synchronize()
        return time.perf_counter() - started

    layout = contextlib.nullcontext() if time_major else channel_major_convolutions()
    with torch.inference_mode(), layout:
        hift.decode(*inputs(1, 8))  # cuDNN's and cuBLAS's handles, not a shape of the list
        first = second = 0.0
        for rows, frames in shapes:
            mel, source = inputs(rows, frames)
            first += timed_call(mel, source)
            second += timed_call(mel, source)
        device_us = {f"{rows}x{frames}": time_us(functools.partial(hift.decode, *inputs(rows, frames)))
                     for rows, frames in TIMED}
    return {"first_s": first, "second_s": second, "device_us": device_us}


def sdpa_first_calls() -> None:
    """First and second calls of the prefill attention at every prefill graph shape, per SDPA backend."""
    from torch.nn.attention import SDPBackend

    from engines.llm.torch_runner import TorchLLMConfig

    config = TorchLLMConfig()
    kv_len = config.prefill_graph_kv_len
    q_heads, kv_heads, head_dim = 14, 2, 64  # Qwen2-0.5B
    print(f"{len(config.prefill_shapes)} prefill shapes (rows x length, {kv_len} keys), each called twice")
    print(f"{'SDPA backend':<26} {'first calls s':>13} {'again s':>8}")
    backends = (SDPBackend.CUDNN_ATTENTION, SDPBackend.EFFICIENT_ATTENTION)
    shapes = list(config.prefill_shapes)
    for backend in backends:  # libraries and handles first, at a shape not in the list
        run_shape(backend, 3, 24, kv_len, q_heads, kv_heads, head_dim)
    for backend in backends:
        first = second = 0.0
        for rows, length in shapes:
            first += run_shape(backend, rows, length, kv_len, q_heads, kv_heads, head_dim)
            second += run_shape(backend, rows, length, kv_len, q_heads, kv_heads, head_dim)
        print(f"{backend.name:<26} {first:>13.2f} {second:>8.2f}")
    largest = sorted(shapes, key=lambda shape: shape[0] * shape[1], reverse=True)[:4]
    print(f"device µs per call once planned (mean of {REPEATS}), largest shapes and the sum over all:")
    print(f"{'SDPA backend':<26} " + " ".join(f"{rows}x{length}".rjust(9) for rows, length in largest)
          + f" {'all 44':>9}")
    for backend in backends:
        times = {shape: device_us(backend, *shape, kv_len, q_heads, kv_heads, head_dim) for shape in shapes}
        print(f"{backend.name:<26} " + " ".join(f"{times[shape]:>9.1f}" for shape in largest)
              + f" {sum(times.values()):>9.1f}")


def prefill_inputs(rows: int, length: int, kv_len: int, q_heads: int, kv_heads: int,
                   head_dim: int) -> tuple[torch.Tensor, ...]:
    """q (query heads folded per KV head, as `grouped_attention` lays them out), k, v and the mask."""
    from engines.llm.qwen2 import attention_mask

    group = q_heads // kv_heads
    q = torch.randn(rows, kv_heads, group * length, head_dim, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(rows, kv_heads, kv_len, head_dim, device="cuda", dtype=torch.bfloat16)
            for _ in range(2))
    mask = attention_mask(torch.arange(length, device="cuda").expand(rows, -1), kv_len, group, torch.bfloat16)
    return q, k, v, mask


def run_shape(backend: object, rows: int, length: int, kv_len: int, q_heads: int, kv_heads: int,
              head_dim: int) -> float:
    """Seconds of one synchronised prefill attention call of that shape through `backend`."""
    from torch.nn.attention import sdpa_kernel

    q, k, v, mask = prefill_inputs(rows, length, kv_len, q_heads, kv_heads, head_dim)
    torch.cuda.synchronize()
    started = time.perf_counter()
    with sdpa_kernel(backend):  # type: ignore[arg-type]
        torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    torch.cuda.synchronize()
    return time.perf_counter() - started


REPEATS = 50


def device_us(backend: object, rows: int, length: int, kv_len: int, q_heads: int, kv_heads: int,
              head_dim: int) -> float:
    """Mean device µs of one call of that shape through `backend`, planned beforehand, from CUDA events
    around `REPEATS` calls in a row (for the smallest shapes the host's launches may be what is timed)."""
    from torch.nn.attention import sdpa_kernel

    q, k, v, mask = prefill_inputs(rows, length, kv_len, q_heads, kv_heads, head_dim)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    with sdpa_kernel(backend):  # type: ignore[arg-type]
        torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        start.record()
        for _ in range(REPEATS):
            torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        end.record()
    end.synchronize()
    return start.elapsed_time(end) * 1000 / REPEATS


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", type=Path, help="the models directory (HiFT's weights; not for --sdpa)")
    parser.add_argument("--json", type=Path)
    parser.add_argument("--sdpa", action="store_true", help="the LLM's prefill attention instead")
    parser.add_argument("--variant", help=argparse.SUPPRESS)  # the child process's part
    args = parser.parse_args()
    if args.sdpa:
        sdpa_first_calls()
        return
    if args.models is None:
        parser.error("--models is needed for HiFT's convolutions")
    if args.variant is not None:
        print(json.dumps(one_variant(args.models, VARIANTS[args.variant][1], DEFAULT_SHAPES)))
        return
    print(f"{len(DEFAULT_SHAPES)} shapes, each called twice; torch {torch.__version__}")
    timed = " ".join(f"{rows}x{frames} µs".rjust(12) for rows, frames in TIMED)
    print(f"{'variant':<26} {'first calls s':>13} {'again s':>8} {timed}")
    report = {}
    for name, (env, _) in VARIANTS.items():
        run = subprocess.run([sys.executable, __file__, "--models", str(args.models), "--variant", name],
                             env={**os.environ, **env}, capture_output=True, text=True, check=False)
        if run.returncode != 0:
            print(f"{name:<26} failed: {run.stderr.strip().splitlines()[-1:]}")
            continue
        result = json.loads(run.stdout.strip().splitlines()[-1])
        report[name] = result
        device = result["device_us"]
        print(f"{name:<26} {result['first_s']:>13.2f} {result['second_s']:>8.2f} "
              + " ".join(f"{device[f'{r}x{f}']:>12.1f}" for r, f in TIMED))
    if args.json:
        args.json.write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
