"""The token2wav worker pool of the benchmark's baseline: batch-1 chunks on several threads, each
stream pinned to one thread, on the real (tiny) engines."""

from __future__ import annotations

import asyncio
import contextlib
import math
import threading
import time
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path

import pytest
from testing import speak_samples

from engines.config import PRE_LOOKAHEAD, SAMPLES_PER_MEL_FRAME, SAMPLES_PER_TOKEN, HiFTConfig, ModelPaths
from engines.llm.base import SamplingParams
from engines.token2wav.base import ChunkJob, LaunchedChunks, SpeakerState, Token2WavStream
from engines.token2wav.torch_backend import TorchToken2Wav
from engines.voice import VoicePrompt
from realtime.batch_policy import FirstChunkHold
from realtime.config import ServiceConfig
from realtime.metrics import Metrics
from realtime.runtime import Runtime
from realtime.schedule import ScheduleKind
from realtime.session import Session, SpeechRequest
from realtime.token2wav_worker import Token2WavWorker

TOKENS = 70  # the exponential schedule cuts this into three chunks


async def test_baseline_pool_runs_each_stream_on_one_of_several_threads(
    tiny_models: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    eventually: Callable[[Callable[[], bool]], Awaitable[None]],
) -> None:
    threads_of: dict[int, set[str]] = {}
    batch_sizes: list[int] = []
    launch_chunks = TorchToken2Wav.launch_chunks

    def recording(self: TorchToken2Wav, jobs: Sequence[ChunkJob]) -> LaunchedChunks:
        batch_sizes.append(len(jobs))
        for job in jobs:
            threads_of.setdefault(id(job.stream), set()).add(threading.current_thread().name)
        return launch_chunks(self, jobs)

    monkeypatch.setattr(TorchToken2Wav, "launch_chunks", recording)
    config = ServiceConfig(
        models_dir=tiny_models,
        voices_dir=tmp_path,
        device="cpu",
        max_streams=3,
        llm_slots=1,
        token2wav_batch=1,
        token2wav_workers=3,
        llm_pacing=False,
    )
    runtime = Runtime(config)
    await runtime.start()
    try:
        lengths = await asyncio.gather(*(speak_samples(runtime, seed, TOKENS) for seed in range(3)))
        await eventually(lambda: runtime.stats().token2wav_streams == 0)  # closes run on the threads
    finally:
        await runtime.stop(config.drain_timeout_s)
    assert lengths == [TOKENS * SAMPLES_PER_TOKEN] * 3
    assert set(batch_sizes) == {1}
    assert len(threads_of) == 3 and all(len(names) == 1 for names in threads_of.values())
    assert set().union(*threads_of.values()) == {"token2wav-0", "token2wav-1", "token2wav-2"}


async def test_worker_runs_the_most_urgent_chunk_first(tiny_models: Path) -> None:
    """While the thread is busy, chunks pile up; it then takes them earliest deadline first (first
    audio, due -inf, before everything), one batch of `max_batch` at a time."""
    backend = TorchToken2Wav.from_models_dir(tiny_models, "dit", "cpu")
    voice = VoicePrompt.load(ModelPaths(tiny_models).voices / "default.safetensors")
    worker = Token2WavWorker(backend, max_batch=1, capacity=8)
    order: list[int] = []
    launch_chunks = backend.launch_chunks

    def recording(jobs: Sequence[ChunkJob]) -> LaunchedChunks:
        order.extend(streams.index(job.stream) for job in jobs)
        return launch_chunks(jobs)

    backend.launch_chunks = recording  # type: ignore[method-assign]
    worker.start()
    try:
        speaker = await worker.prepare_speaker(voice)
        streams = [await worker.open_stream(speaker) for _ in range(4)]
        gate = threading.Event()
        blocked = asyncio.ensure_future(worker.call(gate.wait))
        tokens = list(range(18))
        dues = [5.0, -math.inf, 2.0, 9.0]  # stream i's chunk is due at dues[i]
        chunks = [
            asyncio.ensure_future(worker.synthesize(stream, tokens, last=False, due=due))
            for stream, due in zip(streams, dues, strict=True)
        ]
        await asyncio.sleep(0.2)  # every chunk is queued behind the blocking call
        gate.set()
        await blocked
        await asyncio.gather(*chunks)
    finally:
        await asyncio.to_thread(worker.stop)
    assert order == [1, 2, 0, 3]


async def test_first_chunks_of_streams_opened_together_share_a_batch(tiny_models: Path) -> None:
    """A first chunk waits for the first chunks of the other streams opened on its thread that have sent
    none yet, while they keep coming, so that they run as one batch. The metrics count, for each call of
    first chunks, the new streams left for a later call."""
    backend = TorchToken2Wav.from_models_dir(tiny_models, "dit", "cpu")
    voice = VoicePrompt.load(ModelPaths(tiny_models).voices / "default.safetensors")
    metrics = Metrics()
    worker = Token2WavWorker(backend, max_batch=8, capacity=8, hold=FirstChunkHold(gap_s=0.3, max_s=2.0),
                             metrics=metrics)
    batches: list[int] = []
    launch_chunks = backend.launch_chunks

    def recording(jobs: Sequence[ChunkJob]) -> LaunchedChunks:
        batches.append(len(jobs))
        return launch_chunks(jobs)

    backend.launch_chunks = recording  # type: ignore[method-assign]
    tokens = list(range(18))
    worker.start()
    try:
        speaker = await worker.prepare_speaker(voice)
        together = [await worker.open_stream(speaker) for _ in range(3)]
        chunks = []
        for stream in together:  # ready a few milliseconds apart, like streams a decode step apart
            chunks.append(asyncio.ensure_future(worker.synthesize(stream, tokens, last=False, due=-math.inf)))
            await asyncio.sleep(0.02)
        await asyncio.gather(*chunks)
        assert batches == [3]
        # A stream that sends nothing holds the others back for one gap only.
        lone, silent = await worker.open_stream(speaker), await worker.open_stream(speaker)
        started = time.perf_counter()
        await worker.synthesize(lone, tokens, last=False, due=-math.inf)
        waited = time.perf_counter() - started
        assert batches == [3, 1] and 0.3 <= waited < 10
        pending = metrics.registry.get_sample_value
        # The three together left none behind; the lone one left the silent stream.
        assert pending("tts_token2wav_first_chunks_pending_count") == 2
        assert pending("tts_token2wav_first_chunks_pending_sum") == 1
        for stream in (*together, lone, silent):
            worker.close_stream(stream)
    finally:
        await asyncio.to_thread(worker.stop)


async def test_a_stream_whose_opener_was_cancelled_is_closed_once_open(tiny_models: Path) -> None:
    """An opener cancelled (a client gone) while the thread opens its stream: the stream is closed on
    that thread once open, instead of keeping its caches and counting as a fresh stream whose first
    chunk the batch policy would wait for."""
    backend = TorchToken2Wav.from_models_dir(tiny_models, "dit", "cpu")
    voice = VoicePrompt.load(ModelPaths(tiny_models).voices / "default.safetensors")
    worker = Token2WavWorker(backend, max_batch=8, capacity=8)
    opening, go_on = threading.Event(), threading.Event()
    open_stream = backend.open_stream

    def slow_open(speaker: SpeakerState) -> Token2WavStream:
        opening.set()
        go_on.wait()
        return open_stream(speaker)

    backend.open_stream = slow_open  # type: ignore[method-assign]
    worker.start()
    try:
        speaker = await worker.prepare_speaker(voice)
        opener = asyncio.ensure_future(worker.open_stream(speaker))
        await asyncio.to_thread(opening.wait)
        opener.cancel()
        with pytest.raises(asyncio.CancelledError):
            await opener
        go_on.set()
        # The close is queued as the open finishes: two calls later it has run.
        await worker.call(lambda: None)
        await worker.call(lambda: None)
        assert worker.open_streams == 0
        assert not any(lane.fresh for lane in worker._lanes)
    finally:
        go_on.set()
        await asyncio.to_thread(worker.stop)


@pytest.mark.parametrize(
    ("schedule", "first_chunk_tokens", "light_load_streams", "first_hop"),
    [
        (ScheduleKind.EXPONENTIAL, 15, 0, 15),
        (ScheduleKind.EQUAL, 15, 16, 25),
        (ScheduleKind.EXPONENTIAL, 10, 0, 10),
        (ScheduleKind.EXPONENTIAL, 15, 16, 10),  # a lone stream: the light-load first chunk
    ],
)
async def test_the_configured_schedule_cuts_the_chunks(
    tiny_models: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    schedule: ScheduleKind,
    first_chunk_tokens: int,
    light_load_streams: int,
    first_hop: int,
) -> None:
    """The schedule and the exponential schedule's first chunk (`first_chunk_tokens`, or the light-load
    one; the equal schedule's hop is its own) decide what token2wav gets: the first chunk's tokens and
    lookahead, and its audio, two mel frames a token less the 8 HiFT holds back for the next chunk."""
    chunk_tokens: list[int] = []
    launch_chunks = TorchToken2Wav.launch_chunks

    def recording(self: TorchToken2Wav, jobs: Sequence[ChunkJob]) -> LaunchedChunks:
        chunk_tokens.extend(job.tokens.numel() for job in jobs)
        return launch_chunks(self, jobs)

    monkeypatch.setattr(TorchToken2Wav, "launch_chunks", recording)
    config = ServiceConfig(models_dir=tiny_models, voices_dir=tmp_path, device="cpu", schedule=schedule,
                           first_chunk_tokens=first_chunk_tokens, light_load_streams=light_load_streams)
    runtime = Runtime(config)
    await runtime.start()
    try:
        request = SpeechRequest("Hello there.", sampling=SamplingParams(seed=0, fixed_length=TOKENS))
        async with runtime.speak(request) as session:
            sizes = [chunk.pcm.size async for chunk in session]
    finally:
        await runtime.stop(config.drain_timeout_s)
    assert sum(sizes) == TOKENS * SAMPLES_PER_TOKEN
    assert chunk_tokens[0] == first_hop + PRE_LOOKAHEAD
    assert sizes[0] == first_hop * SAMPLES_PER_TOKEN - HiFTConfig().mel_cache_frames * SAMPLES_PER_MEL_FRAME


async def test_streams_that_start_beside_enough_open_ones_get_the_usual_first_chunk(
    tiny_models: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With `light_load_streams` 2, the first two streams (0 and 1 open beside them) get the light-load
    first chunk, a third opened while they are open gets `first_chunk_tokens`; once they ended, a fourth
    gets the light one again. The metric counts streams by first chunk."""
    first_tokens: list[int] = []
    seen: list[Token2WavStream] = []  # kept alive: no id is reused
    launch_chunks = TorchToken2Wav.launch_chunks

    def recording(self: TorchToken2Wav, jobs: Sequence[ChunkJob]) -> LaunchedChunks:
        for job in jobs:
            if not any(job.stream is stream for stream in seen):
                seen.append(job.stream)
                first_tokens.append(job.tokens.numel())
        return launch_chunks(self, jobs)

    monkeypatch.setattr(TorchToken2Wav, "launch_chunks", recording)
    config = ServiceConfig(models_dir=tiny_models, voices_dir=tmp_path, device="cpu", max_streams=4,
                           first_chunk_tokens=15, light_load_first_chunk_tokens=8, light_load_streams=2)
    runtime = Runtime(config)
    await runtime.start()

    async def speak(session: Session) -> int:
        return sum([chunk.pcm.size async for chunk in session])

    try:
        request = SpeechRequest("Hello there.", sampling=SamplingParams(seed=0, fixed_length=TOKENS))
        async with contextlib.AsyncExitStack() as open_sessions:
            sessions = [await open_sessions.enter_async_context(runtime.speak(request)) for _ in range(3)]
            samples = await asyncio.gather(*(speak(session) for session in sessions))
        async with runtime.speak(request) as session:
            samples.append(await speak(session))
        count = runtime.metrics.registry.get_sample_value
        assert count("tts_first_chunk_hops_total", {"tokens": "8"}) == 3
        assert count("tts_first_chunk_hops_total", {"tokens": "15"}) == 1
    finally:
        await runtime.stop(config.drain_timeout_s)
    assert samples == [TOKENS * SAMPLES_PER_TOKEN] * 4
    assert sorted(first_tokens) == [8 + PRE_LOOKAHEAD] * 3 + [15 + PRE_LOOKAHEAD]


def test_stopping_the_worker_stops_compile_processes_no_warm_up_took(tiny_models: Path) -> None:
    """A cold start's idle compile workers belong to the backend: when its worker stops before any warm-up
    took them (a start that failed, a CPU-only voice set), they end then, not at their idle timeout."""
    from engines.token2wav.block_compile import BlockCompileWorkers

    idle = BlockCompileWorkers(2)
    loaded = TorchToken2Wav.from_models_dir(tiny_models, "dit", "cpu")
    backend = TorchToken2Wav(loaded.flow, loaded.hift, block_workers=idle)
    worker = Token2WavWorker(backend, max_batch=1, capacity=2)
    worker.start()
    assert len(idle.running) == 2
    worker.stop()
    assert None not in idle.exit_codes
    backend.close()  # idempotent


async def test_a_stream_opened_for_a_listener_with_audio_holds_no_first_chunk_back(tiny_models: Path) -> None:
    """A stream whose listener hears audio already (a context's later text: `first_audio=False`) is not
    one the first-audio calls wait for; a new stream that sends nothing is (the metric counts, for each
    call of first chunks, the new streams it left for a later call)."""
    backend = TorchToken2Wav.from_models_dir(tiny_models, "dit", "cpu")
    voice = VoicePrompt.load(ModelPaths(tiny_models).voices / "default.safetensors")
    metrics = Metrics()
    worker = Token2WavWorker(backend, max_batch=8, capacity=8, hold=FirstChunkHold(gap_s=0.3, max_s=2.0),
                             metrics=metrics)
    pending = metrics.registry.get_sample_value
    tokens = list(range(18))
    worker.start()
    try:
        speaker = await worker.prepare_speaker(voice)
        new = await worker.open_stream(speaker)
        follower = await worker.open_stream(speaker, first_audio=False)
        await worker.synthesize(new, tokens, last=False, due=-math.inf)
        assert pending("tts_token2wav_first_chunks_pending_count") == 1
        assert pending("tts_token2wav_first_chunks_pending_sum") == 0
        other, silent = await worker.open_stream(speaker), await worker.open_stream(speaker)
        await worker.synthesize(other, tokens, last=False, due=-math.inf)
        assert pending("tts_token2wav_first_chunks_pending_count") == 2
        assert pending("tts_token2wav_first_chunks_pending_sum") == 1
        for stream in (new, follower, other, silent):
            worker.close_stream(stream)
    finally:
        await asyncio.to_thread(worker.stop)
