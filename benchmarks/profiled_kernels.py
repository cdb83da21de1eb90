"""A torch.profiler run's GPU kernels as a table: device time and launches per call, largest first.
CUPTI sees the kernels of CUDA graph replays too (not the ops that launched them)."""

from __future__ import annotations

from typing import Any


def kernel_table(prof: Any, calls: int, title: str, top: int) -> str:
    """`title` with the kernels' total device time and launches per call, then the `top` kernels, from a
    `torch.profiler.profile` that recorded `calls` calls."""
    kernels = sorted(((event.device_time_total / calls, event.count / calls, event.key)
                      for event in prof.key_averages() if event.device_time_total > 0), reverse=True)
    total, launches = sum(us for us, _, _ in kernels), sum(n for _, n, _ in kernels)
    lines = [f"== {title}: {total / 1000:.2f} ms of kernels per call, {launches:.0f} launches"]
    lines += [f"{us:9.1f} us {count:6.0f}x  {key[:110]}" for us, count, key in kernels[:top]]
    return "\n".join(lines)
