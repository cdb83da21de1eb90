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
from common import report
from pipecat.processors.frame_processor import FrameProcessor
from pipecat.services.elevenlabs.tts import ElevenLabsHttpTTSService, ElevenLabsTTSService
from pipecat.services.tts_service import TextAggregationMode
from pipecat_turn import speak_turn

STOP_FRAME_TIMEOUT_S = 15.0


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
        turn = await speak_turn(
            tts,
            sample_rate=args.sample_rate,
            interrupt=args.interrupt,
            token_gap_s=0.02,
            audio_timeout_s=120,
            stopped_timeout_s=200,
            after_interrupt_s=1.0,
        )
    report(**turn.result())


if __name__ == "__main__":
    asyncio.run(main())
