"""The token2wav worker pool of the benchmark's baseline: batch-1 chunks on several threads, each
stream pinned to one thread, on the real (tiny) engines."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path

import pytest
import torch

from engines.config import SAMPLES_PER_TOKEN
from engines.llm.base import SamplingParams
from engines.token2wav.base import ChunkJob
from engines.token2wav.torch_backend import TorchToken2Wav
from realtime.config import ServiceConfig
from realtime.runtime import Runtime
from realtime.session import SpeechRequest

TOKENS = 70  # the exponential schedule cuts this into three chunks


async def test_baseline_pool_runs_each_stream_on_one_of_several_threads(
    tiny_models: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    eventually: Callable[[Callable[[], bool]], Awaitable[None]],
) -> None:
    threads_of: dict[int, set[str]] = {}
    batch_sizes: list[int] = []
    run_chunks = TorchToken2Wav.run_chunks

    def recording(self: TorchToken2Wav, jobs: Sequence[ChunkJob]) -> list[torch.Tensor]:
        batch_sizes.append(len(jobs))
        for job in jobs:
            threads_of.setdefault(id(job.stream), set()).add(threading.current_thread().name)
        return run_chunks(self, jobs)

    monkeypatch.setattr(TorchToken2Wav, "run_chunks", recording)
    config = ServiceConfig(
        models_dir=tiny_models,
        voices_dir=tmp_path,
        device="cpu",
        max_streams=3,
        llm_slots=1,
        token2wav_batch=1,
        token2wav_workers=3,
    )
    runtime = Runtime(config)
    await runtime.start()
    try:

        async def speak(seed: int) -> int:
            request = SpeechRequest("Hello there.", sampling=SamplingParams(seed=seed, fixed_length=TOKENS))
            async with runtime.speak(request) as session:
                return sum([chunk.pcm.size async for chunk in session])

        lengths = await asyncio.gather(*(speak(seed) for seed in range(3)))
        await eventually(lambda: runtime.stats().token2wav_streams == 0)  # closes run on the threads
    finally:
        await runtime.stop(config.drain_timeout_s)
    assert lengths == [TOKENS * SAMPLES_PER_TOKEN] * 3
    assert set(batch_sizes) == {1}
    assert len(threads_of) == 3 and all(len(names) == 1 for names in threads_of.values())
    assert set().union(*threads_of.values()) == {"token2wav-0", "token2wav-1", "token2wav-2"}
