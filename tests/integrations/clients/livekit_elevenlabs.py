"""LiveKit's elevenlabs.TTS against the server: `stream()` over the multi-context websocket (text pushed
token by token as an agent's LLM does, the plugin's default format mp3_22050_32 decoded by LiveKit,
word timings from its aligned transcript, an interruption by closing the stream) and `synthesize()`
over HTTP. Only `base_url="http://HOST:PORT/v1"` changes.
"""

from __future__ import annotations

import argparse
import asyncio

import aiohttp
from common import llm_tokens, report
from livekit.agents.types import USERDATA_TIMED_TRANSCRIPT
from livekit.plugins import elevenlabs


async def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--http-url", required=True)
    parser.add_argument("--mode", choices=("stream", "synthesize"), default="stream")
    parser.add_argument("--encoding", default=None, help="the plugin's default when left out")
    parser.add_argument("--interrupt", action="store_true")
    parser.add_argument("--voice", default="default")
    args = parser.parse_args()
    options = {"encoding": args.encoding} if args.encoding else {}
    frames = []
    words: list[str] = []
    async with aiohttp.ClientSession() as session:
        tts = elevenlabs.TTS(
            api_key="unused",
            base_url=f"{args.http_url}/v1",
            voice_id=args.voice,
            http_session=session,
            **options,
        )
        if args.mode == "synthesize":
            async for event in tts.synthesize("Hello there. How are you today?"):
                frames.append(event.frame)
        else:
            stream = tts.stream()

            async def push() -> None:
                for token in llm_tokens():
                    stream.push_text(token)
                    await asyncio.sleep(0.02)  # an LLM's token rate
                if not args.interrupt:
                    stream.end_input()

            pusher = asyncio.create_task(push())
            async for event in stream:
                frames.append(event.frame)
                words.extend(str(w) for w in event.frame.userdata.get(USERDATA_TIMED_TRANSCRIPT, []))
                if args.interrupt and sum(f.samples_per_channel for f in frames) >= tts.sample_rate // 5:
                    break  # barge-in 0.2 s into the audio
            await pusher
            await stream.aclose()
        await tts.aclose()
    report(
        samples=sum(f.samples_per_channel for f in frames),
        sample_rates=sorted({f.sample_rate for f in frames}),
        words=words,
    )


if __name__ == "__main__":
    asyncio.run(main())
