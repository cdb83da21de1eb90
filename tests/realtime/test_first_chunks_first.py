"""End to end on the tiny engines (CPU): with many streams, a stream's first chunk is served before any
other stream's later chunk that waits beside it, and never in the same token2wav call."""

from __future__ import annotations

import asyncio
import math
import threading
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
from testing import speak_samples

from engines.config import SAMPLES_PER_TOKEN
from engines.token2wav.base import ChunkJob, LaunchedChunks, Token2WavStream
from engines.token2wav.torch_backend import TorchToken2Wav
from realtime.config import ServiceConfig
from realtime.runtime import Runtime
from realtime.token2wav_worker import Token2WavWorker

TOKENS = 70  # chunks of 18 and 28 tokens, then the last 30
EARLY = LATE = 4  # streams started together, then streams whose first chunks come while later chunks wait


@dataclass(frozen=True)
class Submitted:
    at: float
    stream: Token2WavStream
    first: bool


@dataclass(frozen=True)
class Call:
    started: float
    chunks: tuple[tuple[Token2WavStream, bool], ...]  # (stream, first chunk of its stream)


async def test_first_chunks_run_before_later_chunks_waiting_beside_them(
    tiny_models: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    eventually: Callable[[Callable[[], bool]], Awaitable[None]],
) -> None:
    submitted: list[Submitted] = []
    calls: list[Call] = []
    seen: set[Token2WavStream] = set()
    later_held = threading.Event()  # the worker holds a call of later chunks
    late_firsts_in = threading.Event()  # ... until the late streams' first chunks wait too
    synthesize, launch_chunks = Token2WavWorker.synthesize, TorchToken2Wav.launch_chunks

    async def recording_synthesize(self: Token2WavWorker, stream: Token2WavStream, tokens: Sequence[int],
                                   last: bool, due: float) -> np.ndarray:
        submitted.append(Submitted(time.perf_counter(), stream, due == -math.inf))
        if sum(s.first for s in submitted) == EARLY + LATE:
            late_firsts_in.set()
        return await synthesize(self, stream, tokens, last, due)

    def recording_launch_chunks(self: TorchToken2Wav, jobs: Sequence[ChunkJob]) -> LaunchedChunks:
        chunks = tuple((job.stream, job.stream not in seen) for job in jobs)
        seen.update(job.stream for job in jobs)
        calls.append(Call(time.perf_counter(), chunks))
        if not later_held.is_set() and not any(first for _, first in chunks):
            later_held.set()  # the first call of later chunks: keep the worker busy with it
            assert late_firsts_in.wait(timeout=60)
        return launch_chunks(self, jobs)

    monkeypatch.setattr(Token2WavWorker, "synthesize", recording_synthesize)
    monkeypatch.setattr(TorchToken2Wav, "launch_chunks", recording_launch_chunks)
    # The late streams' LLM requests wait for the early ones' slots, which free once those decoded every
    # token (no pacing): the late streams are open, their first chunks come while the worker is held.
    # Three rows a call: the held call leaves an early stream's later chunk waiting beside four first
    # chunks, so earliest-deadline-first alone would put it in a call with the fourth.
    # Later chunks never outrank first chunks here (no urgency): this is rule 1 alone.
    config = ServiceConfig(models_dir=tiny_models, voices_dir=tmp_path, device="cpu",
                           max_streams=EARLY + LATE, llm_slots=EARLY, llm_pacing=False, token2wav_batch=3,
                           urgent_chunk_calls=0)
    runtime = Runtime(config)
    await runtime.start()
    try:
        early = [asyncio.create_task(speak_samples(runtime, seed, TOKENS)) for seed in range(EARLY)]
        await eventually(lambda: len(submitted) >= EARLY)
        late = [asyncio.create_task(speak_samples(runtime, seed, TOKENS))
                for seed in range(EARLY, EARLY + LATE)]
        lengths = await asyncio.gather(*early, *late)
    finally:
        await runtime.stop(config.drain_timeout_s)
    assert lengths == [TOKENS * SAMPLES_PER_TOKEN] * (EARLY + LATE)

    # No call mixes first chunks with later ones.
    assert all(len({first for _, first in call.chunks}) == 1 for call in calls)
    # Every first chunk submitted before a call of later chunks started ran in an earlier call.
    first_call = {stream: index for index, call in enumerate(calls) for stream, first in call.chunks if first}
    for index, call in enumerate(calls):
        if not call.chunks[0][1]:
            waiting = [s.stream for s in submitted if s.first and s.at < call.started]
            assert all(first_call[stream] < index for stream in waiting)
    # And it mattered: later chunks waited beside the late streams' first chunks, which ran first.
    held = next(index for index, call in enumerate(calls) if not call.chunks[0][1])
    late_first_calls = [i for i, call in enumerate(calls) if i > held and call.chunks[0][1]]
    assert len(late_first_calls) >= LATE // config.token2wav_batch
    assert late_first_calls == list(range(held + 1, held + 1 + len(late_first_calls)))


async def test_a_call_takes_no_more_speech_tokens_than_its_cap(
    tiny_models: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The service's token cap reaches the worker: with room for 8 chunks a call, calls that batch several
    chunks carry at most the cap's tokens; a chunk longer than the cap runs alone."""
    cap = 60  # two chunks of 18 or 28 tokens, never three
    calls: list[list[int]] = []
    launch_chunks = TorchToken2Wav.launch_chunks

    def recording_launch_chunks(self: TorchToken2Wav, jobs: Sequence[ChunkJob]) -> LaunchedChunks:
        calls.append([job.tokens.numel() for job in jobs])
        return launch_chunks(self, jobs)

    monkeypatch.setattr(TorchToken2Wav, "launch_chunks", recording_launch_chunks)
    config = ServiceConfig(models_dir=tiny_models, voices_dir=tmp_path, device="cpu", max_streams=6,
                           llm_pacing=False, token2wav_batch=8, token2wav_call_tokens=cap)
    runtime = Runtime(config)
    await runtime.start()
    try:
        lengths = await asyncio.gather(*(speak_samples(runtime, seed, TOKENS) for seed in range(6)))
    finally:
        await runtime.stop(config.drain_timeout_s)
    assert lengths == [TOKENS * SAMPLES_PER_TOKEN] * 6
    assert all(len(call) == 1 or sum(call) <= cap for call in calls)
    assert any(len(call) > 1 for call in calls)
