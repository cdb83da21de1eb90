"""Cartesia's HTTP routes at the edge: formats, refusals with Cartesia's error shape, and the dialect's
speed mapping."""

from __future__ import annotations

import httpx
import pytest

from realtime.protocol.cartesia import speed_of
from realtime.protocol.core import ProtocolError

SESSION_LOOP = pytest.mark.asyncio(loop_scope="session")


def body(**overrides: object) -> dict[str, object]:
    request: dict[str, object] = {
        "model_id": "sonic-3", "transcript": "Hello there.", "voice": {"mode": "id", "id": "default"},
        "output_format": {"container": "raw", "encoding": "pcm_mulaw", "sample_rate": 8000},
    }
    request.update(overrides)
    return request


@SESSION_LOOP
async def test_raw_bytes_in_the_requested_encoding(live_server) -> None:
    async with httpx.AsyncClient(base_url=f"{live_server.http_url}/cartesia", timeout=60) as client:
        response = await client.post("/tts/bytes", json=body(), headers={"Cartesia-Version": "2026-03-01"})
    assert response.status_code == 200 and response.headers["content-type"] == "audio/basic"
    assert len(response.content) / 8000 > 0.2  # one byte per µ-law sample


@SESSION_LOOP
@pytest.mark.parametrize(
    ("route", "overrides", "status", "code"),
    [
        ("bytes", {"voice": {"mode": "id", "id": "nobody"}}, 404, "voice_not_found"),
        ("bytes", {"output_format": {"container": "ogg"}}, 400, "unsupported_encoding"),
        ("bytes", {"output_format": {"container": "raw", "sample_rate": 12345}}, 400,
         "unsupported_sample_rate"),
        ("bytes", {"generation_config": {"speed": 9}}, 400, "invalid_speed"),
        ("bytes", {"transcript": 3}, 400, "invalid_message"),
        ("sse", {"output_format": {"container": "wav", "encoding": "pcm_s16le", "sample_rate": 8000}}, 400,
         "unsupported_encoding"),
    ],
)
async def test_refusals_say_why(live_server, route: str, overrides: dict, status: int, code: str) -> None:
    async with httpx.AsyncClient(base_url=f"{live_server.http_url}/cartesia", timeout=60) as client:
        response = await client.post(f"/tts/{route}", json=body(**overrides))
        assert response.status_code == status
        error = response.json()
        assert error["error_code"] == code and error["message"]
        bad_json = await client.post("/tts/bytes", content=b"{not json")
    assert bad_json.status_code == 400 and bad_json.json()["error_code"] == "invalid_json"


def test_speed_is_generation_config_speed_or_the_older_scale() -> None:
    assert speed_of({"generation_config": {"speed": 1.5}}) == 1.5
    assert speed_of({}) == 1.0
    assert speed_of({"speed": "fastest"}) == 2.0
    assert speed_of({"speed": -1}) == 0.5
    with pytest.raises(ProtocolError) as refused:
        speed_of({"speed": "warp"})
    assert refused.value.code == "invalid_speed"
