"""The device bytes each token2wav worker's streams may reserve, and what they have reserved.

A stream reserves the most its token2wav state can reach (engines/token2wav/stream_memory.py) on the
worker it is placed on, until it ends; placement (realtime/placement.py) takes a worker only while the
stream's bound fits its budget. A worker's budget is the configured one, else on CUDA what is usable
after the warm-up (the graphs' pools and the LLM's cache are taken by then) less a margin, shared out
among the workers of one device; on the CPU none. Touched on the event loop only.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import torch

from engines.cuda_graphs import usable_bytes
from realtime.metrics import Metrics

logger = logging.getLogger(__name__)

MIB = 1 << 20
GIB = 1 << 30


class MemoryBudgets:
    """Per token2wav worker: its budget of device bytes (None: no byte limit) and the bytes reserved
    for its streams. Every worker starts unbounded; `limit` sets the budgets once they are known."""

    def __init__(self, workers: int) -> None:
        self._budgets: list[int | None] = [None] * workers
        self._reserved = [0] * workers

    @property
    def budgets(self) -> Sequence[int | None]:
        return tuple(self._budgets)

    @property
    def reserved(self) -> Sequence[int]:
        return tuple(self._reserved)

    def limit(self, budgets: Sequence[int | None]) -> None:
        """Set every worker's budget (reservations already made stay)."""
        if len(budgets) != len(self._budgets):
            raise ValueError(f"{len(budgets)} budgets for {len(self._budgets)} token2wav workers")
        self._budgets = list(budgets)

    def reserve(self, worker: int, nbytes: int) -> None:
        self._reserved[worker] += nbytes

    def release(self, worker: int, nbytes: int) -> None:
        self._reserved[worker] -= nbytes


def device_budgets(devices: Sequence[torch.device], configured: int | None, margin: int) -> list[int | None]:
    """The budget of the token2wav worker on each of `devices`: `configured` for every one if given,
    else on CUDA what is usable now less `margin`, shared out among the workers of one device; on the
    CPU none."""
    if configured is not None:
        return [configured] * len(devices)
    sharing = {device: devices.count(device) for device in devices}
    return [
        None if device.type != "cuda" else max(0, usable_bytes(device) - margin) // sharing[device]
        for device in devices
    ]


def log_budgets(budgets: Sequence[int | None], devices: Sequence[torch.device], bounds: Sequence[int | None],
                capacities: Sequence[int], max_tokens: int, margin_gib: float | None) -> None:
    """Once at start, per worker: its budget (`margin_gib`: measured less that margin; None:
    configured), the default voice's bound per stream (`bounds`; None or 0: unknown) and how many such
    streams fit; a warning where they are fewer than the worker's share of --max-streams (`capacities`)."""
    for index, (budget, device, bound, capacity) in enumerate(
            zip(budgets, devices, bounds, capacities, strict=True)):
        if budget is None:
            limit = "no byte limit"
        elif margin_gib is not None:
            limit = f"{budget / GIB:.2f} GiB (free after the warm-up less a {margin_gib:g} GiB margin)"
        else:
            limit = f"{budget / GIB:.2f} GiB (configured)"
        per_stream = "unknown" if not bound else f"{bound / MIB:.1f} MiB"
        fit = "" if budget is None or not bound else f"; {budget // bound} such streams fit"
        if budget is not None and bound and budget // bound < capacity:
            logger.warning("token2wav worker %d on %s: device memory bounds it to %d streams of the "
                           "default voice, below its %d of --max-streams", index, device,
                           max(1, budget // bound), capacity)
        logger.info("token2wav memory admission, worker %d on %s: budget %s; bound per stream of the "
                    "default voice %s (%d tokens)%s", index, device, limit, per_stream, max_tokens, fit)


__all__ = ["MemoryBudgets", "device_budgets", "log_budgets", "track_gpu_memory"]


def track_gpu_memory(metrics: Metrics, devices: Sequence[str]) -> None:
    """Let `metrics` read the memory of the CUDA devices among `devices` at every scrape: the peak per
    device, PyTorch's allocated bytes and the devices' used and total bytes, summed over the GPUs."""
    gpus = sorted({torch.device(name) for name in devices if torch.device(name).type == "cuda"}, key=str)
    if not gpus:
        return

    def free_total() -> tuple[int, int]:
        readings = [torch.cuda.mem_get_info(device) for device in gpus]
        return sum(free for free, _ in readings), sum(total for _, total in readings)

    metrics.track_gpu_memory_peak(
        lambda: {str(device): torch.cuda.max_memory_allocated(device) for device in gpus})
    metrics.track_gpu_memory(lambda: sum(torch.cuda.memory_allocated(device) for device in gpus), free_total)
