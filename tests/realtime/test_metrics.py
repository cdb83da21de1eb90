"""`/metrics` reports what a dashboard and `realtime bench` read: the peak GPU memory where there is a
GPU, the LLM engine's steps and the token2wav worker's batches."""

from __future__ import annotations

import gc
import re
from pathlib import Path

import httpx
import pytest
from testing import LiveServer, serve, service_config

from realtime.bench import (
    LevelResult,
    Player,
    StreamResult,
    UnderrunGaps,
    format_level,
    largest_without_underrun,
    request_tokens,
    run_level,
    run_staggered,
    run_streams,
)
from realtime.bench import _outcomes as outcomes
from realtime.bench_metrics import scrape
from realtime.gc_pauses import GcPauses
from realtime.metrics import Metrics

pytestmark = pytest.mark.asyncio(loop_scope="session")
GIB = 2**30


async def test_without_a_gpu_there_is_no_peak_memory(live_server: LiveServer) -> None:
    async with httpx.AsyncClient(base_url=live_server.http_url) as http:
        body = (await http.get("/metrics")).text
    assert "tts_active_streams" in body and "realtime_gpu_memory_peak_bytes" not in body
    assert "realtime_gpu_memory_peak_bytes" not in await scrape(live_server.http_url)


async def test_metrics_named_in_the_query_are_the_only_ones_rendered(live_server: LiveServer) -> None:
    """Prometheus' `name[]` parameters: the bench's sampler polls two gauges four times a second without
    the whole exposition's cost; names the service does not have give an empty body, not an error."""
    async with httpx.AsyncClient(base_url=live_server.http_url) as http:
        whole = await http.get("/metrics")
        some = await http.get("/metrics", params={"name[]": ["tts_active_streams", "tts_llm_slots"]})
        none = await http.get("/metrics", params={"name[]": "no_such_metric"})
    families = set(re.findall(r"^# TYPE (\S+)", some.text, re.MULTILINE))
    assert some.status_code == 200 and families == {"tts_active_streams", "tts_llm_slots"}
    assert len(set(re.findall(r"^# TYPE (\S+)", whole.text, re.MULTILINE))) > 10
    assert none.status_code == 200 and none.text == ""
    sampled = await scrape(live_server.http_url, ["tts_active_streams"])
    assert list(sampled) == ["tts_active_streams"]


async def test_name_filtered_metrics_match_prometheus_clients_own_exposition() -> None:
    """The `name[]` convention as prometheus_client's own exposition app serves it, on the same registry."""
    from prometheus_client import make_asgi_app

    metrics = Metrics()
    metrics.first_chunk_latency.observe(0.2)
    metrics.audio_seconds.inc(3.0)
    names = ["tts_first_chunk_latency_seconds_count", "tts_audio_seconds_total", "no_such_metric"]
    transport = httpx.ASGITransport(app=make_asgi_app(registry=metrics.registry, disable_compression=True))
    async with httpx.AsyncClient(transport=transport, base_url="http://prometheus") as http:
        reference = await http.get("/", params={"name[]": names})
    assert reference.status_code == 200 and "tts_audio_seconds_total 3.0" in reference.text
    assert metrics.render(names).decode() == reference.text


async def test_collections_are_counted_by_generation_while_watching() -> None:
    pauses = GcPauses()
    callbacks = len(gc.callbacks)
    with pauses.watching():
        assert len(gc.callbacks) == callbacks + 1
        gc.collect(0)
        gc.collect(2)
    gc.collect(2)  # not watching any more: not counted
    assert sum(pauses.counts[0]) >= 1 and sum(pauses.counts[2]) >= 1
    assert pauses.seconds[2] > 0 and len(gc.callbacks) == callbacks


async def test_a_service_freezes_its_start_s_objects_and_reports_collections(
    tiny_models: Path, tmp_path: Path,
) -> None:
    """While a service runs, what its start made is out of garbage collection (gc.freeze) and /metrics
    counts collections and their pauses by generation; at stop the objects are back and the callback gone."""
    callbacks = len(gc.callbacks)
    frozen_before = gc.get_freeze_count()  # the session's live server may have frozen already

    def full_collections(metrics: str) -> float:
        counted = re.search(r'^realtime_gc_pause_seconds_count\{generation="2"\} (\S+)$', metrics, re.M)
        assert counted is not None
        return float(counted.group(1))

    async with serve(service_config(tiny_models, tmp_path)) as server:
        assert gc.get_freeze_count() > 0 and len(gc.callbacks) == callbacks + 1
        async with httpx.AsyncClient(base_url=server.http_url) as http:
            before = (await http.get("/metrics")).text
            gc.collect(2)
            after = (await http.get("/metrics")).text
    assert full_collections(after) >= full_collections(before) + 1
    assert 'realtime_gc_pause_seconds_bucket{generation="0",le="+Inf"}' in after
    # Its stop leaves the process as it found it: another service's freeze stays.
    assert (gc.get_freeze_count() > 0) == (frozen_before > 0) and len(gc.callbacks) == callbacks


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
    # Both prompts prefilled (each one chunk), in one call or two.
    assert 1 <= figures.llm_prefill_calls <= 2
    assert figures.llm_prefill_calls * figures.llm_prefill_rows_per_call == 2
    assert figures.token2wav_batches >= 2 and 1 <= figures.token2wav_chunks_per_batch <= 2
    assert figures.token2wav_batch_ms > 0 and figures.token2wav_wait_ms >= 0
    # A call's time is its launch on the host, then its wait for the device (none on the CPU).
    assert 0 < figures.token2wav_launch_ms <= figures.token2wav_batch_ms
    assert 0 <= figures.token2wav_device_wait_ms < figures.token2wav_batch_ms
    # The server's event loop timer (every 50 ms) ran during the level: its lateness is reported.
    assert figures.event_loop_lag_ms >= 0 and figures.event_loop_lag_p99_ms > 0
    assert figures.first_chunk_wait_ms >= 0 and figures.later_chunk_wait_ms >= 0
    # Both streams' first chunks ran, in one call or two; every call with first chunks is counted.
    assert 1 <= figures.calls_with_first_chunks <= 2
    assert figures.first_chunks_per_call * figures.calls_with_first_chunks == 2
    # In one call no first chunk was left behind; in two, the first call left at most the other (0.5 a call).
    assert figures.first_chunks_pending in ((0.0, 0.5) if figures.calls_with_first_chunks == 2 else (0.0,))
    assert "new streams' still to come" in format_level(level)[1]
    assert 0 < figures.first_tokens_ms < figures.first_chunk_ms
    # The first chunk's timeline: text ready, then the engine's first token (timed from its submission,
    # after the text), then the chunk's tokens.
    assert 0 < figures.text_ready_ms < figures.first_tokens_ms
    assert 0 < figures.llm_first_token_ms < figures.first_tokens_ms - figures.text_ready_ms
    assert "text ready at" in format_level(level)[1]
    # The clients' mean first audio beside the server's: at least the server's (the request's way in and
    # the audio's way out are on top), within the clients' spread.
    assert level.first_chunk_p50_ms <= level.first_chunk_p99_ms
    assert figures.first_chunk_ms < level.first_chunk_mean_ms <= level.first_chunk_p99_ms
    assert "(the clients' at" in format_level(level)[1]
    # Each stream's second chunk is a later chunk, ready on time or not (counted either way).
    assert figures.later_chunks >= 2
    assert figures.later_chunks_late + figures.later_chunks_tokens_late <= figures.later_chunks
    assert (await scrape(live_server.http_url))["tts_llm_active_requests"] == 0


async def test_later_chunks_are_told_by_what_made_them_late() -> None:
    metrics = Metrics()
    metrics.later_chunk_ready(due=10.0, submitted=9.0, ready=9.5)  # on time
    metrics.later_chunk_ready(due=10.0, submitted=9.0, ready=10.2)  # tokens in time, token2wav late
    metrics.later_chunk_ready(due=10.0, submitted=10.1, ready=10.2)  # tokens after due
    body = metrics.render().decode()
    for outcome in ("on_time", "late", "tokens_late"):
        assert f'tts_token2wav_later_chunks_total{{outcome="{outcome}"}} 1.0' in body


async def test_a_bench_level_reports_memory_per_stream(tiny_models: Path, tmp_path: Path) -> None:
    """The gauges the bench samples: streams' tensors beyond those held before, the device's use."""
    allocated = [GIB]
    async with serve(service_config(tiny_models, tmp_path)) as server:
        server.runtime.metrics.track_gpu_memory(lambda: allocated[0], lambda: (5 * GIB, 8 * GIB))
        metrics = await scrape(server.http_url)
        assert metrics["realtime_gpu_memory_allocated_bytes"] == GIB
        assert metrics["realtime_gpu_memory_used_bytes"] == 3 * GIB
        assert metrics["realtime_gpu_memory_total_bytes"] == 8 * GIB
        assert metrics["tts_llm_slots"] >= 1
        level = await run_level(f"{server.ws_url}/v1/ws", streams=2, tokens=30, voice="default")
    assert level.errors == 0 and level.memory is not None
    assert level.memory.total_bytes == 8 * GIB and level.memory.headroom_bytes == 5 * GIB
    assert level.memory.allocated_before_bytes == GIB and level.memory.stream_bytes == 0


async def test_spread_requests_speak_their_own_lengths(live_server: LiveServer) -> None:
    """--tokens-spread: each stream asks for its own seeded length within the spread, and gets that
    much audio (so utterances end in final chunks of many lengths, as real traffic does)."""
    lengths = [request_tokens(40, 0.5, i) for i in range(3)]
    assert lengths == [request_tokens(40, 0.5, i) for i in range(3)]  # the same on both sides of an A/B
    assert len(set(lengths)) == 3 and all(20 <= n <= 60 for n in lengths)
    assert request_tokens(40, 0.0, 7) == 40
    results = await run_streams(f"{live_server.ws_url}/v1/ws", 3, 40, "default", spread=0.5)
    assert [r.error for r in results] == [None] * 3
    # 25 tokens per second of audio, for each sentence of the stream's text.
    assert all(round(r.audio_s * 25) % n == 0 for r, n in zip(results, lengths, strict=True))


async def test_staggered_arrivals_are_measured(live_server: LiveServer) -> None:
    """Poisson arrivals at a fraction of a given capacity: each one a full stream on its own socket."""
    # 2 arrivals a second of 1 s of audio each (3 with this seed): within the server's 4 streams.
    load = await run_staggered(f"{live_server.ws_url}/v1/ws", fraction=0.5, capacity=4, duration_s=1.0,
                               tokens=25, voice="default", seed=3)
    assert load.rate_per_s == pytest.approx(2.0) and load.offered_streams == pytest.approx(2.0)
    assert load.arrivals >= 1 and load.errors == 0, load.error_codes
    assert load.ok == load.arrivals and 1 <= load.max_in_flight <= load.arrivals
    assert 0 < load.first_chunk_p50_ms <= load.first_chunk_p99_ms


async def test_a_bench_level_reports_refusals_by_code(tiny_models: Path, tmp_path: Path) -> None:
    async with serve(service_config(tiny_models, tmp_path, max_streams=1)) as server:
        level = await run_level(f"{server.ws_url}/v1/ws", streams=3, tokens=60, voice="default")
    assert (level.ok, level.errors, level.error_codes) == (1, 2, {"busy": 2})
    assert "errors: 2 busy" in format_level(level)[1]


async def test_failures_after_audio_began_are_told_apart_from_refusals() -> None:
    done = StreamResult(first_chunk_s=0.05, total_s=1.0, audio_s=2.0)
    refused = StreamResult(error="busy")
    cut_off = StreamResult(first_chunk_s=0.05, error="busy")
    ok, errors = outcomes([done, refused, cut_off, refused])
    assert ok == [done]
    assert errors == {"busy": 2, "busy after audio": 1}


async def test_the_player_tells_where_in_the_audio_it_ran_dry() -> None:
    player = Player()
    player.receive(0.0, 0.44)  # first audio; plays until 0.44
    player.receive(0.40, 1.0)  # in time; plays until 1.44
    player.receive(1.50, 2.0)  # 60 ms late, after 1.44 s of audio
    player.receive(3.54, 1.0)  # plays until 3.50 (3.44 s of audio + 0.06 s waited): 40 ms late
    assert player.underruns == 2
    assert [(round(at, 2), round(wait, 3)) for at, wait in player.gaps] == [(1.44, 0.06), (3.44, 0.04)]
    gaps = UnderrunGaps.by_position([*player.gaps, (1.46, 0.02)])
    assert list(gaps) == ["1.4", "1.5", "3.4"]
    assert (gaps["1.4"].count, round(gaps["1.4"].wait_max_ms)) == (1, 60)


async def test_the_search_asks_every_count_to_pass_several_bursts_in_a_row() -> None:
    """Near the edge one burst passes or fails by chance: with repeats, a count passes only when every
    one of its bursts runs without underrun or error."""
    flaky = {110: [0, 7]}  # underran streams per burst of that count; others below 112 never underrun
    bursts: list[int] = []

    async def measure(streams: int) -> LevelResult:
        bursts.append(streams)
        runs = flaky.get(streams, [])
        underran = runs[sum(1 for b in bursts if b == streams) - 1] if runs else int(streams >= 112)
        return LevelResult(streams, streams, 0, 1.0, 1.0, 1.0, 1.0, 0.1, underran, underran, 0.0, 1.0, 1.0)

    assert await largest_without_underrun(measure, 100, 120, repeats=1) == 111
    bursts.clear()
    assert await largest_without_underrun(measure, 100, 120, repeats=2) == 109
    assert bursts.count(110) == 2  # its first burst passed, its second did not
