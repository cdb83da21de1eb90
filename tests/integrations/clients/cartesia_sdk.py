"""Cartesia's Python SDK against the server: websocket (token-paced, timestamps, cancel, manual flushes
with their flush ids), bytes and SSE.

The SDK is pointed at the server the way a user would: `base_url` for HTTP and `websocket_base_url` for
the websocket (it appends `/tts/bytes`, `/tts/sse` and `/tts/websocket`).
"""

from __future__ import annotations

import asyncio
from typing import Any

from cartesia import AsyncCartesia
from common import llm_tokens, parse_args, report

MODEL = "sonic-3"


def timed_context(connection: Any, voice: str, rate: int) -> Any:
    """A context on the websocket `connection`: raw 16-bit PCM at `rate` with word timestamps."""
    return connection.context(
        model_id=MODEL,
        voice={"mode": "id", "id": voice},
        output_format={"container": "raw", "encoding": "pcm_s16le", "sample_rate": rate},
        add_timestamps=True,
    )


async def websocket(client: AsyncCartesia, voice: str, rate: int, interrupt: bool) -> None:
    audio = bytearray()
    words: list[str] = []
    starts: list[float] = []
    types: list[str] = []
    async with client.tts.websocket_connect() as connection:
        context = timed_context(connection, voice, rate)
        for token in llm_tokens():
            await context.push(token)
            await asyncio.sleep(0.02)  # an LLM's token rate
        if not interrupt:
            await context.no_more_inputs()
        async for response in context.receive():
            types.append(response.type)
            if response.type == "chunk" and response.audio:
                audio.extend(response.audio)
                if interrupt and len(audio) >= rate // 5:  # 0.1 s in: barge in
                    await context.cancel()
                    break
            elif response.type == "timestamps" and response.word_timestamps is not None:
                words.extend(response.word_timestamps.words)
                starts.extend(response.word_timestamps.start)
            elif response.type == "error":
                report(error=response.error)
                return
    report(audio_bytes=len(audio), words=words, starts=starts, types=sorted(set(types)))


async def flushes(client: AsyncCartesia, voice: str, rate: int) -> None:
    """Two transcripts each followed by a manual flush (`push("", flush=True)`), as Cartesia's flushing
    example does: the events in order, as `chunk:<flush_id>`, `timestamps:<flush_id>`,
    `flush_done:<flush_id>` and `done`, and the words of each flush id."""
    events: list[str] = []
    words: dict[int, list[str]] = {}
    async with client.tts.websocket_connect() as connection:
        context = timed_context(connection, voice, rate)
        for transcript in ("Hello there, it is sunny today.", " Shall we walk to the park?"):
            await context.push(transcript)
            await context.push("", flush=True)
        await context.no_more_inputs()
        async for response in context.receive():
            if response.type == "error":
                report(error=response.error)
                return
            if response.type == "done":
                events.append("done")
            elif response.type == "flush_done":
                assert response.flush_done is True
                events.append(f"flush_done:{response.flush_id}")
            else:
                events.append(f"{response.type}:{response.flush_id}")
                if response.type == "timestamps" and response.word_timestamps is not None:
                    words.setdefault(response.flush_id or 0, []).extend(response.word_timestamps.words)
    report(events=events, words=words)


async def bytes_(client: AsyncCartesia, voice: str, rate: int) -> None:
    response = await client.tts.generate(
        model_id=MODEL,
        transcript="Hello there. How are you today?",
        voice={"mode": "id", "id": voice},
        output_format={"container": "wav", "encoding": "pcm_s16le", "sample_rate": rate},
    )
    body = await response.read()
    content_type = response.headers.get("content-type")
    report(audio_bytes=len(body), head=body[:4].decode("latin-1"), content_type=content_type)


async def sse(client: AsyncCartesia, voice: str, rate: int) -> None:
    audio = bytearray()
    words: list[str] = []
    types: list[str] = []
    stream = await client.tts.generate_sse(
        model_id=MODEL,
        transcript="Hello there. How are you today?",
        voice={"mode": "id", "id": voice},
        output_format={"container": "raw", "encoding": "pcm_f32le", "sample_rate": rate},
        add_timestamps=True,
    )
    async for event in stream:
        types.append(event.type)
        if event.type == "chunk" and event.audio:
            audio.extend(event.audio)
        elif event.type == "timestamps":
            words.extend(event.word_timestamps.words)
        elif event.type == "error":
            report(error=event.error)
            return
    report(audio_bytes=len(audio), words=words, types=sorted(set(types)))


async def main() -> None:
    args = parse_args("websocket", "flush", "bytes", "sse")
    rate = args.sample_rate or 24000
    base = f"{args.http_url}/cartesia"
    client = AsyncCartesia(
        api_key=args.api_key, base_url=base, websocket_base_url=base.replace("http", "ws", 1)
    )
    if args.mode == "websocket":
        await websocket(client, args.voice, rate, args.interrupt)
    elif args.mode == "flush":
        await flushes(client, args.voice, rate)
    elif args.mode == "bytes":
        await bytes_(client, args.voice, rate)
    else:
        await sse(client, args.voice, rate)
    await client.close()


if __name__ == "__main__":
    asyncio.run(main())
