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


class Download:
    """A device tensor on its way to host memory: the copy is queued on the current stream into pinned
    memory, and only `wait` blocks, until it has landed. So an engine thread can queue its next work
    before it needs this result. A CPU tensor is simply kept."""

    def __init__(self, tensor: torch.Tensor) -> None:
        self._landed: torch.cuda.Event | None = None
        if tensor.device.type != "cuda":
            self._host = tensor
            return
        self._host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
        self._host.copy_(tensor, non_blocking=True)
        self._landed = torch.cuda.Event()
        self._landed.record()

    def wait(self) -> torch.Tensor:
        """The tensor in host memory (blocks until the device has copied it)."""
        if self._landed is not None:
            self._landed.synchronize()
        return self._host
