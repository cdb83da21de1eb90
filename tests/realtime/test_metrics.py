"""`/metrics` reports the peak GPU memory where there is a GPU, in the form `realtime bench` reads."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest
from testing import LiveServer, serve, service_config

from realtime.bench import peak_gpu_memory

pytestmark = pytest.mark.asyncio(loop_scope="session")


async def test_without_a_gpu_there_is_no_peak_memory(live_server: LiveServer) -> None:
    async with httpx.AsyncClient(base_url=live_server.http_url) as http:
        body = (await http.get("/metrics")).text
    assert "tts_active_streams" in body and "realtime_gpu_memory_peak_bytes" not in body
    assert await peak_gpu_memory(live_server.http_url) is None


async def test_bench_reads_the_peak_read_at_each_scrape(tiny_models: Path, tmp_path: Path) -> None:
    peak = [2**30]
    async with serve(service_config(tiny_models, tmp_path)) as server:
        server.runtime.metrics.track_gpu_memory_peak(lambda: peak[0])
        assert await peak_gpu_memory(server.http_url) == 1.0
        peak[0] = 3 * 2**29
        assert await peak_gpu_memory(server.http_url) == 1.5
