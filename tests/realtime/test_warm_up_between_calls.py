"""A token2wav worker runs the rest of a staged warm-up (Token2Wav.staged_warmup) between its calls: the
calls are served meanwhile, a step runs only when nothing is queued (beside open streams one per gap at
most), and a stop or a failed step ends the steps and releases what they hold. On the real tiny engines
(CPU); the steps' own work is a stand-in that records when it runs (the graph captures they do on a GPU
are tested in tests/engines/test_token2wav_batching.py)."""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Sequence
from pathlib import Path

import pytest

from engines.config import ModelPaths
from engines.token2wav.base import ChunkJob, LaunchedChunks, SpeakerState, WarmupSteps
from engines.token2wav.torch_backend import TorchToken2Wav
from engines.voice import VoicePrompt
from realtime.metrics import Metrics
from realtime.token2wav_worker import Token2WavWorker

STEP_S = 0.005


class RecordingWarmup:
    """A staged warm-up whose steps record when they run (on which thread, between which calls) and hold
    a real stream of the backend until they end, as the PyTorch warm-up's chunk passes do."""

    def __init__(self, backend: TorchToken2Wav, steps: int, fail_at: int | None = None) -> None:
        self.backend, self.steps, self.fail_at = backend, steps, fail_at
        self.events: list[str] = []
        self.step_times: list[float] = []
        self.threads: set[str] = set()
        self.held_open = False

    def __call__(self, speaker: SpeakerState, batches: Sequence[int]) -> WarmupSteps:
        stream = self.backend.open_stream(speaker)
        self.held_open = True
        try:
            self.events.append("first stage")
            yield
            for index in range(self.steps):
                if index == self.fail_at:
                    raise RuntimeError("a capture failed")
                self.threads.add(threading.current_thread().name)
                self.events.append("step")
                self.step_times.append(time.monotonic())
                time.sleep(STEP_S)
                yield
        finally:
            stream.close()
            self.held_open = False
            self.events.append("ended")


def warming(metrics: Metrics) -> float:
    value = metrics.registry.get_sample_value("tts_token2wav_warmups_running")
    assert value is not None
    return value


async def until_warm(metrics: Metrics) -> None:
    for _ in range(1200):
        if not warming(metrics):
            return
        await asyncio.sleep(0.05)
    raise AssertionError("the warm-up's steps never ended")


async def steps_reach(recording: RecordingWarmup, count: int) -> None:
    """Wait until `count` steps have run (a loaded CI machine runs them slower than their sleep)."""
    for _ in range(1200):
        if recording.events.count("step") >= count:
            return
        await asyncio.sleep(0.02)
    raise AssertionError(f"{count} warm-up steps never ran")


async def started_worker(tiny_models: Path, warmup: int, fail_at: int | None = None,
                         ) -> tuple[Token2WavWorker, TorchToken2Wav, RecordingWarmup, SpeakerState, Metrics]:
    backend = TorchToken2Wav.from_models_dir(tiny_models, "dit", "cpu")
    recording = RecordingWarmup(backend, warmup, fail_at)
    backend.staged_warmup = recording  # type: ignore[method-assign]
    metrics = Metrics()
    worker = Token2WavWorker(backend, max_batch=4, capacity=8, metrics=metrics)
    worker.start()
    voice = VoicePrompt.load(ModelPaths(tiny_models).voices / "default.safetensors")
    speaker = await worker.prepare_speaker(voice)
    return worker, backend, recording, speaker, metrics


async def test_calls_are_served_while_the_warm_up_goes_on_between_them(tiny_models: Path) -> None:
    """`warmup(between_calls=True)` returns after the first stage; a stream's chunks are then served while
    steps remain, each waiting for at most the one step under way; the steps run on the worker's thread;
    once they are exhausted the warm-up has ended (its stream closed, the gauge back to 0)."""
    worker, backend, recording, speaker, metrics = await started_worker(tiny_models, warmup=400)
    calls: list[int] = []
    launch_chunks = backend.launch_chunks

    def recording_calls(jobs: Sequence[ChunkJob]) -> LaunchedChunks:
        calls.append(len(recording.events))
        return launch_chunks(jobs)

    backend.launch_chunks = recording_calls  # type: ignore[method-assign]
    try:
        await worker.warmup(speaker, [4, 1], between_calls=True)
        assert recording.events[0] == "first stage" and warming(metrics) == 1 and worker.warming_up
        await steps_reach(recording, 2)  # steps run while nothing is queued
        stream = await worker.open_stream(speaker)
        submitted = len(recording.events)
        audio = await worker.synthesize(stream, list(range(18)), last=True, due=float("-inf"))
        assert audio.size > 0
        assert calls[0] - submitted <= 1  # at most the step under way came before the call
        assert recording.held_open and "ended" not in recording.events  # steps remain
        worker.close_stream(stream)
        await until_warm(metrics)
        assert recording.events.count("step") == 400 and recording.events[-1] == "ended"
        assert recording.threads == {"token2wav-0"}
        assert not recording.held_open and not worker.warming_up
    finally:
        await asyncio.to_thread(worker.stop)


async def test_beside_open_streams_steps_come_one_per_gap(tiny_models: Path,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """While a stream is open on the thread, a step runs only once `WARMUP_STEP_GAP_S` has passed since the
    last (so its chunks and the LLM's steps are not held up step after step); once none is open, the
    steps run back to back again."""
    import realtime.token2wav_worker as worker_module

    gap = 0.2
    monkeypatch.setattr(worker_module, "WARMUP_STEP_GAP_S", gap)
    worker, _, recording, speaker, _ = await started_worker(tiny_models, warmup=100_000)
    try:
        stream = await worker.open_stream(speaker)  # before the steps start: none runs back to back
        await worker.warmup(speaker, [1], between_calls=True)
        await asyncio.sleep(5 * gap)
        beside = list(recording.step_times)
        assert 1 <= len(beside) <= 6
        assert all(later - earlier >= gap - 0.02 for earlier, later in zip(beside, beside[1:], strict=False))
        worker.close_stream(stream)
        await steps_reach(recording, len(beside) + 10)
        assert recording.step_times[-1] - recording.step_times[-10] < gap  # back to back again
    finally:
        await asyncio.to_thread(worker.stop)


async def test_a_stop_ends_the_warm_up_mid_way_and_releases_its_streams(tiny_models: Path) -> None:
    worker, _, recording, speaker, metrics = await started_worker(tiny_models, warmup=100_000)
    await worker.warmup(speaker, [1], between_calls=True)
    await steps_reach(recording, 2)
    assert recording.held_open and warming(metrics) == 1
    await asyncio.to_thread(worker.stop)
    assert not recording.held_open and recording.events[-1] == "ended"
    assert 1 < recording.events.count("step") < 100_000
    assert warming(metrics) == 0


async def test_a_failed_step_ends_the_warm_up_and_the_worker_serves_on(
    tiny_models: Path, caplog: pytest.LogCaptureFixture
) -> None:
    worker, _, recording, speaker, metrics = await started_worker(tiny_models, warmup=50, fail_at=3)
    try:
        with caplog.at_level(logging.ERROR, logger="realtime.token2wav_worker"):
            await worker.warmup(speaker, [1], between_calls=True)
            await until_warm(metrics)
        assert recording.events.count("step") == 3 and not recording.held_open
        assert any("warm-up step failed" in record.getMessage() for record in caplog.records)
        stream = await worker.open_stream(speaker)
        audio = await worker.synthesize(stream, list(range(18)), last=True, due=float("-inf"))
        assert audio.size > 0 and worker.alive
        worker.close_stream(stream)
    finally:
        await asyncio.to_thread(worker.stop)


async def test_without_between_calls_the_whole_warm_up_runs_first(tiny_models: Path) -> None:
    worker, _, recording, speaker, metrics = await started_worker(tiny_models, warmup=20)
    try:
        await worker.warmup(speaker, [1], between_calls=False)
        assert recording.events.count("step") == 20 and recording.events[-1] == "ended"
        assert warming(metrics) == 0
    finally:
        await asyncio.to_thread(worker.stop)


def test_the_pytorch_warm_up_without_graphs_is_one_stage(tiny_models: Path) -> None:
    """On a CPU (no CUDA graphs) the real staged warm-up does everything in its first stage: one step."""
    backend = TorchToken2Wav.from_models_dir(tiny_models, "dit", "cpu")
    voice = VoicePrompt.load(ModelPaths(tiny_models).voices / "default.safetensors")
    speaker = backend.prepare_speaker(voice)
    steps = backend.staged_warmup(speaker, [2, 1])
    assert next(steps, "done") is None
    assert next(steps, "done") == "done"
