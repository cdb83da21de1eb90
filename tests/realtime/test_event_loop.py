"""Heavy text work never holds the event loop: normalising and cutting a long run of numbers (seconds of
wetext and inflect on a CPU) happens after admission, on a worker thread, while the loop keeps
answering; a short text without digits, cheaper than the hop to a thread, is cut on the loop."""

from __future__ import annotations

import asyncio
import threading

import httpx
import pytest

from engines.llm.base import SamplingParams
from realtime.session import SpeechRequest

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


async def test_quick_text_is_cut_on_the_loop_and_other_text_on_a_worker_thread(live_server, monkeypatch):
    frontend = live_server.runtime._running().text
    cut_on: list[tuple[str, int]] = []
    encode_segments = frontend.encode_segments

    def recording(text, *args):
        cut_on.append((text, threading.get_ident()))
        return encode_segments(text, *args)

    monkeypatch.setattr(frontend, "encode_segments", recording)
    texts = ["Thanks for calling, how can I help?", "Your table for 4 is booked.", "Tell me more. " * 20]
    for text in texts:
        request = SpeechRequest(text, sampling=SamplingParams(seed=1, fixed_length=2))
        async with live_server.runtime.speak(request) as session:
            assert sum([chunk.pcm.size async for chunk in session]) > 0
    loop = threading.get_ident()
    assert [text for text, _ in cut_on] == texts
    assert [thread == loop for _, thread in cut_on] == [True, False, False]
