"""What launching one large CUDA graph costs before its first kernel runs, against the same kernels
captured as several smaller graphs launched one after another.

One stream's first chunk replays token2wav's solve graph: ten Euler steps of the DiT, ~2500 kernels of a
few µs. If `cudaGraphLaunch` of such a graph keeps the host busy for a while before the device may
start, the device idles for that while on a lone stream, and a graph per Euler step (or two graphs) would
start the device sooner. This measures that on synthetic graphs of tiny elementwise kernels:

    bash benchmarks/on_device.sh python3 benchmarks/graph_launch.py [--kernels 256 1024 2500 5000]

Per graph size and split: the host time of the launch calls (`replay()` until it returns), the device
time from an event recorded just before the launches to one after them on an idle device ("idle
start"), and the same with the launches queued behind a busy device ("queued": the kernels' own time,
launch hidden). idle start − queued is what the launch costs the device. Prints a table; --json writes it.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import Any

import torch

DEVICE = torch.device("cuda")
REPEATS = 20


def capture(kernels: int, graphs: int, tensor: torch.Tensor) -> list[torch.cuda.CUDAGraph]:
    """`kernels` in-place multiplications of `tensor`, captured as `graphs` graphs of equal share."""
    captured = []
    stream = torch.cuda.Stream(DEVICE)
    stream.wait_stream(torch.cuda.current_stream(DEVICE))
    with torch.cuda.stream(stream):
        tensor.mul_(1.0)  # the kernel loaded before capture
        for _ in range(graphs):
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, stream=stream):
                for _ in range(kernels // graphs):
                    tensor.mul_(1.0000001)
            captured.append(graph)
    torch.cuda.current_stream(DEVICE).wait_stream(stream)
    torch.cuda.synchronize(DEVICE)
    return captured


def time_launches(graphs: list[torch.cuda.CUDAGraph], busy: torch.Tensor | None) -> tuple[float, float]:
    """(host ms of the launches, device ms from before them to after them); with `busy`, long matmuls
    (~40 ms in float32) are queued first, so the launches are done before the device reaches them."""
    torch.cuda.synchronize(DEVICE)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    if busy is not None:
        for _ in range(20):
            busy @ busy
    start.record()
    began = time.perf_counter()
    for graph in graphs:
        graph.replay()
    host_ms = (time.perf_counter() - began) * 1000
    end.record()
    torch.cuda.synchronize(DEVICE)
    return host_ms, start.elapsed_time(end)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--kernels", type=int, nargs="+", default=[256, 1024, 2500, 5000])
    parser.add_argument("--splits", type=int, nargs="+", default=[1, 2, 10])
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    tensor = torch.ones(4096, device=DEVICE)
    busy = torch.randn(4096, 4096, device=DEVICE)
    rows: list[dict[str, Any]] = []
    for kernels in args.kernels:
        for splits in args.splits:
            graphs = capture(kernels, splits, tensor)
            for _ in range(3):
                time_launches(graphs, None)
            idle = [time_launches(graphs, None) for _ in range(REPEATS)]
            queued = [time_launches(graphs, busy)[1] for _ in range(REPEATS)]
            row = {
                "kernels": kernels, "graphs": splits,
                "host_ms": statistics.median(host for host, _ in idle),
                "idle_start_ms": statistics.median(device for _, device in idle),
                "queued_ms": statistics.median(queued),
            }
            row["launch_cost_ms"] = row["idle_start_ms"] - row["queued_ms"]
            rows.append(row)
            del graphs
    print(f"\nCUDA graph launches, {torch.cuda.get_device_name(DEVICE)}, torch {torch.__version__}")
    print(f"{'kernels':>7} {'graphs':>6} {'host ms':>8} {'idle start ms':>14} {'queued ms':>10} "
          f"{'launch cost ms':>15}")
    for row in rows:
        print(f"{row['kernels']:>7} {row['graphs']:>6} {row['host_ms']:>8.3f} {row['idle_start_ms']:>14.3f} "
              f"{row['queued_ms']:>10.3f} {row['launch_cost_ms']:>15.3f}")
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
