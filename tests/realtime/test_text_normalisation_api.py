"""Text normalisation end to end: what the live server speaks is the normalised text, streamed or whole.

Word timestamps name the words the model was given, so they show the normalisation: "$5" is spoken as
"five dollars" whether the text came sentence by sentence over a websocket or whole over HTTP.
"""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest
from websockets.asyncio.client import connect

pytestmark = pytest.mark.asyncio(loop_scope="session")

BASE = {
    "model_id": "sonic-2",
    "language": "en",
    "add_timestamps": True,
    "voice": {"mode": "id", "id": "default"},
    "output_format": {"container": "raw", "encoding": "pcm_s16le", "sample_rate": 16000},
}


async def test_streamed_sentences_are_spoken_normalised(live_server):
    url = f"{live_server.ws_url}/cartesia/tts/websocket"
    message = {**BASE, "context_id": "n"}
    received = []
    async with connect(url) as ws:
        for piece in ("It costs $5. ", "I have 12 [laughter] cats."):
            await ws.send(json.dumps({**message, "transcript": piece, "continue": True}))
        await ws.send(json.dumps({**message, "transcript": "", "continue": False}))
        async with asyncio.timeout(90):
            while not received or received[-1]["type"] not in ("done", "error"):
                received.append(json.loads(await ws.recv()))
    assert received[-1]["type"] == "done"
    words = [w for m in received if m["type"] == "timestamps" for w in m["word_timestamps"]["words"]]
    assert words == ["It", "costs", "five", "dollars.", "I", "have", "twelve", "cats."]


async def test_a_whole_text_over_http_is_spoken_normalised(live_server):
    body = {**BASE, "transcript": "It costs $5 on 3/4. " * 3}
    async with httpx.AsyncClient(base_url=live_server.http_url, timeout=90) as http:
        response = await http.post("/cartesia/tts/sse", json=body)
    assert response.status_code == 200
    lines = response.text.splitlines()
    events = [json.loads(line.removeprefix("data: ")) for line in lines if line.startswith("data: ")]
    assert events[-1]["type"] == "done"
    words = [w for e in events if e["type"] == "timestamps" for w in e["word_timestamps"]["words"]]
    assert words == ["It", "costs", "five", "dollars", "on", "three", "quarters."] * 3


async def test_an_unknown_voice_is_refused_with_a_status(live_server):
    body = {**BASE, "transcript": "It costs $5.", "voice": {"mode": "id", "id": "nobody"}}
    async with httpx.AsyncClient(base_url=live_server.http_url, timeout=30) as http:
        response = await http.post("/cartesia/tts/bytes", json=body)
    assert response.status_code == 404
