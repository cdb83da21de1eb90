"""The benchmark's per-GPU figures: nvidia-smi's CSV parsed and summarised per GPU; on a machine
without nvidia-smi a level simply has no GPU figures."""

from __future__ import annotations

import shutil

import pytest

from realtime.gpu_sampler import GpuSampler, format_gpus, parse_samples, summarize

# What `nvidia-smi --query-gpu=index,utilization.gpu,memory.used --format=csv,noheader,nounits -lms=N`
# prints for two GPUs over two samples (and a line it prints when a field is unavailable).
OUTPUT = """0, 87, 28160
1, 40, 20480
0, 93, 28672
1, 60, 20992
0, [N/A], 1
"""


def test_samples_are_summarised_per_gpu() -> None:
    first, second = summarize(parse_samples(OUTPUT.splitlines()))
    assert (first.index, first.samples, first.utilization_mean, first.utilization_peak) == (0, 2, 90.0, 93.0)
    assert first.memory_peak_gib == 28.0
    assert (second.index, second.utilization_mean, second.memory_peak_gib) == (1, 50.0, 20.5)
    assert format_gpus([first]) == "GPU 0: 90% mean / 93% peak busy, 28.0 GiB"


@pytest.mark.skipif(shutil.which("nvidia-smi") is not None, reason="this machine has nvidia-smi")
async def test_without_nvidia_smi_there_are_no_figures() -> None:
    async with GpuSampler() as sampler:
        pass
    assert sampler.figures == []
