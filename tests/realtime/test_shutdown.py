"""`python -m realtime serve` as a process receiving SIGTERM: it drains, then exits 0.

While draining the server still answers: /readyz says `draining` (503), new work is refused with
`shutting_down`, and every utterance already running finishes on every transport (an HTTP stream
completes, a websocket context gets its `done` — Cartesia's `done`, ElevenLabs' `isFinal` — and the
socket a 1001 close, a WebRTC utterance its `done`).
"""

from __future__ import annotations

import asyncio
import base64
import json
import os
import signal
import socket
import sys
from pathlib import Path

import httpx
import numpy as np
import pytest
from test_webrtc import Peer
from websockets.asyncio.client import connect
from websockets.exceptions import ConnectionClosed

from realtime.protocol.native import parse_audio_frame

pytestmark = pytest.mark.asyncio(loop_scope="session")

FIXED = 150  # 6 s of speech: still streaming when the signal arrives
SAMPLES_PER_TOKEN = 960
REPO = Path(__file__).resolve().parents[2]


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


async def wait_ready(url: str, process: asyncio.subprocess.Process) -> None:
    async with httpx.AsyncClient() as http, asyncio.timeout(120):
        while process.returncode is None:
            try:
                if (await http.get(f"{url}/readyz")).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            await asyncio.sleep(0.2)
    raise AssertionError(f"the server exited with {process.returncode} before it was ready")


async def native_context(ws_url: str, first_audio: asyncio.Event) -> dict:
    """One context that is still speaking (its end never sent) when the drain begins."""
    audio, events = b"", []
    async with connect(f"{ws_url}/v1/ws") as ws:
        await ws.send(json.dumps({"type": "start", "context_id": "c", "fixed_length": FIXED}))
        await ws.send(json.dumps({"type": "text", "context_id": "c", "text": "Keep talking please."}))
        await ws.send(json.dumps({"type": "flush", "context_id": "c"}))
        try:
            async for frame in ws:
                if isinstance(frame, bytes):
                    audio += parse_audio_frame(frame)[2]
                    first_audio.set()
                else:
                    events.append(json.loads(frame))
        except ConnectionClosed:
            pass
        return {"audio": audio, "events": events, "close_code": ws.close_code}


async def cartesia_context(ws_url: str, first_audio: asyncio.Event) -> dict:
    messages = []
    output = {"container": "raw", "encoding": "pcm_s16le", "sample_rate": 24000}
    async with connect(f"{ws_url}/cartesia/tts/websocket") as ws:
        message = {"context_id": "k", "transcript": "Talking for a while now. ", "continue": True,
                   "flush": True, "voice": {"mode": "id", "id": "default"}, "output_format": output}
        await ws.send(json.dumps(message))
        try:
            async for frame in ws:
                messages.append(json.loads(frame))
                first_audio.set()
        except ConnectionClosed:
            pass
        return {"messages": messages, "close_code": ws.close_code}


async def elevenlabs_context(ws_url: str, first_audio: asyncio.Event) -> dict:
    messages = []
    url = f"{ws_url}/v1/text-to-speech/default/multi-stream-input?output_format=pcm_24000"
    async with connect(url) as ws:
        await ws.send(json.dumps({"text": " ", "context_id": "e"}))
        await ws.send(json.dumps({"text": "Talking for a while now. ", "context_id": "e", "flush": True}))
        try:
            async for frame in ws:
                message = json.loads(frame)
                messages.append(message)
                if message.get("audio"):
                    first_audio.set()
        except ConnectionClosed:
            pass
        return {"messages": messages, "close_code": ws.close_code}


async def test_sigterm_drains_every_transport_then_exits_0(tiny_models, tmp_path):
    port = free_port()
    url, ws_url = f"http://127.0.0.1:{port}", f"ws://127.0.0.1:{port}"
    process = await asyncio.create_subprocess_exec(
        *(sys.executable, "-m", "realtime", "serve", "--models", str(tiny_models), "--voices", str(tmp_path)),
        *("--port", str(port), "--drain-timeout", "90", "--advertise-address", "127.0.0.1"),
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO)},
        stdout=asyncio.subprocess.DEVNULL,
        stderr=asyncio.subprocess.PIPE,
    )
    peer = Peer()
    try:
        await wait_ready(url, process)
        async with httpx.AsyncClient(base_url=url, timeout=120) as http:
            await peer.connect(http)
            peer.send(type="speak", text="A WebRTC utterance.", id="w", fixed_length=50)
            await peer.expect("started", "w")
            await peer.expect("first_audio", "w")
            started = {name: asyncio.Event() for name in ("native", "cartesia", "elevenlabs")}
            native = asyncio.create_task(native_context(ws_url, started["native"]))
            cartesia = asyncio.create_task(cartesia_context(ws_url, started["cartesia"]))
            elevenlabs = asyncio.create_task(elevenlabs_context(ws_url, started["elevenlabs"]))
            body = {"input": "Finish this sentence please.", "response_format": "pcm", "fixed_length": FIXED}
            async with http.stream("POST", "/v1/audio/speech", json=body) as response:
                assert response.status_code == 200
                pieces = []
                async for piece in response.aiter_bytes():
                    if not pieces:
                        async with asyncio.timeout(60):
                            await asyncio.gather(*(event.wait() for event in started.values()))
                        process.send_signal(signal.SIGTERM)
                        # Draining: not ready, and new work is refused on every transport.
                        async with asyncio.timeout(30):
                            # The signal lands in another process: poll its answer.
                            while (ready := await http.get("/readyz")).status_code == 200:  # noqa: ASYNC110
                                await asyncio.sleep(0.05)
                        assert ready.status_code == 503 and ready.json() == {"status": "draining"}
                        refused = await http.post("/v1/audio/speech", json=body)
                        assert refused.status_code == 503
                        assert refused.json()["error"]["code"] == "shutting_down"
                        async with connect(f"{ws_url}/v1/ws") as late:
                            with pytest.raises(ConnectionClosed):
                                await late.recv()
                            assert late.close_code == 1001
                    pieces.append(piece)
            native_got, cartesia_got, elevenlabs_got = await native, await cartesia, await elevenlabs
            done = await peer.expect("done", "w")
        assert await asyncio.wait_for(process.wait(), 120) == 0
    finally:
        await peer.close()
        if process.returncode is None:
            process.kill()
        stderr = (await process.stderr.read()).decode() if process.stderr else ""
        await process.wait()
    # HTTP: the whole utterance.
    assert np.frombuffer(b"".join(pieces), dtype="<i2").size == FIXED * SAMPLES_PER_TOKEN
    # Native websocket: all of its flushed text, its done, then 1001.
    assert len(native_got["audio"]) == FIXED * SAMPLES_PER_TOKEN * 2
    assert native_got["events"][-1] == {"type": "done", "context_id": "c", "cancelled": False}
    assert native_got["close_code"] == 1001
    # Cartesia: audio, then its done, then 1001.
    kinds = [message["type"] for message in cartesia_got["messages"]]
    assert kinds[-1] == "done" and "chunk" in kinds, kinds
    assert sum(len(base64.b64decode(m["data"])) for m in cartesia_got["messages"] if m["type"] == "chunk") > 0
    assert cartesia_got["close_code"] == 1001
    # ElevenLabs multi-context: audio, then the context's isFinal, then 1001.
    eleven = elevenlabs_got["messages"]
    assert any(m.get("audio") for m in eleven), eleven[:3]
    assert eleven[-1] == {"audio": None, "isFinal": True, "contextId": "e"}, eleven[-1]
    assert elevenlabs_got["close_code"] == 1001
    # WebRTC: the utterance finished rather than being cancelled.
    assert done == {"type": "done", "id": "w", "cancelled": False}
    assert "draining" in stderr and "Application shutdown complete" in stderr
