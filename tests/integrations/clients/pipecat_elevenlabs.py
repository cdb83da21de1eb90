"""Pipecat's ElevenLabsTTSService (multi-context websocket) and ElevenLabsHttpTTSService against the
server, driven the way Pipecat's own tests drive a service: a pipeline of [recorder, service, sink] in a
PipelineWorker, fed an LLM turn token by token; the pipeline's output sample rate picks the format.

Only the URL changes: `url="ws://HOST:PORT"` for the websocket service, `base_url="http://HOST:PORT"`
for the HTTP one. `stop_frame_timeout_s` (Pipecat's wait for a context's next audio, 3 s by default,
after which it drops the context) is raised: the tiny CPU models on a shared test machine may take
longer than that to a first chunk; a GPU server answers in well under a second.
"""

from __future__ import annotations

import argparse
import asyncio

import aiohttp
from common import llm_tokens, report
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
from pipecat.services.elevenlabs.tts import ElevenLabsHttpTTSService, ElevenLabsTTSService
from pipecat.services.tts_service import TextAggregationMode
from pipecat.workers.runner import WorkerRunner

STOP_FRAME_TIMEOUT_S = 15.0


class Recorder(FrameProcessor):
    """Passes every frame on and keeps what it sees in one direction."""

    def __init__(self, direction: FrameDirection) -> None:
        super().__init__()
        self.direction = direction
        self.frames: list[Frame] = []
        self.audio = asyncio.Event()
        self.stopped = asyncio.Event()

    async def process_frame(self, frame: Frame, direction: FrameDirection) -> None:
        await super().process_frame(frame, direction)
        if direction == self.direction:
            self.frames.append(frame)
            if isinstance(frame, TTSAudioRawFrame):
                self.audio.set()
            elif isinstance(frame, TTSStoppedFrame):
                self.stopped.set()
        await self.push_frame(frame, direction)


async def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--http-url", required=True)
    parser.add_argument("--mode", choices=("websocket", "http"), default="websocket")
    parser.add_argument("--sample-rate", type=int, default=16000)
    parser.add_argument("--interrupt", action="store_true")
    parser.add_argument("--voice", default="default")
    parser.add_argument("--tokens", action="store_true", help="TextAggregationMode.TOKEN (no auto_mode)")
    parser.add_argument("--api-key", default="unused", help="the key the client is configured with")
    args = parser.parse_args()
    async with aiohttp.ClientSession() as session:
        if args.mode == "websocket":
            tts: FrameProcessor = ElevenLabsTTSService(
                api_key=args.api_key,
                url=args.http_url.replace("http://", "ws://"),
                settings=ElevenLabsTTSService.Settings(voice=args.voice),
                stop_frame_timeout_s=STOP_FRAME_TIMEOUT_S,
                text_aggregation_mode=TextAggregationMode.TOKEN if args.tokens else None,
            )
        else:
            tts = ElevenLabsHttpTTSService(
                api_key=args.api_key,
                aiohttp_session=session,
                base_url=args.http_url,
                settings=ElevenLabsHttpTTSService.Settings(voice=args.voice),
                stop_frame_timeout_s=STOP_FRAME_TIMEOUT_S,
            )
        upstream, downstream = Recorder(FrameDirection.UPSTREAM), Recorder(FrameDirection.DOWNSTREAM)
        worker = PipelineWorker(
            Pipeline([upstream, tts, downstream]),
            cancel_on_idle_timeout=False,
            params=PipelineParams(audio_out_sample_rate=args.sample_rate),
        )
        started = asyncio.Event()

        @worker.event_handler("on_pipeline_started")
        async def on_started(worker: PipelineWorker, frame: Frame) -> None:
            started.set()

        async def drive() -> None:
            await asyncio.wait_for(started.wait(), 30)
            await worker.queue_frame(LLMFullResponseStartFrame())
            for token in llm_tokens():
                await worker.queue_frame(LLMTextFrame(token))
                await asyncio.sleep(0.02)  # an LLM's token rate
            await worker.queue_frame(LLMFullResponseEndFrame())
            if args.interrupt:
                await asyncio.wait_for(downstream.audio.wait(), 120)
                await worker.queue_frame(InterruptionFrame())
                await asyncio.sleep(1.0)
            else:
                await asyncio.wait_for(downstream.stopped.wait(), 200)
            await worker.queue_frame(EndFrame())

        runner = WorkerRunner()
        await runner.add_workers(worker)
        await asyncio.gather(runner.run(), drive())
    audio = [f for f in downstream.frames if isinstance(f, TTSAudioRawFrame)]
    report(
        audio_bytes=sum(len(f.audio) for f in audio),
        sample_rates=sorted({f.sample_rate for f in audio}),
        words=[f.text for f in downstream.frames if isinstance(f, TTSTextFrame)],
        errors=[str(f.error) for f in upstream.frames + downstream.frames if isinstance(f, ErrorFrame)],
    )


if __name__ == "__main__":
    asyncio.run(main())
