"""Where engines run and where a new stream goes (pure policy: no torch, no threads).

Two ways to spread the engines over several GPUs, as CosyVoice's own runtime and replicated servers do:

- disaggregated: one LLM engine (on the first GPU) serves every stream; a token2wav worker on every GPU
  turns the tokens into audio. The 0.5B LLM's decode is launch-bound and batches well, token2wav is
  the bottleneck, so it gets every GPU.
- replicated: a full pair of engines (LLM + token2wav) per GPU; a stream's LLM request goes to the LLM
  on its token2wav worker's GPU.

A stream is placed on the token2wav worker with the most room when it opens and stays there (its
caches live on that GPU). Room is counted in streams and, where a worker has a memory budget, in the
device bytes its streams may reach (engines/token2wav/stream_memory.py): a stream is placed only where
its bound fits beside those already reserved.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass


class PlacementKind(enum.StrEnum):
    DISAGGREGATED = "disaggregated"
    REPLICATED = "replicated"


@dataclass(frozen=True)
class DevicePlan:
    """The devices of the LLM engines and of the token2wav workers (torch device names). A device may be
    listed more than once: several workers then share it (each with its own thread and caches)."""

    llm_devices: tuple[str, ...]
    token2wav_devices: tuple[str, ...]

    def __post_init__(self) -> None:
        for name in ("llm_devices", "token2wav_devices"):
            if not getattr(self, name):
                raise ValueError(f"{name} is empty: give at least one device")
            # One name per device, so that `cuda` and `cuda:0` are seen to share a GPU.
            object.__setattr__(self, name, tuple(_canonical(device) for device in getattr(self, name)))

    @property
    def shared_gpus(self) -> tuple[str, ...]:
        """The GPUs that hold an LLM engine and a token2wav worker both."""
        return tuple(device for device in dict.fromkeys(self.llm_devices)
                     if device.startswith("cuda") and device in self.token2wav_devices)

    def llm_for(self, token2wav_index: int) -> int | None:
        """The (first) LLM engine on the same device as token2wav worker `token2wav_index`, if any."""
        device = self.token2wav_devices[token2wav_index]
        return self.llm_devices.index(device) if device in self.llm_devices else None


def _canonical(device: str) -> str:
    """A device's one name: a bare `cuda` is the current GPU, GPU 0 in the service's process."""
    return "cuda:0" if device == "cuda" else device


def plan_devices(
    device: str,
    gpu_count: int,
    kind: PlacementKind = PlacementKind.DISAGGREGATED,
    llm_devices: tuple[str, ...] | None = None,
    token2wav_devices: tuple[str, ...] | None = None,
) -> DevicePlan:
    """Devices for the engines.

    Explicit `llm_devices` / `token2wav_devices` win. Otherwise `device` = `auto` spreads the engines
    over the `gpu_count` visible GPUs as `kind` says (CPU when there is none), and any other `device`
    (`cpu`, `cuda`, `cuda:1`) puts everything on it.
    """
    every_gpu = tuple(f"cuda:{index}" for index in range(gpu_count)) or ("cpu",)
    gpus = every_gpu if device == "auto" else (device,)
    default_llm = gpus if kind is PlacementKind.REPLICATED else gpus[:1]
    return DevicePlan(llm_devices or default_llm, token2wav_devices or gpus)


@dataclass(frozen=True)
class WorkerLoad:
    """What placement knows of one token2wav worker: streams placed on it and not yet finished, the
    most it takes, whether its threads are running, the device bytes reserved for its streams and its
    budget of them (None: not bounded by bytes)."""

    streams: int
    capacity: int
    alive: bool = True
    reserved_bytes: int = 0
    budget_bytes: int | None = None

    def has_room(self, stream_bytes: int) -> bool:
        """Whether one more stream, reaching `stream_bytes`, fits its count and its bytes. A worker with no
        stream always takes one: a budget estimated too small refuses streams, never every stream."""
        fits_bytes = self.budget_bytes is None or self.reserved_bytes + stream_bytes <= self.budget_bytes
        return self.streams < self.capacity and (fits_bytes or self.streams == 0)

    @property
    def used_share(self) -> float:
        """The larger of its count and its bytes in use, as a share of its limit."""
        count = self.streams / self.capacity
        if self.budget_bytes is None:
            return count
        return max(count, self.reserved_bytes / self.budget_bytes if self.budget_bytes > 0 else 1.0)


def least_loaded(workers: Sequence[WorkerLoad], stream_bytes: Sequence[int] | None = None) -> int | None:
    """The live worker with room for one more stream (reaching `stream_bytes[i]` on worker i; none
    given: 0) and the smallest share of its limits in use (ties: the first one); None when every worker
    is full or dead."""
    needs = stream_bytes if stream_bytes is not None else [0] * len(workers)
    candidates = [
        (load.used_share, index)
        for index, (load, need) in enumerate(zip(workers, needs, strict=True))
        if load.alive and load.has_room(need)
    ]
    return min(candidates)[1] if candidates else None


def split_capacity(total: int, workers: int) -> list[int]:
    """`total` streams shared out over `workers` as evenly as whole numbers allow (the first ones get
    the remainder), each at least 1."""
    base, extra = divmod(total, workers)
    return [max(1, base + (index < extra)) for index in range(workers)]


def parse_devices(text: str) -> tuple[str, ...]:
    """`cuda:0,cuda:1` → ("cuda:0", "cuda:1"); a bare GPU number means `cuda:N`."""
    devices = tuple(part.strip() for part in text.split(",") if part.strip())
    if not devices:
        raise ValueError(f"no device in {text!r}: expected e.g. cuda:0 or cuda:1,cuda:2")
    return tuple(f"cuda:{name}" if name.isdigit() else name for name in devices)


__all__ = ["DevicePlan", "PlacementKind", "WorkerLoad", "least_loaded", "parse_devices", "plan_devices",
           "split_capacity"]
