"""Per-GPU utilisation and memory while a benchmark level runs, sampled with `nvidia-smi` (the same
machine as the server the benchmark spawned). Without nvidia-smi (a CPU machine) there is nothing to
sample and the level reports no GPU figures."""

from __future__ import annotations

import asyncio
import contextlib
import shutil
from collections.abc import Iterable
from dataclasses import dataclass
from types import TracebackType

QUERY = ("nvidia-smi", "--query-gpu=index,utilization.gpu,memory.used", "--format=csv,noheader,nounits")


@dataclass(frozen=True)
class GpuFigures:
    """One GPU over one level: mean and peak utilisation (%), peak memory in use (GiB, every process)."""

    index: int
    utilization_mean: float
    utilization_peak: float
    memory_peak_gib: float
    samples: int


def parse_samples(lines: Iterable[str]) -> dict[int, list[tuple[float, float]]]:
    """`nvidia-smi` CSV lines (`index, utilization %, memory MiB`) → per GPU, (utilisation, MiB)
    samples; lines that are not three numbers (a driver message, `[N/A]`) are skipped."""
    per_gpu: dict[int, list[tuple[float, float]]] = {}
    for line in lines:
        fields = [field.strip() for field in line.split(",")]
        if len(fields) != 3:
            continue
        try:
            index, utilization, memory = int(fields[0]), float(fields[1]), float(fields[2])
        except ValueError:
            continue
        per_gpu.setdefault(index, []).append((utilization, memory))
    return per_gpu


def summarize(per_gpu: dict[int, list[tuple[float, float]]]) -> list[GpuFigures]:
    return [
        GpuFigures(
            index=index,
            utilization_mean=sum(u for u, _ in samples) / len(samples),
            utilization_peak=max(u for u, _ in samples),
            memory_peak_gib=max(m for _, m in samples) / 1024,
            samples=len(samples),
        )
        for index, samples in sorted(per_gpu.items())
        if samples
    ]


class GpuSampler:
    """`async with GpuSampler(interval_ms) as sampler: ...` samples every GPU until the block ends;
    `sampler.figures` then holds one `GpuFigures` per GPU (empty without nvidia-smi)."""

    def __init__(self, interval_ms: int = 100) -> None:
        self._interval_ms = interval_ms
        self._process: asyncio.subprocess.Process | None = None
        self._reader: asyncio.Task[list[str]] | None = None
        self.figures: list[GpuFigures] = []

    async def __aenter__(self) -> GpuSampler:
        if shutil.which(QUERY[0]) is None:
            return self
        self._process = await asyncio.create_subprocess_exec(
            *QUERY, f"-lms={self._interval_ms}",
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.DEVNULL,
        )
        self._reader = asyncio.create_task(self._read_lines(self._process))
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if self._process is None or self._reader is None:
            return
        with contextlib.suppress(ProcessLookupError):
            self._process.terminate()
        await self._process.wait()
        self.figures = summarize(parse_samples(await self._reader))

    @staticmethod
    async def _read_lines(process: asyncio.subprocess.Process) -> list[str]:
        assert process.stdout is not None
        return [line.decode(errors="replace") async for line in process.stdout]


def format_gpus(figures: Iterable[GpuFigures]) -> str:
    """One line: each GPU's mean/peak utilisation and peak memory."""
    return "; ".join(
        f"GPU {g.index}: {g.utilization_mean:.0f}% mean / {g.utilization_peak:.0f}% peak busy, "
        f"{g.memory_peak_gib:.1f} GiB"
        for g in figures
    )


__all__ = ["GpuFigures", "GpuSampler", "format_gpus", "parse_samples", "summarize"]
