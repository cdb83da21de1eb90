"""The agents' websocket (`/v1/ws`) end to end against the live tiny server."""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass, field

import httpx
import numpy as np
import pytest
from websockets.asyncio.client import ClientConnection, connect

from realtime.audio import decode_mulaw
from realtime.protocol.native import parse_audio_frame

pytestmark = pytest.mark.asyncio(loop_scope="session")

TOKEN_S = 0.04
FIXED = 30  # speech tokens per spoken text


@dataclass
class Received:
    """What one context got: audio per seq, chunk metadata, and how it ended."""

    audio: dict[int, bytes] = field(default_factory=dict)
    chunks: list[dict] = field(default_factory=list)
    done: dict | None = None
    errors: list[dict] = field(default_factory=list)


async def send(ws: ClientConnection, **message) -> None:
    await ws.send(json.dumps(message))


async def collect(ws: ClientConnection, contexts: dict[str, Received], until) -> list[dict]:
    """Read frames into `contexts` until `until()` holds; returns the errors without a context."""
    loose_errors = []
    async with asyncio.timeout(60):
        while not until():
            frame = await ws.recv()
            if isinstance(frame, bytes):
                context_id, seq, payload = parse_audio_frame(frame)
                assert contexts[context_id].done is None, "audio after done"
                contexts[context_id].audio[seq] = payload
                continue
            event = json.loads(frame)
            target = contexts.get(event.get("context_id") or "")
            if event["type"] == "chunk":
                target.chunks.append(event)
            elif event["type"] == "done":
                target.done = event
            elif event["type"] == "error" and target is not None:
                target.errors.append(event)
            else:
                loose_errors.append(event)
    return loose_errors


async def test_text_in_pieces_is_spoken_sentence_by_sentence(live_server):
    async with connect(f"{live_server.ws_url}/v1/ws") as ws:
        await send(ws, type="start", context_id="a", fixed_length=FIXED, seed=1)
        for piece in ("Hello wor", "ld. How are", " you today?"):
            await send(ws, type="text", context_id="a", text=piece)
        await send(ws, type="end", context_id="a")
        got = {"a": Received()}
        await collect(ws, got, lambda: got["a"].done is not None)
    received = got["a"]
    assert received.done == {"type": "done", "context_id": "a", "cancelled": False}
    # Two sentences, FIXED tokens each, 24 kHz s16le.
    total = b"".join(received.audio[seq] for seq in sorted(received.audio))
    assert len(total) == 2 * FIXED * 960 * 2
    assert [c["seq"] for c in received.chunks] == sorted(received.audio) == list(range(len(received.chunks)))
    assert sum(c["final"] for c in received.chunks) == 2
    for chunk in received.chunks:
        assert len(received.audio[chunk["seq"]]) == round(chunk["duration_s"] * 24000) * 2
    words = [w for c in received.chunks for w in c["words"]]
    assert [w["word"] for w in words] == ["Hello", "world.", "How", "are", "you", "today?"]
    starts = [w["start_s"] for w in words]
    assert starts == sorted(starts) and starts[0] == 0.0
    # Sentence boundaries are exact: the second sentence starts where the first one's audio ends.
    assert words[2]["start_s"] == pytest.approx(FIXED * TOKEN_S, abs=1e-3)
    assert words[-1]["end_s"] == pytest.approx(2 * FIXED * TOKEN_S, abs=1e-3)


async def test_two_contexts_on_one_socket_with_their_own_formats(live_server):
    async with connect(f"{live_server.ws_url}/v1/ws") as ws:
        await send(ws, type="start", context_id="pcm16k", sample_rate=16000, fixed_length=FIXED)
        await send(
            ws, type="start", context_id="ulaw8k", sample_rate=8000, encoding="mulaw", fixed_length=FIXED
        )
        await send(ws, type="text", context_id="pcm16k", text="First context speaking.")
        await send(ws, type="text", context_id="ulaw8k", text="Second context speaking.")
        await send(ws, type="end", context_id="pcm16k")
        await send(ws, type="end", context_id="ulaw8k")
        got = {"pcm16k": Received(), "ulaw8k": Received()}
        await collect(ws, got, lambda: all(r.done for r in got.values()))
    pcm = b"".join(got["pcm16k"].audio[s] for s in sorted(got["pcm16k"].audio))
    ulaw = b"".join(got["ulaw8k"].audio[s] for s in sorted(got["ulaw8k"].audio))
    assert len(pcm) == FIXED * 640 * 2  # 16 kHz: 640 samples per token, 2 bytes each
    assert len(ulaw) == FIXED * 320  # 8 kHz: 320 samples per token, 1 byte each
    assert np.abs(decode_mulaw(ulaw)).max() > 0


async def test_cancel_stops_the_context_and_frees_engine_resources(live_server, eventually):
    runtime = live_server.runtime
    async with connect(f"{live_server.ws_url}/v1/ws") as ws:
        await send(ws, type="start", context_id="long", fixed_length=400)
        await send(ws, type="text", context_id="long", text="A very long sentence that would take a while.")
        await send(ws, type="flush", context_id="long")
        got = {"long": Received()}
        await collect(ws, got, lambda: len(got["long"].audio) >= 1)
        assert runtime.stats().llm_active + runtime.stats().llm_waiting == 1
        await send(ws, type="cancel", context_id="long")
        await collect(ws, got, lambda: got["long"].done is not None)  # asserts no audio after done
        assert got["long"].done["cancelled"] is True
        await eventually(lambda: runtime.stats().active_streams == 0)
        await eventually(lambda: runtime.stats().llm_active == 0 and runtime.stats().token2wav_streams == 0)
        # The socket carries on.
        await send(ws, type="start", context_id="next", fixed_length=FIXED)
        await send(ws, type="text", context_id="next", text="Still here.")
        await send(ws, type="end", context_id="next")
        got["next"] = Received()
        await collect(ws, got, lambda: got["next"].done is not None)
        assert sum(len(a) for a in got["next"].audio.values()) == FIXED * 960 * 2
    # A cancelled stream never got to most of its 400 tokens.
    assert sum(len(a) for a in got["long"].audio.values()) < 400 * 960 * 2


async def test_bad_messages_get_errors_and_the_socket_carries_on(live_server):
    async with connect(f"{live_server.ws_url}/v1/ws") as ws:
        bad = [
            "{not json",
            json.dumps({"type": "dance"}),
            json.dumps(["a", "list"]),
            json.dumps({"type": "text", "context_id": "ghost", "text": "hi"}),
            json.dumps({"type": "start", "context_id": "v", "voice": "nobody"}),
            json.dumps({"type": "start", "context_id": "r", "sample_rate": 11025}),
            json.dumps({"type": "start", "context_id": "e", "encoding": "opus"}),
            json.dumps({"type": "start", "context_id": "bad id!"}),
            json.dumps({"type": "start"}),
        ]
        for frame in bad:
            await ws.send(frame)
        await ws.send(b"\x00\x01binary")
        await send(ws, type="start", context_id="ok", fixed_length=FIXED)
        await send(ws, type="start", context_id="ok")
        await send(ws, type="text", context_id="ok", text="x" * 5000)
        codes = []
        async with asyncio.timeout(30):
            while len(codes) < len(bad) + 3:
                event = json.loads(await ws.recv())
                assert event["type"] == "error" and event["message"]
                codes.append(event["code"])
        assert codes == [
            "invalid_json",
            "unknown_type",
            "invalid_message",
            "unknown_context",
            "voice_not_found",
            "unsupported_sample_rate",
            "unsupported_encoding",
            "invalid_context_id",
            "invalid_message",
            "binary_not_accepted",
            "context_exists",
            "text_too_long",
        ]
        await send(ws, type="text", context_id="ok", text="Works after all that.")
        await send(ws, type="end", context_id="ok")
        got = {"ok": Received()}
        await collect(ws, got, lambda: got["ok"].done is not None)
        assert sum(len(a) for a in got["ok"].audio.values()) == FIXED * 960 * 2


async def test_close_message_closes_the_socket_normally(live_server):
    async with connect(f"{live_server.ws_url}/v1/ws") as ws:
        await send(ws, type="start", context_id="c", fixed_length=FIXED)
        await send(ws, type="close")
        async with asyncio.timeout(10):
            await ws.wait_closed()
        assert ws.close_code == 1000


async def test_the_server_declines_per_message_compression(live_server):
    """Clients offer permessage-deflate by default; PCM does not compress, so the server says no and
    audio frames go out as they are."""
    async with connect(f"{live_server.ws_url}/v1/ws", compression="deflate") as ws:
        assert ws.response is not None
        assert "Sec-WebSocket-Extensions" not in ws.response.headers
        await send(ws, type="start", context_id="c", voice="default", fixed_length=FIXED)
        await send(ws, type="text", context_id="c", text="Hello there.")
        await send(ws, type="end", context_id="c")
        contexts = {"c": Received()}
        await collect(ws, contexts, until=lambda: contexts["c"].done is not None)
        assert sum(len(a) for a in contexts["c"].audio.values()) == FIXED * TOKEN_S * 24000 * 2


async def test_busy_server_refuses_with_429_and_retry_after(live_server, eventually):
    limit = live_server.config.max_streams
    async with httpx.AsyncClient(base_url=live_server.http_url, timeout=60) as http:
        body = {
            "model": "tts-1",
            "input": "Keep the engine busy for a while.",
            "response_format": "pcm",
            "fixed_length": 400,
        }
        streams = [http.stream("POST", "/v1/audio/speech", json=body) for _ in range(limit)]
        responses = [await s.__aenter__() for s in streams]
        try:
            assert all(r.status_code == 200 for r in responses)
            refused = await http.post("/v1/audio/speech", json=body)
            assert refused.status_code == 429
            assert refused.headers["retry-after"] == "1"
            assert refused.json()["error"]["code"] == "busy"
        finally:
            for stream in streams:
                await stream.__aexit__(None, None, None)
    await eventually(lambda: live_server.runtime.stats().active_streams == 0)
    await eventually(lambda: live_server.runtime.stats().token2wav_streams == 0)


async def test_openai_voice_names_resolve_on_the_openai_route_only(live_server):
    # OpenAI's clients know only OpenAI's names, so /v1/audio/speech speaks them (the alias table);
    # the native socket's clients choose among our voices, and a name that is no voice is refused.
    async with httpx.AsyncClient(base_url=live_server.http_url, timeout=60) as http:
        body = {"model": "tts-1", "voice": "alloy", "input": "Hi there.", "response_format": "pcm"}
        response = await http.post("/v1/audio/speech", json={**body, "fixed_length": FIXED})
    assert response.status_code == 200 and len(response.content) == FIXED * 960 * 2
    async with connect(f"{live_server.ws_url}/v1/ws") as ws:
        await send(ws, type="start", context_id="c", voice="alloy")
        async with asyncio.timeout(30):
            event = json.loads(await ws.recv())
    assert event["type"] == "error" and event["code"] == "voice_not_found"
