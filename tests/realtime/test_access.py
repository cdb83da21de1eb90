"""API keys, voice ownership, Origin checks and CORS on every transport, against a live keyed server.

Each vendor dialect is driven the way its own clients authenticate: the OpenAI SDK itself
(`Authorization: Bearer`); Cartesia's websocket with `?api_key=&cartesia_version=` (Cartesia's SDK,
Pipecat and LiveKit plugins) or the `X-API-Key` + `Cartesia-Version` headers (their HTTP clients);
ElevenLabs' with the `xi-api-key` header (SDK, LiveKit, Pipecat), `?xi_api_key=`, or `xi_api_key` in
the first message (older clients).
"""

from __future__ import annotations

import io
import json
import logging
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import openai
import pytest
import pytest_asyncio
import soundfile
from aiortc import RTCPeerConnection
from testing import LOOPBACK, LiveServer, serve, service_config
from websockets.asyncio.client import ClientConnection, connect
from websockets.exceptions import ConnectionClosed, InvalidStatus

from engines.build.synthetic import voiced_clip
from realtime.access import RedactKeys, presented_key, read_keys
from realtime.config import AccessConfig, LimitsConfig
from realtime.session import ServiceError
from realtime.transports.ice import advertise_only, rtc_configuration
from realtime.transports.webrtc import check_offer

pytestmark = pytest.mark.asyncio(loop_scope="session")

KEY_A = "alpha-key-0123"
KEY_B = "bravo-key-4567"
ALLOWED_ORIGIN = "http://allowed.example"
EVIL_ORIGIN = "http://evil.example"
FIXED = 10
PENDING_OFFERS = 2
SPEECH = {
    "model": "tts-1",
    "voice": "default",
    "input": "Hi.",
    "response_format": "pcm",
    "fixed_length": FIXED,
}


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def keyed(tiny_models: Path, tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[LiveServer]:
    access = AccessConfig(api_keys=(KEY_A, KEY_B), cors_origins=(ALLOWED_ORIGIN,))
    limits = LimitsConfig(pending_offers_per_client=PENDING_OFFERS)
    config = service_config(tiny_models, tmp_path_factory.mktemp("voices"), access=access, limits=limits)
    async with serve(config) as server:
        yield server


def wav_bytes(seconds: float, rate: int = 16000) -> bytes:
    buffer = io.BytesIO()
    soundfile.write(buffer, voiced_clip(seconds, rate, seed=3), rate, format="WAV", subtype="PCM_16")
    return buffer.getvalue()


async def refused_handshake(url: str, **kwargs: object) -> tuple[int, dict]:
    with pytest.raises(InvalidStatus) as caught:
        async with connect(url, **kwargs):  # type: ignore[arg-type]
            pass
    response = caught.value.response
    return response.status_code, json.loads(response.body or b"{}")


async def next_json(ws: ClientConnection, done: object) -> list[dict]:
    received = []
    while True:
        frame = await ws.recv(decode=True)
        message = json.loads(frame)
        received.append(message)
        if done(message):  # type: ignore[operator]
            return received


# -- OpenAI-compatible HTTP, through the OpenAI SDK -------------------------------------------------


async def test_openai_sdk_needs_a_valid_bearer_key(keyed: LiveServer) -> None:
    wrong = openai.AsyncOpenAI(base_url=f"{keyed.http_url}/v1", api_key="not-a-key-999", max_retries=0)
    with pytest.raises(openai.AuthenticationError) as caught:
        await wrong.audio.speech.create(model="tts-1", voice="default", input="Hi.", response_format="pcm")
    assert caught.value.status_code == 401
    assert caught.value.code == "invalid_api_key"
    assert KEY_A not in caught.value.message
    right = openai.AsyncOpenAI(base_url=f"{keyed.http_url}/v1", api_key=KEY_A, max_retries=0)
    audio = await right.audio.speech.create(
        model="tts-1", voice="default", input="Hi.", response_format="pcm", extra_body={"fixed_length": FIXED}
    )
    assert len(audio.content) == FIXED * 960 * 2


async def test_http_without_a_key_is_refused_in_openai_shape(keyed: LiveServer) -> None:
    async with httpx.AsyncClient(base_url=keyed.http_url, timeout=60) as http:
        response = await http.post("/v1/audio/speech", json=SPEECH)
        assert response.status_code == 401
        assert response.json()["error"]["code"] == "missing_api_key"
        assert (await http.get("/v1/voices")).status_code == 401
        # Health, readiness, metrics and the page stay open.
        assert (await http.get("/healthz")).status_code == 200
        assert (await http.get("/readyz")).status_code == 200
        assert (await http.get("/")).status_code == 200


@pytest.mark.parametrize(
    ("headers", "params"),
    [
        ({"X-API-Key": KEY_B, "Cartesia-Version": "2024-06-10"}, {}),
        ({"xi-api-key": KEY_B}, {}),
        ({}, {"api_key": KEY_B}),
    ],
    ids=["x-api-key", "xi-api-key", "api_key-query"],
)
async def test_http_accepts_every_dialects_key_carrier(
    keyed: LiveServer, headers: dict, params: dict
) -> None:
    async with httpx.AsyncClient(base_url=keyed.http_url, timeout=60) as http:
        response = await http.post("/v1/audio/speech", json=SPEECH, headers=headers, params=params)
    assert response.status_code == 200, response.text
    assert len(response.content) == FIXED * 960 * 2


# -- websockets ----------------------------------------------------------------------------------------


async def test_native_ws_refuses_the_handshake_without_a_key(keyed: LiveServer) -> None:
    status, body = await refused_handshake(f"{keyed.ws_url}/v1/ws")
    assert status == 401
    assert body == {
        "type": "error",
        "context_id": None,
        "code": "missing_api_key",
        "message": body["message"],
    }
    status, body = await refused_handshake(f"{keyed.ws_url}/v1/ws?api_key=wrong-key-000")
    assert (status, body["code"]) == (401, "invalid_api_key")


@pytest.mark.parametrize("carrier", ["bearer", "query"])
async def test_native_ws_speaks_with_a_key(keyed: LiveServer, carrier: str) -> None:
    if carrier == "bearer":
        url, headers = f"{keyed.ws_url}/v1/ws", {"Authorization": f"Bearer {KEY_A}"}
    else:
        url, headers = f"{keyed.ws_url}/v1/ws?api_key={KEY_A}", {}
    async with connect(url, additional_headers=headers) as ws:
        await ws.send(json.dumps({"type": "start", "context_id": "c", "fixed_length": FIXED}))
        await ws.send(json.dumps({"type": "text", "context_id": "c", "text": "Hello."}))
        await ws.send(json.dumps({"type": "end", "context_id": "c"}))
        while True:
            frame = await ws.recv()
            if isinstance(frame, str) and json.loads(frame)["type"] in ("done", "error"):
                break
    assert json.loads(frame) == {"type": "done", "context_id": "c", "cancelled": False}


CARTESIA_REQUEST = {
    "context_id": "k",
    "model_id": "sonic-2",
    "transcript": "Hello.",
    "continue": False,
    "voice": {"mode": "id", "id": "default"},
    "output_format": {"container": "raw", "encoding": "pcm_s16le", "sample_rate": 16000},
}


@pytest.mark.parametrize("carrier", ["query", "headers"])
async def test_cartesia_ws_with_the_sdk_key_carriers(keyed: LiveServer, carrier: str) -> None:
    if carrier == "query":
        url = f"{keyed.ws_url}/cartesia/tts/websocket?api_key={KEY_B}&cartesia_version=2024-06-10"
        headers = {}
    else:
        url = f"{keyed.ws_url}/cartesia/tts/websocket"
        headers = {"X-API-Key": KEY_B, "Cartesia-Version": "2024-06-10"}
    async with connect(url, additional_headers=headers) as ws:
        await ws.send(json.dumps(CARTESIA_REQUEST))
        received = await next_json(ws, lambda m: m["type"] in ("done", "error"))
    assert received[-1]["type"] == "done"


async def test_cartesia_ws_refusal_is_in_cartesias_shape(keyed: LiveServer) -> None:
    url = f"{keyed.ws_url}/cartesia/tts/websocket?api_key=wrong-key-000&cartesia_version=2024-06-10"
    status, body = await refused_handshake(url)
    assert status == 401
    assert (
        body["error_code"] == "invalid_api_key" and body["title"] == "Unauthorized"
    )


ELEVEN_INIT = {"text": " ", "voice_settings": {"stability": 0.5, "similarity_boost": 0.8}}


@pytest.mark.parametrize("carrier", ["header", "query", "first_message"])
async def test_elevenlabs_ws_with_each_key_carrier(keyed: LiveServer, carrier: str) -> None:
    base = f"{keyed.ws_url}/v1/text-to-speech/default/stream-input?output_format=pcm_16000"
    url, headers, init = base, {}, dict(ELEVEN_INIT)
    if carrier == "header":
        headers = {"xi-api-key": KEY_A}
    elif carrier == "query":
        url = f"{base}&xi_api_key={KEY_A}"
    else:
        init["xi_api_key"] = KEY_A
    async with connect(url, additional_headers=headers) as ws:
        await ws.send(json.dumps(init))
        await ws.send(json.dumps({"text": "Hello there. "}))
        await ws.send(json.dumps({"text": ""}))
        received = await next_json(ws, lambda m: m.get("isFinal") or "error" in m)
    assert received[-1].get("isFinal") is True, received[-1]
    assert any(m.get("audio") for m in received)


async def test_elevenlabs_ws_bad_first_message_key_gets_an_error_and_1008(keyed: LiveServer) -> None:
    url = f"{keyed.ws_url}/v1/text-to-speech/default/multi-stream-input?output_format=pcm_16000"
    async with connect(url) as ws:
        await ws.send(json.dumps({**ELEVEN_INIT, "xi_api_key": "wrong-key-000"}))
        error = json.loads(await ws.recv())
        with pytest.raises(ConnectionClosed) as closed:
            await ws.recv()
    assert error["error"] == "invalid_api_key"
    assert closed.value.rcvd is not None and closed.value.rcvd.code == 1008
    status, body = await refused_handshake(f"{url}&xi_api_key=wrong-key-000")
    assert status == 401 and body["detail"]["status"] == "invalid_api_key"


# -- WebRTC signalling -------------------------------------------------------------------------------


async def test_webrtc_offer_needs_a_key(keyed: LiveServer) -> None:
    offer = {"sdp": "garbage", "type": "offer"}
    async with httpx.AsyncClient(base_url=keyed.http_url) as http:
        refused = await http.post("/v1/webrtc/offer", json=offer)
        assert refused.status_code == 401 and refused.json()["error"]["code"] == "missing_api_key"
        # With a key the offer reaches signalling, which judges the SDP itself.
        judged = await http.post("/v1/webrtc/offer", json=offer, headers={"Authorization": f"Bearer {KEY_A}"})
    assert judged.status_code == 400 and judged.json()["error"]["code"] == "bad_offer"


# -- voices belong to the key that made them -------------------------------------------------------


async def test_voices_are_owned_by_the_uploading_key(keyed: LiveServer) -> None:
    as_a = {"Authorization": f"Bearer {KEY_A}"}
    as_b = {"Authorization": f"Bearer {KEY_B}"}
    form = {"voice_id": "owned", "transcript": "A short clip."}
    files = {"audio": ("clip.wav", wav_bytes(2.0), "audio/wav")}
    async with httpx.AsyncClient(base_url=keyed.http_url, timeout=60) as http:
        added = await http.post("/v1/voices", data=form, files=files, headers=as_a)
        assert added.status_code == 201, added.text
        replaced = await http.post("/v1/voices", data=form, files=files, headers=as_b)
        assert replaced.status_code == 409 and replaced.json()["error"]["code"] == "voice_exists"
        deleted_by_b = await http.delete("/v1/voices/owned", headers=as_b)
        assert deleted_by_b.status_code == 403 and deleted_by_b.json()["error"]["code"] == "voice_not_owned"
        default = await http.delete("/v1/voices/default", headers=as_a)
        assert default.status_code == 403 and default.json()["error"]["code"] == "voice_protected"
        # Others may still speak with it.
        spoken = await http.post("/v1/audio/speech", json={**SPEECH, "voice": "owned"}, headers=as_b)
        assert spoken.status_code == 200
        assert (await http.delete("/v1/voices/owned", headers=as_a)).status_code == 204
    owner_files = list(keyed.config.voice_store.glob("*.owner"))
    assert owner_files == []


# -- Origin and CORS -------------------------------------------------------------------------------


async def test_cross_site_text_plain_posts_are_refused(keyed: LiveServer) -> None:
    """A page on another site can send `text/plain` POSTs without a preflight; they never act."""
    headers = {"Origin": EVIL_ORIGIN, "Content-Type": "text/plain", "Authorization": f"Bearer {KEY_A}"}
    async with httpx.AsyncClient(base_url=keyed.http_url, timeout=60) as http:
        for path in ("/v1/audio/speech", "/v1/voices", "/v1/webrtc/offer"):
            response = await http.post(path, content=json.dumps(SPEECH), headers=headers)
            assert response.status_code == 403, path
            assert response.json()["error"]["code"] == "origin_not_allowed"
            assert "access-control-allow-origin" not in response.headers
        same_site = {**headers, "Origin": keyed.http_url}
        response = await http.post("/v1/audio/speech", content=json.dumps(SPEECH), headers=same_site)
        assert response.status_code == 200


async def test_cors_allow_list(keyed: LiveServer) -> None:
    async with httpx.AsyncClient(base_url=keyed.http_url, timeout=60) as http:
        preflight = {
            "Access-Control-Request-Method": "POST",
            "Access-Control-Request-Headers": "authorization",
        }
        allowed = await http.options("/v1/audio/speech", headers={"Origin": ALLOWED_ORIGIN, **preflight})
        assert allowed.status_code == 200
        assert allowed.headers["access-control-allow-origin"] == ALLOWED_ORIGIN
        evil = await http.options("/v1/audio/speech", headers={"Origin": EVIL_ORIGIN, **preflight})
        assert "access-control-allow-origin" not in evil.headers
        headers = {"Origin": ALLOWED_ORIGIN, "Authorization": f"Bearer {KEY_A}"}
        response = await http.post("/v1/audio/speech", json=SPEECH, headers=headers)
        assert response.status_code == 200
        assert response.headers["access-control-allow-origin"] == ALLOWED_ORIGIN


@pytest.mark.parametrize(
    "path", ["/v1/ws", "/cartesia/tts/websocket", "/v1/text-to-speech/default/stream-input"]
)
async def test_websockets_check_the_origin(keyed: LiveServer, path: str) -> None:
    headers = {"Authorization": f"Bearer {KEY_A}"}
    status, body = await refused_handshake(
        f"{keyed.ws_url}{path}", origin=EVIL_ORIGIN, additional_headers=headers
    )
    assert status == 403 and "origin_not_allowed" in json.dumps(body)
    async with connect(f"{keyed.ws_url}{path}", origin=keyed.http_url, additional_headers=headers) as ws:
        await ws.ping()


# -- keys never in logs --------------------------------------------------------------------------------


async def test_access_log_lines_have_keys_redacted() -> None:
    """uvicorn's access and websocket log records carry the path with its query string as an argument."""
    record = logging.LogRecord(
        "uvicorn.access",
        logging.INFO,
        __file__,
        1,
        '%s - "%s %s HTTP/%s" %d',
        (
            "127.0.0.1:5",
            "GET",
            f"/cartesia/tts/websocket?api_key={KEY_A}&cartesia_version=2024-06-10",
            "1.1",
            101,
        ),
        None,
    )
    RedactKeys().filter(record)
    line = record.getMessage()
    assert KEY_A not in line and "api_key=***&cartesia_version=2024-06-10" in line
    for name in ("xi_api_key", "authorization", "API_KEY"):
        record.args = ("c", "GET", f"/x?{name}={KEY_B}", "1.1", 200)
        RedactKeys().filter(record)
        assert KEY_B not in record.getMessage()


async def test_key_sources_and_carriers(tmp_path: Path) -> None:
    keys_file = tmp_path / "keys"
    keys_file.write_text(f"# operators\n{KEY_B}\n\n{KEY_A}  # again\n")
    assert read_keys(["cli-key-0000"], keys_file, {"REALTIME_API_KEYS": f"env-key-0000,{KEY_A}"}) == (
        "cli-key-0000",
        KEY_B,
        KEY_A,
        "env-key-0000",
    )
    assert presented_key({"authorization": "Bearer abc"}, {}) == "abc"
    assert presented_key({"x-api-key": "abc"}, {}) == "abc"
    assert presented_key({"xi-api-key": "abc"}, {}) == "abc"
    assert presented_key({}, {"authorization": "Bearer abc"}) == "abc"
    assert presented_key({}, {"xi_api_key": "abc"}) == "abc"
    assert presented_key({}, {}) is None


# -- WebRTC offers that never connect --------------------------------------------------------------


async def real_offer() -> tuple[RTCPeerConnection, str]:
    """An offer as a browser makes it (receive-only audio, a control channel), never completed."""
    pc = RTCPeerConnection(rtc_configuration(()))
    pc.addTransceiver("audio", direction="recvonly")
    pc.createDataChannel("control")
    with advertise_only((LOOPBACK,)):
        await pc.setLocalDescription(await pc.createOffer())
    return pc, pc.localDescription.sdp


async def test_unconnected_offers_are_capped_per_client_not_for_everyone(keyed: LiveServer) -> None:
    as_a = {"Authorization": f"Bearer {KEY_A}"}
    as_b = {"Authorization": f"Bearer {KEY_B}"}
    peers, sessions = [], []
    async with httpx.AsyncClient(base_url=keyed.http_url, timeout=60) as http:
        try:
            for _ in range(PENDING_OFFERS + 1):
                pc, sdp = await real_offer()
                peers.append(pc)
                answer = await http.post("/v1/webrtc/offer", json={"sdp": sdp, "type": "offer"}, headers=as_a)
                if answer.status_code == 200:
                    sessions.append(answer.json()["session_id"])
            assert len(sessions) == PENDING_OFFERS
            assert answer.status_code == 429
            assert answer.json()["error"]["code"] == "too_many_pending_offers"
            # Another client is not locked out.
            pc, sdp = await real_offer()
            peers.append(pc)
            other = await http.post("/v1/webrtc/offer", json={"sdp": sdp, "type": "offer"}, headers=as_b)
            assert other.status_code == 200
            sessions.append(other.json()["session_id"])
            # Closing one frees a slot for its client.
            assert (await http.delete(f"/v1/webrtc/{sessions.pop(0)}", headers=as_a)).status_code == 204
            pc, sdp = await real_offer()
            peers.append(pc)
            again = await http.post("/v1/webrtc/offer", json={"sdp": sdp, "type": "offer"}, headers=as_a)
            assert again.status_code == 200
            sessions.append(again.json()["session_id"])
        finally:
            for session_id in sessions:
                await http.delete(f"/v1/webrtc/{session_id}", headers=as_a)
            for pc in peers:
                await pc.close()


async def test_offers_without_a_dtls_fingerprint_are_refused(keyed: LiveServer) -> None:
    pc, sdp = await real_offer()
    await pc.close()
    stripped = "".join(line for line in sdp.splitlines(keepends=True) if not line.startswith("a=fingerprint"))
    with pytest.raises(ServiceError, match="DTLS fingerprint"):
        check_offer(stripped)
    check_offer(sdp)
    async with httpx.AsyncClient(base_url=keyed.http_url, timeout=60) as http:
        refused = await http.post(
            "/v1/webrtc/offer",
            json={"sdp": stripped, "type": "offer"},
            headers={"Authorization": f"Bearer {KEY_A}"},
        )
    assert refused.status_code == 400 and "DTLS fingerprint" in refused.json()["error"]["message"]
