"""ElevenLabs' websockets and HTTP routes against the live tiny server, message by message.

The clients' own code drives the same endpoints in tests/integrations; these tests pin the wire
behaviour those clients rely on (what ElevenLabs' API does) with a plain websocket and httpx.
"""

from __future__ import annotations

import asyncio
import base64
import io
import json

import av
import httpx
import numpy as np
import pytest
from websockets.asyncio.client import ClientConnection, connect

pytestmark = pytest.mark.asyncio(loop_scope="session")

MULTI = "/v1/text-to-speech/default/multi-stream-input"


async def until_final(ws: ClientConnection, context_id: str | None = None) -> list[dict]:
    received = []
    async with asyncio.timeout(90):
        while True:
            message = json.loads(await ws.recv())
            assert "error" not in message, message
            received.append(message)
            if message.get("isFinal") is True and message.get("contextId") == context_id:
                return received


def check_alignment(messages: list[dict], rate: int, sample_bytes: int = 2) -> str:
    """Each chunk's alignment as ElevenLabs shapes it; returns the text the characters spell.

    A chunk where no character starts has none (null); the next alignment then covers its audio too."""
    text, uncovered_ms = "", 0.0
    for message in messages:
        if "audio" not in message or message.get("isFinal"):
            continue
        uncovered_ms += len(base64.b64decode(message["audio"])) / sample_bytes / rate * 1000
        alignment = message["alignment"]
        assert message["normalizedAlignment"] == alignment
        if alignment is None:
            continue
        chars, starts, durations = (
            alignment["chars"],
            alignment["charStartTimesMs"],
            alignment["charDurationsMs"],
        )
        assert len(chars) == len(starts) == len(durations) > 0
        assert all(d >= 0 for d in durations) and starts == sorted(starts) and starts[0] >= 0
        assert abs(starts[-1] + durations[-1] - uncovered_ms) <= 1  # the characters cover the audio
        uncovered_ms = 0.0
        text += "".join(chars)
    return text


async def test_flush_then_close_context_speaks_the_flushed_text_to_the_end(live_server):
    url = f"{live_server.ws_url}{MULTI}?output_format=pcm_16000"
    async with connect(url) as ws:
        await ws.send(json.dumps({"text": " ", "context_id": "t1", "voice_settings": {"speed": 1.1}}))
        for piece in ("Hello there, it is sunny today.", " Shall we walk"):
            await ws.send(json.dumps({"text": piece, "context_id": "t1"}))
        await ws.send(json.dumps({"context_id": "t1", "flush": True}))
        await ws.send(json.dumps({"text": "dropped, never flushed", "context_id": "t1"}))
        await ws.send(json.dumps({"context_id": "t1", "close_context": True}))
        received = await until_final(ws, "t1")
    assert received[-1] == {"audio": None, "isFinal": True, "contextId": "t1"}
    assert all(m["contextId"] == "t1" for m in received)
    # Every flushed word is spoken (and aligned, words apart); what was never flushed is not.
    assert check_alignment(received, 16000) == "Hello there, it is sunny today. Shall we walk"


async def test_keepalive_without_context_opens_nothing_and_close_socket_drains(live_server, eventually):
    url = f"{live_server.ws_url}{MULTI}?output_format=pcm_24000"
    async with connect(url) as ws:
        await ws.send(json.dumps({"text": ""}))  # Pipecat's keep-alive before any context
        await ws.send(json.dumps({"text": "", "context_id": "unknown"}))
        await ws.send(json.dumps({"text": " ", "context_id": "a"}))
        await ws.send(
            json.dumps({"text": "Drained before the socket closes.", "context_id": "a", "flush": True})
        )
        await ws.send(json.dumps({"close_socket": True}))
        received = []
        async with asyncio.timeout(90):
            async for frame in ws:
                received.append(json.loads(frame))
    assert ws.close_code == 1000
    # Only context "a" ever existed: its audio, then its final message, then the close.
    assert {m["contextId"] for m in received} == {"a"}
    assert received[-1] == {"audio": None, "isFinal": True, "contextId": "a"}
    assert check_alignment(received, 24000) == "Drained before the socket closes."
    await eventually(lambda: live_server.runtime.stats().active_streams == 0)


async def test_second_close_context_cancels_and_frees_the_slot(live_server, eventually):
    url = f"{live_server.ws_url}{MULTI}?output_format=pcm_24000"
    async with connect(url) as ws:
        await ws.send(json.dumps({"text": " ", "context_id": "c"}))
        long_text = "This turn talks for quite a while. " * 3
        await ws.send(json.dumps({"text": long_text, "context_id": "c", "flush": True}))
        await ws.send(json.dumps({"context_id": "c", "close_context": True}))
        first = json.loads(await ws.recv())
        assert first["contextId"] == "c" and first["audio"]
        await ws.send(json.dumps({"context_id": "c", "close_context": True}))  # barge-in
        received = await until_final(ws, "c")
        await eventually(lambda: live_server.runtime.stats().active_streams == 0)
        # The socket still serves new contexts.
        await ws.send(json.dumps({"text": "Next.", "context_id": "d", "flush": True}))
        await ws.send(json.dumps({"context_id": "d", "close_context": True}))
        assert (await until_final(ws, "d"))[0]["audio"]
    assert received[-1] == {"audio": None, "isFinal": True, "contextId": "c"}


@pytest.mark.parametrize(
    ("output_format", "codec", "rate"),
    [("mp3_44100_128", "mp3", 44100), ("mp3_22050_32", "mp3", 22050), ("opus_48000_64", "opus", 48000)],
)
async def test_compressed_output_formats_decode(live_server, output_format, codec, rate):
    url = f"{live_server.ws_url}/v1/text-to-speech/default/stream-input?output_format={output_format}"
    async with connect(url) as ws:
        await ws.send(json.dumps({"text": " "}))
        await ws.send(json.dumps({"text": "One sentence. And another one.", "flush": True}))
        await ws.send(json.dumps({"text": ""}))
        received = await until_final(ws)
    data = b"".join(base64.b64decode(m["audio"]) for m in received if m.get("audio"))
    with av.open(io.BytesIO(data)) as container:
        stream = container.streams.audio[0]
        assert stream.codec_context.name.startswith(codec) and stream.codec_context.sample_rate == rate
        samples = sum(frame.samples for frame in container.decode(stream))
    assert samples > rate // 4


async def test_alaw_output_is_one_byte_per_sample(live_server):
    url = f"{live_server.ws_url}/v1/text-to-speech/default/stream-input?output_format=alaw_8000"
    async with connect(url) as ws:
        await ws.send(json.dumps({"text": "Short one.", "flush": True}))
        await ws.send(json.dumps({"text": ""}))
        received = await until_final(ws)
    # One byte per sample: the alignment's ms match the audio's bytes / 8.
    assert check_alignment(received, 8000, sample_bytes=1) == "Short one."


async def test_http_with_timestamps_and_errors(live_server):
    base = f"{live_server.http_url}/v1/text-to-speech"
    async with httpx.AsyncClient(timeout=90) as client:
        response = await client.post(
            f"{base}/default/with-timestamps?output_format=pcm_16000",
            json={"text": "Hello there. Good day.", "model_id": "eleven_flash_v2_5"},
        )
        assert response.status_code == 200, response.text
        body = response.json()
        pcm = np.frombuffer(base64.b64decode(body["audio_base64"]), dtype="<i2")
        alignment = body["alignment"]
        assert body["normalized_alignment"] == alignment
        assert "".join(alignment["characters"]) == "Hello there. Good day."
        starts, ends = alignment["character_start_times_seconds"], alignment["character_end_times_seconds"]
        assert starts == sorted(starts) and all(0 <= s <= e for s, e in zip(starts, ends, strict=True))
        assert ends[-1] <= pcm.size / 16000 + 0.01

        lines = []
        async with client.stream(
            "POST",
            f"{base}/default/stream/with-timestamps?output_format=pcm_24000",
            json={"text": "Hi. Bye."},
        ) as streamed:
            assert streamed.status_code == 200
            async for line in streamed.aiter_lines():
                if line:
                    lines.append(json.loads(line))
        chars = "".join(c for line in lines if line["alignment"] for c in line["alignment"]["characters"])
        assert chars == "Hi. Bye." and all(line["audio_base64"] for line in lines)

        missing = await client.post(f"{base}/nobody", json={"text": "Hi."})
        assert missing.status_code == 404 and missing.json()["detail"]["status"] == "voice_not_found"
        bad_format = await client.post(f"{base}/default/stream?output_format=wav_1", json={"text": "Hi."})
        assert bad_format.status_code == 400
        assert bad_format.json()["detail"]["status"] == "unsupported_output_format"
        mp3 = await client.post(f"{base}/default", json={"text": "Hi."})
        assert mp3.status_code == 200 and mp3.headers["content-type"] == "audio/mpeg" and mp3.content


async def test_text_the_front_end_refuses_is_a_400_not_an_empty_200(live_server):
    """The text is cut into segments after admission; its refusal still comes back as a status code."""
    async with httpx.AsyncClient(base_url=live_server.http_url, timeout=60) as http:
        response = await http.post("/v1/text-to-speech/default/stream", json={"text": "<|endofprompt|>"})
    assert response.status_code == 400, response.content
    assert response.json()["detail"]["status"] == "empty_text"
