"""Voice registry over HTTP end to end: add, list, use, delete, bad uploads, and survival across a restart."""

from __future__ import annotations

import io

import httpx
import numpy as np
import pytest
import soundfile
from testing import serve, service_config

from engines.build.synthetic import voiced_clip

pytestmark = pytest.mark.asyncio(loop_scope="session")

FIXED = 25


def wav_bytes(seconds: float, rate: int = 16000) -> bytes:
    buffer = io.BytesIO()
    soundfile.write(buffer, voiced_clip(seconds, rate, seed=5), rate, format="WAV", subtype="PCM_16")
    return buffer.getvalue()


async def upload(
    http: httpx.AsyncClient,
    voice_id: str,
    audio: bytes,
    transcript: str = "A short clip.",
) -> httpx.Response:
    return await http.post(
        "/v1/voices",
        data={"voice_id": voice_id, "transcript": transcript},
        files={"audio": ("clip.wav", audio, "audio/wav")},
    )


async def speak(http: httpx.AsyncClient, voice: str) -> httpx.Response:
    return await http.post(
        "/v1/audio/speech",
        json={
            "model": "tts-1",
            "voice": voice,
            "input": "Hi there.",
            "response_format": "pcm",
            "fixed_length": FIXED,
        },
    )


async def test_add_list_use_delete(live_server):
    async with httpx.AsyncClient(base_url=live_server.http_url, timeout=60) as http:
        added = await upload(http, "alice", wav_bytes(3.0))
        assert added.status_code == 201, added.text
        assert added.json()["voice_id"] == "alice" and added.json()["prompt_seconds"] > 0
        listed = (await http.get("/v1/voices")).json()["data"]
        assert {v["voice_id"]: v["builtin"] for v in listed} == {"alice": False, "default": True}
        spoken = await speak(http, "alice")
        assert spoken.status_code == 200 and len(spoken.content) == FIXED * 960 * 2
        assert (await upload(http, "alice", wav_bytes(3.0))).json()["error"]["code"] == "voice_exists"
        assert (await http.delete("/v1/voices/alice")).status_code == 204
        assert (await speak(http, "alice")).status_code == 404
        assert (await http.delete("/v1/voices/alice")).status_code == 404
        protected = await http.delete("/v1/voices/default")
        assert protected.status_code == 403 and protected.json()["error"]["code"] == "voice_protected"


@pytest.mark.parametrize(
    ("voice_id", "audio", "transcript", "param", "code"),
    [
        ("noise", b"this is not audio at all", "text", "audio", "invalid_audio"),
        ("long", wav_bytes(31.0), "text", "audio", "audio_too_long"),
        ("short", wav_bytes(0.3), "text", "audio", "audio_too_short"),
        ("../../etc", wav_bytes(2.0), "text", "voice_id", "invalid_voice_id"),
        ("quiet", wav_bytes(2.0), "  ", "transcript", "missing_transcript"),
    ],
)
async def test_bad_uploads_are_refused_clearly(live_server, voice_id, audio, transcript, param, code):
    async with httpx.AsyncClient(base_url=live_server.http_url, timeout=60) as http:
        response = await upload(http, voice_id, audio, transcript)
        assert response.status_code == 400
        error = response.json()["error"]
        assert (error["param"], error["code"]) == (param, code) and error["message"]
        assert voice_id not in {v["voice_id"] for v in (await http.get("/v1/voices")).json()["data"]}


async def test_upload_must_be_multipart(live_server):
    async with httpx.AsyncClient(base_url=live_server.http_url) as http:
        response = await http.post("/v1/voices", json={"voice_id": "x"})
    assert response.status_code == 400 and response.json()["error"]["code"] == "invalid_content_type"


async def test_voices_survive_a_restart(tiny_models, tmp_path):
    config = service_config(tiny_models, tmp_path / "voices")
    async with serve(config) as server, httpx.AsyncClient(base_url=server.http_url, timeout=60) as http:
        assert (await upload(http, "bob", wav_bytes(2.5))).status_code == 201
    assert (tmp_path / "voices" / "bob.safetensors").is_file()
    async with serve(config) as server, httpx.AsyncClient(base_url=server.http_url, timeout=60) as http:
        assert "bob" in {v["voice_id"] for v in (await http.get("/v1/voices")).json()["data"]}
        spoken = await speak(http, "bob")
        assert spoken.status_code == 200 and np.frombuffer(spoken.content, "<i2").size == FIXED * 960
