"""Health, readiness and Prometheus metrics of the live server."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest
from websockets.asyncio.client import connect

pytestmark = pytest.mark.asyncio(loop_scope="session")


async def test_health_and_readiness(live_server):
    async with httpx.AsyncClient(base_url=live_server.http_url) as http:
        assert (await http.get("/healthz")).json() == {"status": "ok"}
        ready = await http.get("/readyz")
        assert ready.status_code == 200 and ready.json() == {"status": "ready", "warming_up": False}


async def test_metrics_count_latency_and_errors(live_server):
    async with httpx.AsyncClient(base_url=live_server.http_url, timeout=60) as http:
        spoken = await http.post(
            "/v1/audio/speech",
            json={"model": "tts-1", "input": "Measure me.", "response_format": "pcm", "fixed_length": 20},
        )
        assert spoken.status_code == 200
        assert (
            await http.post("/v1/audio/speech", json={"input": "hi", "voice": "nobody"})
        ).status_code == 404
        text = (await http.get("/metrics")).text
    samples = {
        line.split(" ")[0]: float(line.split(" ")[1])
        for line in text.splitlines()
        if line and not line.startswith("#")
    }
    assert samples["tts_first_chunk_latency_seconds_count"] >= 1
    assert samples["tts_real_time_factor_count"] >= 1
    assert samples["tts_audio_seconds_total"] >= 20 * 0.04
    assert samples["tts_active_streams"] == 0
    assert "tts_token2wav_queue_depth" in samples
    assert samples['tts_errors_total{code="voice_not_found"}'] >= 1


async def test_a_contexts_first_audio_is_counted_once_however_many_texts_it_speaks(live_server):
    """Two sentences in one context are two sessions, but the client hears one first audio: the first
    audio's histograms (its tokens, its audio, its bytes written) count it once."""
    registry = live_server.runtime.metrics.registry
    names = ("tts_first_chunk_tokens_seconds", "tts_first_chunk_latency_seconds",
             "tts_first_chunk_written_seconds")

    def counts() -> list[float]:
        return [registry.get_sample_value(f"{name}_count") or 0.0 for name in names]

    def sessions_done() -> float:
        return registry.get_sample_value("tts_real_time_factor_count") or 0.0

    before, finished = counts(), sessions_done()
    async with connect(f"{live_server.ws_url}/v1/ws") as ws:
        await ws.send(json.dumps({"type": "start", "context_id": "two", "fixed_length": 2, "seed": 1}))
        await ws.send(json.dumps({"type": "text", "context_id": "two", "text": "First one. Then another."}))
        await ws.send(json.dumps({"type": "end", "context_id": "two"}))
        async with asyncio.timeout(60):
            async for frame in ws:
                if isinstance(frame, str) and json.loads(frame)["type"] == "done":
                    break
    assert sessions_done() - finished == 2
    assert [after - first for after, first in zip(counts(), before, strict=True)] == [1, 1, 1]
