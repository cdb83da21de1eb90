"""`/metrics` reports what a dashboard and `realtime bench` read: the peak GPU memory where there is a
GPU, the LLM engine's steps and the token2wav worker's batches."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest
from testing import LiveServer, serve, service_config

from realtime.bench import run_level, scrape

pytestmark = pytest.mark.asyncio(loop_scope="session")
GIB = 2**30


async def test_without_a_gpu_there_is_no_peak_memory(live_server: LiveServer) -> None:
    async with httpx.AsyncClient(base_url=live_server.http_url) as http:
        body = (await http.get("/metrics")).text
    assert "tts_active_streams" in body and "realtime_gpu_memory_peak_bytes" not in body
    assert "realtime_gpu_memory_peak_bytes" not in await scrape(live_server.http_url)


async def test_bench_reads_the_peak_read_at_each_scrape(tiny_models: Path, tmp_path: Path) -> None:
    peaks = {"cuda:0": GIB}
    async with serve(service_config(tiny_models, tmp_path)) as server:
        server.runtime.metrics.track_gpu_memory_peak(lambda: peaks)
        assert (await scrape(server.http_url))["realtime_gpu_memory_peak_bytes"] == GIB
        peaks["cuda:1"] = GIB // 2  # a second GPU: the figure is the sum, each GPU also has its own
        assert (await scrape(server.http_url))["realtime_gpu_memory_peak_bytes"] == 3 * GIB // 2
        async with httpx.AsyncClient(base_url=server.http_url) as http:
            metrics = (await http.get("/metrics")).text
        assert 'tts_gpu_memory_peak_bytes{device="cuda:1"} 5.36870912e+08' in metrics


async def test_a_bench_level_reports_the_engines_work(live_server: LiveServer) -> None:
    level = await run_level(f"{live_server.ws_url}/v1/ws", streams=2, tokens=60, voice="default")
    assert level.errors == 0, level.error_codes
    assert level.ok == 2 and level.server is not None
    figures = level.server
    # 60 tokens per stream: at least 60 decode steps, and the schedule's chunks (18, then 42) per stream.
    assert figures.llm_steps >= 60 and figures.llm_step_ms > 0
    assert figures.token2wav_batches >= 2 and 1 <= figures.token2wav_chunks_per_batch <= 2
    assert figures.token2wav_batch_ms > 0 and figures.token2wav_wait_ms >= 0
    assert 0 < figures.first_tokens_ms < figures.first_chunk_ms
    assert (await scrape(live_server.http_url))["tts_llm_active_requests"] == 0
