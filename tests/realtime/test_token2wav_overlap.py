"""A token2wav thread with chunks waiting queues its next call before it waits for the audio of the call
in flight (`overlap`), on the real tiny engines (CPU): the order of launches and waits, the same audio
as one call at a time, and a call whose audio fails failing only its own chunks."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import pytest
import torch

from engines.config import ModelPaths
from engines.token2wav.base import ChunkJob, LaunchedChunks, Token2WavStream
from engines.token2wav.torch_backend import TorchToken2Wav
from engines.voice import VoicePrompt
from realtime.token2wav_worker import Token2WavWorker

DUES = [3.0, 1.0, 2.0]  # stream i's chunk is due at DUES[i]: run as 1, 2, 0


class _Recorded:
    """A launched call that notes when the worker waits for it, and can fail instead of answering."""

    def __init__(self, launched: LaunchedChunks, index: int, events: list[tuple[str, int]],
                 fail: bool) -> None:
        self._launched, self._index, self._events, self._fail = launched, index, events, fail

    def wait(self) -> list[torch.Tensor]:
        self._events.append(("wait", self._index))
        audio = self._launched.wait()
        if self._fail:
            raise RuntimeError("the device lost this call")
        return audio


async def _run_three_chunks(models: Path, overlap: bool, failing: int | None = None,
                            ) -> tuple[list[tuple[str, int]], list[np.ndarray | BaseException], bool]:
    """One chunk of three streams, queued while the thread is busy, one chunk per call; returns the
    launches and waits (by stream), each chunk's audio or error, and whether the worker is alive."""
    backend = TorchToken2Wav.from_models_dir(models, "dit", "cpu")
    backend.vocoder_seed = 0  # every stream draws the same vocoder noise: runs compare sample for sample
    voice = VoicePrompt.load(ModelPaths(models).voices / "default.safetensors")
    worker = Token2WavWorker(backend, max_batch=1, capacity=8, overlap=overlap)
    events: list[tuple[str, int]] = []
    streams: list[Token2WavStream] = []
    launch = backend.launch_chunks

    def recording(jobs: Sequence[ChunkJob]) -> LaunchedChunks:
        index = streams.index(jobs[0].stream)
        events.append(("launch", index))
        return _Recorded(launch(jobs), index, events, fail=index == failing)

    backend.launch_chunks = recording  # type: ignore[method-assign]
    worker.start()
    try:
        speaker = await worker.prepare_speaker(voice)
        streams.extend([await worker.open_stream(speaker) for _ in DUES])
        gate = threading.Event()
        blocked = asyncio.ensure_future(worker.call(gate.wait))
        tokens = list(range(18))
        chunks = [asyncio.ensure_future(worker.synthesize(stream, tokens, last=False, due=due))
                  for stream, due in zip(streams, DUES, strict=True)]
        await asyncio.sleep(0.2)  # every chunk waits behind the blocking call
        gate.set()
        await blocked
        results = await asyncio.gather(*chunks, return_exceptions=True)
        alive = worker.alive
    finally:
        await asyncio.to_thread(worker.stop)
    return events, list(results), alive


async def test_with_chunks_waiting_the_next_call_is_queued_before_the_last_one_is_waited_for(
    tiny_models: Path,
) -> None:
    events, overlapped, _ = await _run_three_chunks(tiny_models, overlap=True)
    assert events == [("launch", 1), ("launch", 2), ("wait", 1), ("launch", 0), ("wait", 2), ("wait", 0)]
    serial_events, serial, _ = await _run_three_chunks(tiny_models, overlap=False)
    assert serial_events == [("launch", 1), ("wait", 1), ("launch", 2), ("wait", 2), ("launch", 0),
                             ("wait", 0)]
    for audio, alone in zip(overlapped, serial, strict=True):
        assert isinstance(audio, np.ndarray) and isinstance(alone, np.ndarray)
        assert audio.size > 0
        np.testing.assert_array_equal(audio, alone)


@pytest.mark.parametrize("overlap", [True, False])
async def test_a_call_whose_audio_fails_fails_its_own_chunks_only(tiny_models: Path, overlap: bool) -> None:
    events, results, alive = await _run_three_chunks(tiny_models, overlap=overlap, failing=2)
    assert [index for event, index in events if event == "launch"] == [1, 2, 0]
    assert isinstance(results[2], RuntimeError) and "lost this call" in str(results[2])
    assert isinstance(results[0], np.ndarray) and isinstance(results[1], np.ndarray)
    assert results[0].size > 0 and results[1].size > 0
    assert alive
