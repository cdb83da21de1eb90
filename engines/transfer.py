"""Host → device copies that do not make the host wait for the device."""

from __future__ import annotations

import torch


def upload(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """`host` (a CPU tensor) on `device`. On CUDA the copy goes through pinned memory without waiting
    for the device, so an engine thread keeps queueing work while earlier kernels run (a copy from
    pageable memory would wait for the stream to drain first)."""
    if device.type != "cuda":
        return host.to(device)
    return host.pin_memory().to(device, non_blocking=True)
