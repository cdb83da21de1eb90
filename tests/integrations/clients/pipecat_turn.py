"""What the Pipecat client scripts share: a pipeline of [recorder, service, recorder] in a PipelineWorker,
fed one LLM turn token by token between LLMFullResponseStart/End frames, and the result it reports.

Runs in the pipecat client environment; the scripts import it from their own directory, as they do
`common`. The timings stay each script's own (arguments of `speak_turn`).
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import Any

from common import llm_tokens
from pipecat.frames.frames import (
    EndFrame,
    ErrorFrame,
    Frame,
    InterruptionFrame,
    LLMFullResponseEndFrame,
    LLMFullResponseStartFrame,
    LLMTextFrame,
    TTSAudioRawFrame,
    TTSStoppedFrame,
    TTSTextFrame,
)
from pipecat.pipeline.pipeline import Pipeline
from pipecat.pipeline.worker import PipelineParams, PipelineWorker
from pipecat.processors.frame_processor import FrameDirection, FrameProcessor
from pipecat.workers.runner import WorkerRunner


class Recorder(FrameProcessor):
    """Passes every frame on and keeps what it sees in one direction: `audio` and `first_audio_at` are set
    at the first TTSAudioRawFrame, `stopped` at the first TTSStoppedFrame (or ErrorFrame, with
    `stop_on_error`)."""

    def __init__(self, direction: FrameDirection, stop_on_error: bool = False) -> None:
        super().__init__()
        self.direction = direction
        self.stop_on_error = stop_on_error
        self.frames: list[Frame] = []
        self.stopped = asyncio.Event()
        self.audio = asyncio.Event()
        self.first_audio_at: float | None = None

    async def process_frame(self, frame: Frame, direction: FrameDirection) -> None:
        await super().process_frame(frame, direction)
        if direction == self.direction:
            self.frames.append(frame)
            if isinstance(frame, TTSAudioRawFrame) and self.first_audio_at is None:
                self.first_audio_at = time.monotonic()
                self.audio.set()
            if isinstance(frame, TTSStoppedFrame) or (self.stop_on_error and isinstance(frame, ErrorFrame)):
                self.stopped.set()
        await self.push_frame(frame, direction)


@dataclass
class Turn:
    """What one turn through the pipeline left: both recorders and when each token was queued."""

    upstream: Recorder
    downstream: Recorder
    queued_at: list[tuple[str, float]] = field(default_factory=list)

    def result(self) -> dict[str, Any]:
        """The fields every Pipecat script reports: audio, its sample rates, word frames and errors."""
        audio = [f for f in self.downstream.frames if isinstance(f, TTSAudioRawFrame)]
        frames = self.upstream.frames + self.downstream.frames
        return {
            "audio_bytes": sum(len(f.audio) for f in audio),
            "sample_rates": sorted({f.sample_rate for f in audio}),
            "words": [f.text for f in self.downstream.frames if isinstance(f, TTSTextFrame)],
            "errors": [str(f.error) for f in frames if isinstance(f, ErrorFrame)],
        }


async def speak_turn(
    tts: FrameProcessor,
    *,
    sample_rate: int,
    interrupt: bool,
    token_gap_s: float,
    audio_timeout_s: float,
    stopped_timeout_s: float,
    after_interrupt_s: float,
    after_stopped_s: float = 0.0,
    stop_on_error: bool = False,
) -> Turn:
    """Runs `tts` in a pipeline at `sample_rate` for one LLM turn (a token every `token_gap_s`), then ends
    it: with `interrupt`, an InterruptionFrame at the first audio and `after_interrupt_s` later an
    EndFrame; otherwise the EndFrame `after_stopped_s` after the service's TTSStoppedFrame."""
    turn = Turn(
        Recorder(FrameDirection.UPSTREAM, stop_on_error), Recorder(FrameDirection.DOWNSTREAM, stop_on_error)
    )
    worker = PipelineWorker(
        Pipeline([turn.upstream, tts, turn.downstream]),
        params=PipelineParams(audio_out_sample_rate=sample_rate),
        cancel_on_idle_timeout=False,
    )
    started = asyncio.Event()

    @worker.event_handler("on_pipeline_started")
    async def on_started(worker: PipelineWorker, frame: Frame) -> None:
        started.set()

    async def drive() -> None:
        await asyncio.wait_for(started.wait(), 30)
        await worker.queue_frame(LLMFullResponseStartFrame())
        for token in llm_tokens():
            await worker.queue_frame(LLMTextFrame(text=token))
            turn.queued_at.append((token, time.monotonic()))
            await asyncio.sleep(token_gap_s)  # an LLM's token rate
        await worker.queue_frame(LLMFullResponseEndFrame())
        if interrupt:
            await asyncio.wait_for(turn.downstream.audio.wait(), audio_timeout_s)
            await worker.queue_frame(InterruptionFrame())
            await asyncio.sleep(after_interrupt_s)
        else:
            await asyncio.wait_for(turn.downstream.stopped.wait(), stopped_timeout_s)
            if after_stopped_s:
                await asyncio.sleep(after_stopped_s)  # let the last frames of the turn through
        await worker.queue_frame(EndFrame())

    runner = WorkerRunner()
    await runner.add_workers(worker)
    await asyncio.gather(runner.run(), drive())
    return turn
