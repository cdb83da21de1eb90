"""Property-based fuzzing of every transport's messages against the live server (hypothesis).

For any message a client may send: the answer is a clear coded error (or valid work), never a 500; the
connection and its other contexts stay alive where the protocol allows; the process stays healthy and
its metrics return to idle. Example counts are bounded (`EXAMPLES`) to keep the suite's run time modest.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from websockets.asyncio.client import ClientConnection, connect
from websockets.exceptions import ConnectionClosed

from realtime.transports.webrtc import Cancel, ControlError, Speak, parse_control

pytestmark = pytest.mark.asyncio(loop_scope="session")

EXAMPLES = 40
FUZZ = settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck))

# Strings clients get wrong: empty, huge, lone surrogates, control characters, markup.
nasty_text = st.one_of(
    st.text(max_size=40),
    st.sampled_from(["", " ", "\ud800", "a\udfff b", "\x00", "<|endofprompt|>", "1" * 600, "é" * 50, "Hi."]),
)
huge_int = st.integers(min_value=-(10**40), max_value=10**40)
numbers = st.one_of(
    huge_int, st.floats(allow_nan=False, allow_infinity=False), st.sampled_from([0, -1, 1, 2**63])
)
json_leaf = st.one_of(st.none(), st.booleans(), numbers, nasty_text)
json_value = st.recursive(
    json_leaf,
    lambda children: st.lists(children, max_size=3) | st.dictionaries(nasty_text, children, max_size=3),
    max_leaves=6,
)
# Fields the server reads, with values of every kind (mostly wrong ones); small lengths keep valid work short.
field_value = st.one_of(json_value, st.integers(min_value=-2, max_value=3))
raw_frames = st.one_of(
    st.text(max_size=60),
    st.sampled_from(
        ["[" * 5000 + "]" * 5000, '{"a": 1e400}', '{"a": NaN}', '{"a": ' + "9" * 5000 + "}", "{}"]
    ),
)


def message_of(keys: list[str]) -> st.SearchStrategy[dict[str, Any]]:
    return st.dictionaries(st.sampled_from(keys), field_value, max_size=len(keys))


NATIVE_KEYS = ["type", "context_id", "voice", "sample_rate", "encoding", "speed", "seed", "fixed_length",
               "text", "instructions", "language", "mode", "bit_rate"]
native_message = st.one_of(
    message_of(NATIVE_KEYS).map(json.dumps),
    st.builds(lambda kind, extra: json.dumps({"type": kind, "context_id": "f", **extra}),
              st.sampled_from(["start", "text", "flush", "end", "cancel", "close"]), message_of(NATIVE_KEYS)),
    raw_frames,
    st.binary(max_size=20),
)
CARTESIA_KEYS = ["context_id", "transcript", "continue", "flush", "cancel", "voice", "output_format", "speed",
                 "generation_config", "add_timestamps", "language", "model_id"]
ELEVENLABS_KEYS = ["text", "flush", "context_id", "close_context", "close_socket", "voice_settings",
                   "generation_config", "xi_api_key", "try_trigger_generation"]


def assert_coded_error(event: dict[str, Any], code_key: str = "code") -> None:
    code, message = event.get(code_key), event.get("message")
    assert isinstance(code, str) and code and isinstance(message, str) and message, event
    assert code != "internal_error", event


async def probe_alive(ws: ClientConnection, probe: str, read: Any) -> list[dict[str, Any]]:
    """Send a message that must be refused (text for a context that does not exist) and read until its
    error: the socket is alive and answers in order. Returns the JSON events read before it."""
    await ws.send(probe)
    seen = []
    async with asyncio.timeout(60):
        while True:
            frame = await ws.recv()
            if isinstance(frame, bytes):
                continue
            event = json.loads(frame)
            if read(event):
                return seen
            seen.append(event)


async def metrics_idle(live_server, eventually) -> None:
    stats = live_server.runtime.stats
    await eventually(lambda: stats().active_streams == 0 and stats().token2wav_streams == 0)
    async with httpx.AsyncClient(base_url=live_server.http_url) as http:
        assert (await http.get("/healthz")).status_code == 200
        body = (await http.get("/metrics")).text
    assert "\ntts_active_streams 0.0" in body and "\ntts_websocket_connections 0.0" in body


@FUZZ
@given(frames=st.lists(native_message, min_size=1, max_size=4))
async def test_native_websocket_messages(live_server, eventually, frames):
    async with connect(f"{live_server.ws_url}/v1/ws") as ws:
        await ws.send(json.dumps({"type": "start", "context_id": "other", "fixed_length": 1}))
        for frame in frames:
            await ws.send(frame)
        if any('"close"' in frame for frame in frames if isinstance(frame, str)):
            return  # a close message (or one that might be) ends the socket by design
        probe = json.dumps({"type": "flush", "context_id": "probe"})
        seen = await probe_alive(
            ws, probe, lambda e: e.get("type") == "error" and e.get("context_id") == "probe"
        )
        for event in seen:
            if event["type"] == "error":
                assert_coded_error(event)
        # The other context is still open: it takes text and finishes.
        await ws.send(json.dumps({"type": "text", "context_id": "other", "text": "Yes."}))
        await ws.send(json.dumps({"type": "end", "context_id": "other"}))
        await probe_alive(ws, probe, lambda e: e.get("type") == "done" and e.get("context_id") == "other")
        await ws.send(json.dumps({"type": "cancel", "context_id": "f"}))
    await metrics_idle(live_server, eventually)


@FUZZ
@given(messages=st.lists(message_of(CARTESIA_KEYS), min_size=1, max_size=3))
async def test_cartesia_websocket_messages(live_server, eventually, messages):
    async with connect(f"{live_server.ws_url}/cartesia/tts/websocket") as ws:
        for message in messages:
            await ws.send(json.dumps(message))
        probe = json.dumps(
            {"context_id": "probe", "transcript": "x", "continue": True, "voice": {"id": "nobody"}}
        )
        seen = await probe_alive(ws, probe, lambda e: e.get("context_id") == "probe")
        for event in seen:
            if event.get("type") == "error":
                assert isinstance(event.get("error_code") or event.get("title"), str) and event["message"]
                assert event.get("status_code") != 500, event
        for context_id in {m.get("context_id") for m in messages if isinstance(m.get("context_id"), str)}:
            await ws.send(json.dumps({"context_id": context_id, "cancel": True}))
    await metrics_idle(live_server, eventually)


safe_text = nasty_text.filter(lambda text: text.encode("utf-8", "ignore").decode() == text)


@FUZZ
@given(
    output_format=st.one_of(
        st.sampled_from(["pcm_16000", "ulaw_8000", "pcm_²", "pcm_" + "9" * 5000]), safe_text
    ),
    messages=st.lists(message_of(ELEVENLABS_KEYS), min_size=1, max_size=3),
)
async def test_elevenlabs_websocket_messages(live_server, eventually, output_format, messages):
    query = httpx.QueryParams({"output_format": output_format})
    async with connect(f"{live_server.ws_url}/v1/text-to-speech/default/multi-stream-input?{query}") as ws:
        try:
            for message in messages:
                await ws.send(json.dumps(message))
            probe = json.dumps({"text": 5, "context_id": "probe"})
            seen = await probe_alive(ws, probe, lambda e: e.get("contextId") == "probe" and "error" in e)
        except ConnectionClosed:
            # Refused at the handshake's first message (a bad output_format) or closed on request.
            assert ws.close_code in (1000, 1008), ws.close_code
            seen = []
        for event in seen:
            if event.get("error"):
                assert isinstance(event.get("message"), str) and event["error"] != "internal_error", event
        if ws.close_code is None:
            for context_id in {m.get("context_id") for m in messages if isinstance(m.get("context_id"), str)}:
                await ws.send(json.dumps({"context_id": context_id, "close_context": True}))
    await metrics_idle(live_server, eventually)


SPEECH_KEYS = ["model", "input", "voice", "response_format", "speed", "stream_format", "seed", "fixed_length",
               "instructions", "language", "mode"]


@FUZZ
@given(body=st.one_of(message_of(SPEECH_KEYS).map(json.dumps), raw_frames))
async def test_openai_speech_bodies(live_server, eventually, body):
    headers = {"content-type": "application/json"}
    async with (
        httpx.AsyncClient(base_url=live_server.http_url, timeout=120) as http,
        http.stream("POST", "/v1/audio/speech", content=body.encode(), headers=headers) as response,
    ):
        if response.status_code == 200:  # valid: its first audio came; closing cancels the rest
            assert await anext(response.aiter_bytes())
        else:
            assert response.status_code < 500, await response.aread()
            error = json.loads(await response.aread())["error"]
            assert error["code"] and error["message"] and error["type"] in ("invalid_request_error",
                                                                            "rate_limit_error"), error
    await metrics_idle(live_server, eventually)


VENDOR_HTTP = {
    "/cartesia/tts/bytes": ["transcript", "voice", "output_format", "model_id", "language", "speed",
                            "generation_config", "context_id"],
    "/v1/text-to-speech/default/stream": ["text", "voice_settings", "seed", "language_code", "model_id",
                                          "generation_config"],
}


@FUZZ
@given(path=st.sampled_from(sorted(VENDOR_HTTP)), data=st.data())
async def test_vendor_http_bodies(live_server, eventually, path, data):
    """The Cartesia and ElevenLabs HTTP routes: no 500 for any body (their errors take their own shapes)."""
    body = data.draw(st.one_of(message_of(VENDOR_HTTP[path]).map(json.dumps), raw_frames))
    headers = {"content-type": "application/json"}
    async with (
        httpx.AsyncClient(base_url=live_server.http_url, timeout=120) as http,
        http.stream("POST", path, content=body.encode(), headers=headers) as response,
    ):
        if response.status_code == 200:
            with contextlib.suppress(StopAsyncIteration):  # an error after admission may end it early
                await anext(response.aiter_bytes())
        else:
            assert response.status_code < 500, await response.aread()
            assert json.loads(await response.aread())
    await metrics_idle(live_server, eventually)


@settings(max_examples=15, deadline=None, suppress_health_check=list(HealthCheck))
@given(voice_id=nasty_text, transcript=nasty_text, audio=st.binary(max_size=64))
async def test_voice_uploads(live_server, eventually, voice_id, transcript, audio):
    fields = {name: (None, value.encode("utf-8", "surrogatepass"))
              for name, value in (("voice_id", voice_id), ("transcript", transcript))}
    async with httpx.AsyncClient(base_url=live_server.http_url, timeout=120) as http:
        response = await http.post("/v1/voices", files={"audio": ("clip.wav", audio), **fields})
    assert 400 <= response.status_code < 500, response.text
    assert response.json()["error"]["code"]
    await metrics_idle(live_server, eventually)


offer_body = st.one_of(
    json_value.map(json.dumps),
    st.builds(lambda sdp: json.dumps({"type": "offer", "sdp": sdp}), nasty_text),
    raw_frames,
)


@FUZZ
@given(body=offer_body)
async def test_webrtc_offers(live_server, eventually, body):
    async with httpx.AsyncClient(base_url=live_server.http_url, timeout=60) as http:
        response = await http.post("/v1/webrtc/offer", content=body.encode("utf-8", "surrogatepass"))
    assert response.status_code in (400, 413, 429, 503), response.text
    assert response.json()["error"]["code"]
    await metrics_idle(live_server, eventually)


CONTROL_KEYS = ["type", "text", "voice", "id", "speed", "seed", "fixed_length", "instructions", "language",
                "mode"]


@settings(max_examples=200, deadline=None)
@given(message=st.one_of(message_of(CONTROL_KEYS).map(json.dumps), raw_frames, st.binary(max_size=10)))
async def test_webrtc_data_channel_messages(message):
    """Every data-channel message parses to a command or a ControlError (which the session reports on
    the channel), never another exception that would reach aiortc's event handler."""
    try:
        command = parse_control(message)
    except ControlError as exc:
        assert exc.message
        return
    assert isinstance(command, Speak | Cancel)
