"""The Cartesia and ElevenLabs websocket dialects end to end against the live tiny server.

These clients cannot ask for a fixed length, so the (random) model decides how long each text is;
the tests check framing, ordering and completeness rather than exact durations.
"""

from __future__ import annotations

import asyncio
import base64
import json

import pytest
from websockets.asyncio.client import ClientConnection, connect

pytestmark = pytest.mark.asyncio(loop_scope="session")


async def messages_until(ws: ClientConnection, done) -> list[dict]:
    received = []
    async with asyncio.timeout(90):
        while True:
            message = json.loads(await ws.recv())
            received.append(message)
            if done(message):
                return received


async def test_cartesia_continuations_stream_audio_timestamps_and_done(live_server):
    url = f"{live_server.ws_url}/cartesia/tts/websocket?api_key=unused&cartesia_version=2024-11-13"
    base = {
        "context_id": "turn-1",
        "model_id": "sonic-2",
        "language": "en",
        "add_timestamps": True,
        "voice": {"mode": "id", "id": "default"},
        "output_format": {"container": "raw", "encoding": "pcm_s16le", "sample_rate": 16000},
    }
    async with connect(url) as ws:
        for piece in ("Hi there. ", "Good day."):
            await ws.send(json.dumps({**base, "transcript": piece, "continue": True}))
        await ws.send(json.dumps({**base, "transcript": "", "continue": False}))
        received = await messages_until(ws, lambda m: m["type"] in ("done", "error"))
    assert received[-1] == {"type": "done", "done": True, "status_code": 206, "context_id": "turn-1"}
    chunks = [m for m in received if m["type"] == "chunk"]
    audio = b"".join(base64.b64decode(m["data"]) for m in chunks)
    assert chunks and len(audio) % 2 == 0 and len(audio) > 0
    words = [w for m in received if m["type"] == "timestamps" for w in m["word_timestamps"]["words"]]
    assert words == ["Hi", "there.", "Good", "day."]


async def test_cartesia_cancel_silences_the_context(live_server, eventually):
    url = f"{live_server.ws_url}/cartesia/tts/websocket"
    async with connect(url) as ws:
        await ws.send(
            json.dumps(
                {
                    "context_id": "c",
                    "transcript": "Talking for a while now. ",
                    "continue": True,
                    "voice": {"mode": "id", "id": "default"},
                    "flush": True,
                }
            )
        )
        first = json.loads(await ws.recv())
        assert first["type"] == "chunk"
        await ws.send(json.dumps({"context_id": "c", "cancel": True}))
        await ws.send(
            json.dumps({"context_id": "other", "transcript": "Hello.", "voice": {"mode": "id", "id": "x"}})
        )
        # Chunks already in flight may still arrive; then the next thing is the error about "other".
        received = await messages_until(ws, lambda m: m["type"] == "error")
    assert all(m["type"] == "chunk" and m["context_id"] == "c" for m in received[:-1])
    assert received[-1]["context_id"] == "other" and received[-1]["error_code"] == "voice_not_found"
    await eventually(lambda: live_server.runtime.stats().active_streams == 0)


async def test_elevenlabs_stream_input_speaks_then_reports_final(live_server):
    url = (
        f"{live_server.ws_url}/v1/text-to-speech/default/stream-input"
        "?model_id=eleven_flash_v2_5&output_format=pcm_22050"
    )
    async with connect(url) as ws:
        await ws.send(json.dumps({"text": " ", "voice_settings": {"stability": 0.5}, "xi_api_key": "unused"}))
        await ws.send(json.dumps({"text": "Hello world. "}))
        await ws.send(json.dumps({"text": "Bye now.", "flush": True}))
        await ws.send(json.dumps({"text": ""}))
        received = await messages_until(ws, lambda m: m.get("isFinal") is True or "error" in m)
        # The end of input ends the socket too, right after the final message (ElevenLabs does).
        async with asyncio.timeout(10):
            await ws.wait_closed()
    assert ws.close_code == 1000
    assert received[-1] == {"audio": None, "isFinal": True}
    audio_messages = received[:-1]
    assert audio_messages and all("isFinal" not in m for m in audio_messages)
    assert sum(len(base64.b64decode(m["audio"])) for m in audio_messages) % 2 == 0
    chars = "".join(c for m in audio_messages if m["alignment"] for c in m["alignment"]["chars"])
    assert chars == "Hello world. Bye now."


async def test_elevenlabs_multi_context_closes_one_context_and_the_socket(live_server):
    url = f"{live_server.ws_url}/v1/text-to-speech/default/multi-stream-input?output_format=ulaw_8000"
    async with connect(url) as ws:
        await ws.send(json.dumps({"text": " ", "context_id": "a"}))
        await ws.send(json.dumps({"text": "Context a speaks.", "context_id": "a", "flush": True}))
        first = json.loads(await ws.recv())
        assert first["contextId"] == "a" and first["audio"]
        await ws.send(json.dumps({"context_id": "a", "close_context": True}))
        received = await messages_until(ws, lambda m: m.get("isFinal") is True)
        assert received[-1] == {"audio": None, "isFinal": True, "contextId": "a"}
        await ws.send(json.dumps({"close_socket": True}))
        async with asyncio.timeout(10):
            await ws.wait_closed()
    assert ws.close_code == 1000


async def test_elevenlabs_unsupported_output_format_is_refused(live_server):
    url = f"{live_server.ws_url}/v1/text-to-speech/default/stream-input?output_format=wav_44100"
    async with connect(url) as ws:
        error = json.loads(await ws.recv())
        async with asyncio.timeout(10):
            await ws.wait_closed()
    assert error["error"] == "unsupported_output_format" and ws.close_code == 1008
