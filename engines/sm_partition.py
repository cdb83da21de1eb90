"""One GPU's SMs split between the LLM's decode steps and token2wav (CUDA green contexts).

An LLM decode step is a few hundred short kernels. Beside a batched token2wav call each of them waits
until a DiT kernel's blocks leave an SM, so a step that takes ~1.1 ms alone took 6–8 ms under load
(docs/benchmarks.md, eighth session); stream priorities only choose which waiting block goes next and
do not make a running one yield. A green context owns a disjoint set of SMs: work on its streams runs
on those SMs only, so decode kernels start at once on SMs token2wav cannot take, at the price of those
SMs for token2wav. (The LLM's prefill, a few large matmuls that want every SM, stays on the whole
device: engines/llm/torch_engine.py.)

`split_sms` makes the two groups; each side takes its streams from its `SmGroup` (`StreamSource`):
the streams it serves on and the streams it captures CUDA graphs on, since a captured kernel runs on
the SMs of the stream it was captured on. Without a split, `DeviceStreams` hands out ordinary streams.
The green contexts and their streams live as long as the process: the engines' CUDA graphs hold kernels
bound to them until the process ends, and the driver frees both then.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Protocol

import torch

logger = logging.getLogger(__name__)


class StreamSource(Protocol):
    """Where an engine gets its CUDA streams: the SMs their kernels may use come with them."""

    def stream(self, priority: int = 0) -> torch.cuda.Stream:
        """A new stream; `priority` as torch's (lower is more urgent, 0 the default)."""
        ...


@dataclass(frozen=True)
class DeviceStreams:
    """Ordinary streams on the whole device."""

    device: torch.device

    def stream(self, priority: int = 0) -> torch.cuda.Stream:
        return torch.cuda.Stream(self.device, priority=priority)


class SmPartitionError(RuntimeError):
    """The driver cannot split the device's SMs as asked."""


def _driver() -> Any:
    try:
        from cuda.bindings import driver
    except ImportError as exc:  # the package is a Linux dependency of the project
        raise SmPartitionError("splitting SMs needs the cuda-bindings package") from exc
    return driver


def _check(result: tuple[Any, ...]) -> Any:
    """The value(s) of a cuda.bindings driver call, or SmPartitionError with the driver's error name."""
    driver = _driver()
    status, *values = result
    if status != driver.CUresult.CUDA_SUCCESS:
        _, name = driver.cuGetErrorName(status)
        raise SmPartitionError(f"CUDA driver call failed: {name.decode() if name else status}")
    return values[0] if len(values) == 1 else tuple(values)


@dataclass(frozen=True)
class SmGroup:
    """One green context and its SM count."""

    sms: int
    device: torch.device
    context: Any  # the driver's CUgreenCtx

    def stream(self, priority: int = 0) -> torch.cuda.Stream:
        driver = _driver()
        handle = _check(driver.cuGreenCtxStreamCreate(
            self.context, driver.CUstream_flags.CU_STREAM_NON_BLOCKING, priority))
        return torch.cuda.ExternalStream(int(handle), device=self.device)


@dataclass(frozen=True)
class SmPartition:
    """The LLM decode steps' SMs and token2wav's (the rest of the device), as two green contexts."""

    decode: SmGroup
    token2wav: SmGroup


def device_sms(device: torch.device) -> int:
    return int(torch.cuda.get_device_properties(device).multi_processor_count)


def split_sms(device: torch.device, decode_sms: int) -> SmPartition:
    """Give the LLM's decode steps at least `decode_sms` of `device`'s SMs and token2wav the others.

    The driver rounds the decode share up to its partition granularity (8 SMs on Hopper); the actual
    counts are in the result and the log. Raises SmPartitionError when the driver cannot make the split
    (no green contexts before CUDA 12.4, or too few SMs left for token2wav).
    """
    driver = _driver()
    torch.cuda.init()  # the primary context, which green contexts derive from
    index = device.index if device.index is not None else torch.cuda.current_device()
    device = torch.device("cuda", index)
    cu_device = _check(driver.cuDeviceGet(index))
    whole = _check(driver.cuDeviceGetDevResource(cu_device, driver.CUdevResourceType.CU_DEV_RESOURCE_TYPE_SM))
    groups, count, rest = _check(driver.cuDevSmResourceSplitByCount(1, whole, 0, decode_sms))
    if count < 1 or rest.sm.smCount < 1:
        raise SmPartitionError(f"cannot give LLM decode steps {decode_sms} of the device's "
                               f"{whole.sm.smCount} SMs and token2wav the rest")

    def group(resource: Any) -> SmGroup:
        desc = _check(driver.cuDevResourceGenerateDesc([resource], 1))
        flags = driver.CUgreenCtxCreate_flags.CU_GREEN_CTX_DEFAULT_STREAM
        context = _check(driver.cuGreenCtxCreate(desc, cu_device, flags))
        return SmGroup(int(resource.sm.smCount), device, context)

    partition = SmPartition(group(groups[0]), group(rest))
    logger.info("SMs split on %s: %d for LLM decode steps, %d for token2wav", device, partition.decode.sms,
                partition.token2wav.sms)
    return partition
