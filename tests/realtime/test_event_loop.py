"""Heavy text work never holds the event loop: normalising and cutting a long run of numbers (seconds of
wetext and inflect on a CPU) happens after admission, on a worker thread, while the loop keeps
answering."""

from __future__ import annotations

import asyncio

import httpx
import pytest

pytestmark = pytest.mark.asyncio(loop_scope="session")


async def test_healthz_is_answered_while_a_long_number_is_normalised(live_server, eventually):
    runtime = live_server.runtime
    digits = " ".join(["12345"] * (live_server.config.max_text_chars // 6))
    body = {"input": digits, "response_format": "pcm", "fixed_length": 2}
    async with httpx.AsyncClient(base_url=live_server.http_url, timeout=120) as http:
        speech = asyncio.create_task(http.post("/v1/audio/speech", json=body))
        # Admitted, and its text not yet cut into segments (no text tokens yet).
        await eventually(lambda: any(s.usage.text_tokens == 0 for s in runtime._sessions))
        health = await http.get("/healthz")
        assert health.status_code == 200 and health.json() == {"status": "ok"}
        assert any(s.usage.text_tokens == 0 for s in runtime._sessions), "the text was cut meanwhile"
        response = await speech
    assert response.status_code == 200 and len(response.content) > 0
