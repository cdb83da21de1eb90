"""Pipecat's TTS services against the server, in a pipeline as an agent runs them: an LLM turn's text
frames arrive token by token between LLMFullResponseStart/End frames, the pipeline asks for its output
sample rate, and what comes out (audio, word-timed text, errors) is collected at both ends.

Modes: `cartesia` (CartesiaTTSService, websocket, its default sentence aggregation), `cartesia-http`
(CartesiaHttpTTSService, POST /tts/bytes), `openai` (OpenAITTSService with its defaults).
"""

from __future__ import annotations

import asyncio
import time

from common import llm_tokens, parse_args, report
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


class Collector(FrameProcessor):
    """Records the frames passing one way; `stopped` is set at the first TTSStoppedFrame."""

    def __init__(self, direction: FrameDirection) -> None:
        super().__init__()
        self.direction = direction
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
            if isinstance(frame, TTSStoppedFrame | ErrorFrame):
                self.stopped.set()
        await self.push_frame(frame, direction)


# Pipecat ends a turn that stays silent for 3 s; the tiny model on a busy 2-core CI machine can take that
# long to start, so the tests allow more (an agent would tune it the same way for a slow provider).
STOP_FRAME_TIMEOUT_S = 30.0


def make_service(mode: str, http_url: str, voice: str, api_key: str) -> FrameProcessor:
    if mode == "cartesia":
        from pipecat.services.cartesia.tts import CartesiaTTSService

        return CartesiaTTSService(
            api_key=api_key,
            url=f"{http_url.replace('http', 'ws', 1)}/cartesia/tts/websocket",
            settings=CartesiaTTSService.Settings(voice=voice),
            stop_frame_timeout_s=STOP_FRAME_TIMEOUT_S,
        )
    if mode == "cartesia-http":
        from pipecat.services.cartesia.tts import CartesiaHttpTTSService

        return CartesiaHttpTTSService(
            api_key=api_key,
            base_url=f"{http_url}/cartesia",
            settings=CartesiaHttpTTSService.Settings(voice=voice),
            stop_frame_timeout_s=STOP_FRAME_TIMEOUT_S,
        )
    from pipecat.services.openai.tts import OpenAITTSService

    return OpenAITTSService(
        api_key=api_key, base_url=f"{http_url}/v1", stop_frame_timeout_s=STOP_FRAME_TIMEOUT_S
    )


async def main() -> None:
    args = parse_args("cartesia", "cartesia-http", "openai")
    rate = args.sample_rate or 24000
    tts = make_service(args.mode, args.http_url, args.voice, args.api_key)
    upstream, downstream = Collector(FrameDirection.UPSTREAM), Collector(FrameDirection.DOWNSTREAM)
    worker = PipelineWorker(
        Pipeline([upstream, tts, downstream]),
        params=PipelineParams(audio_out_sample_rate=rate),
        cancel_on_idle_timeout=False,
    )
    started = asyncio.Event()

    @worker.event_handler("on_pipeline_started")
    async def on_started(worker: PipelineWorker, frame: Frame) -> None:
        started.set()

    last_sentence_token_at = 0.0

    async def drive() -> None:
        nonlocal last_sentence_token_at
        await asyncio.wait_for(started.wait(), 30)
        await worker.queue_frame(LLMFullResponseStartFrame())
        for token in llm_tokens():
            await worker.queue_frame(LLMTextFrame(text=token))
            if token.endswith("today.") and not last_sentence_token_at:
                last_sentence_token_at = time.monotonic()
            await asyncio.sleep(0.03)  # an LLM's token rate
        await worker.queue_frame(LLMFullResponseEndFrame())
        if args.interrupt:
            await asyncio.wait_for(downstream.audio.wait(), 180)
            await worker.queue_frame(InterruptionFrame())
            await asyncio.sleep(0.5)
        else:
            await asyncio.wait_for(downstream.stopped.wait(), 180)
            await asyncio.sleep(0.3)  # let the last frames of the turn through
        await worker.queue_frame(EndFrame())

    runner = WorkerRunner()
    await runner.add_workers(worker)
    await asyncio.gather(runner.run(), drive())

    audio = [f for f in downstream.frames if isinstance(f, TTSAudioRawFrame)]
    errors = [str(f.error) for f in upstream.frames + downstream.frames if isinstance(f, ErrorFrame)]
    report(
        audio_bytes=sum(len(f.audio) for f in audio),
        sample_rates=sorted({f.sample_rate for f in audio}),
        words=[f.text for f in downstream.frames if isinstance(f, TTSTextFrame)],
        errors=errors,
        first_audio_after_first_sentence_s=(
            downstream.first_audio_at - last_sentence_token_at if downstream.first_audio_at else None
        ),
    )


if __name__ == "__main__":
    asyncio.run(main())
