"""LiveKit Agents' TTS plugins against the server, driven as the agents framework drives them (and as
LiveKit's own TTS tests do): `stream()` fed an LLM's tokens with `push_text`, then `end_input`; or
`synthesize(text)`; the audio frames (with their timed transcripts) are collected as they come.

Modes: `cartesia-stream` (cartesia.TTS.stream(), websocket, word timestamps), `cartesia-synthesize`
(cartesia.TTS.synthesize(), POST /tts/bytes), `openai` (openai.TTS with its defaults: gpt-4o-mini-tts,
voice "ash", mp3 over SSE).
"""

from __future__ import annotations

import asyncio

import aiohttp
from common import TURN, llm_tokens, parse_args, report
from livekit.agents import tts as agents_tts
from livekit.agents.types import USERDATA_TIMED_TRANSCRIPT


def collect(audio: agents_tts.SynthesizedAudio, summary: dict[str, object]) -> None:
    frame = audio.frame
    summary["audio_bytes"] = int(summary["audio_bytes"]) + len(frame.data.tobytes())  # type: ignore[call-overload]
    summary["sample_rates"] = sorted({*summary["sample_rates"], frame.sample_rate})  # type: ignore[misc]
    for timed in frame.userdata.get(USERDATA_TIMED_TRANSCRIPT, []):
        summary["words"].append(str(timed))  # type: ignore[attr-defined]


async def run_stream(tts: agents_tts.TTS, interrupt: bool, summary: dict[str, object]) -> None:
    stream = tts.stream()

    async def push() -> None:
        for token in llm_tokens():
            stream.push_text(token)
            await asyncio.sleep(0.03)  # an LLM's token rate
        stream.end_input()

    pushing = asyncio.create_task(push())
    try:
        async for audio in stream:
            collect(audio, summary)
            if interrupt:  # barge in at the first audio: the agent closes the stream
                break
    finally:
        pushing.cancel()
        await stream.aclose()


async def main() -> None:
    args = parse_args("cartesia-stream", "cartesia-synthesize", "openai")
    rate = args.sample_rate or 24000
    summary: dict[str, object] = {"audio_bytes": 0, "sample_rates": [], "words": [], "errors": []}
    async with aiohttp.ClientSession() as session:
        if args.mode.startswith("cartesia"):
            from livekit.plugins import cartesia

            tts: agents_tts.TTS = cartesia.TTS(
                api_key=args.api_key,
                base_url=f"{args.http_url}/cartesia",
                voice=args.voice,
                sample_rate=rate,
                http_session=session,
            )
        else:
            import openai as openai_sdk
            from livekit.plugins import openai

            client = openai_sdk.AsyncClient(api_key=args.api_key, base_url=f"{args.http_url}/v1")
            tts = openai.TTS(client=client)

        @tts.on("error")
        def on_error(error: object) -> None:
            summary["errors"].append(repr(error))  # type: ignore[attr-defined]

        try:
            if args.mode == "cartesia-stream":
                await run_stream(tts, args.interrupt, summary)
            else:
                async with tts.synthesize(TURN) as stream:
                    async for audio in stream:
                        collect(audio, summary)
        finally:
            await tts.aclose()
    report(**summary)


if __name__ == "__main__":
    asyncio.run(main())
