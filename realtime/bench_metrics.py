"""What `realtime bench` (and `realtime synth`, from its own runtime) reads from the server's Prometheus
metrics: samples by name, the engines' work between two readings (`ServerFigures`) and a level's GPU memory
per stream (`MemoryFigures`)."""

from __future__ import annotations

import asyncio
import contextlib
import math
from collections.abc import Sequence
from dataclasses import dataclass

import httpx
from prometheus_client.parser import text_string_to_metric_families


@dataclass
class MemoryFigures:
    """GPU memory of one level, from the server's gauges sampled while it ran.

    stream_bytes: tensors allocated (outside CUDA-graph pools) at the level's busiest sample beyond
    those held before it, per stream (the token2wav streams' caches and the batches' working memory;
    the LLM's KV cache is allocated for every slot at start, `llm_kv_bytes_per_slot`). used_max_bytes:
    the device's memory in use at the busiest sample (graph pools, allocator cache, CUDA context);
    headroom_bytes: the rest of the device; headroom_streams: how many more streams that holds at
    stream_bytes + llm_kv_bytes_per_slot each (an estimate: samples are 0.25 s apart, and transient
    working memory between them is not seen).
    """

    allocated_before_bytes: int
    allocated_max_bytes: int
    stream_bytes: int
    llm_kv_bytes_per_slot: int
    total_bytes: int
    used_max_bytes: int
    headroom_bytes: int
    headroom_streams: int

    @staticmethod
    def of(streams: int, before: dict[str, float], samples: Sequence[dict[str, float]],
           after: dict[str, float]) -> MemoryFigures | None:
        name = "realtime_gpu_memory_allocated_bytes"
        if name not in before or "realtime_gpu_memory_total_bytes" not in after:
            return None
        busiest = max((s.get(name, 0.0) for s in samples), default=before[name])
        per_stream = max(0, int((busiest - before[name]) / max(streams, 1)))
        slots = after.get("tts_llm_slots", 0.0)
        kv_per_slot = int(after.get("tts_llm_kv_bytes_total", 0.0) / slots) if slots else 0
        total = int(after["realtime_gpu_memory_total_bytes"])
        used = int(max((s.get("realtime_gpu_memory_used_bytes", 0.0) for s in [*samples, after]), default=0))
        headroom = max(0, total - used)
        return MemoryFigures(int(before[name]), int(busiest), per_stream, kv_per_slot, total, used, headroom,
                             headroom // max(per_stream + kv_per_slot, 1))


@dataclass
class ServerFigures:
    """What the server's /metrics say about one level: its engines' work between two scrapes."""

    llm_steps: int
    llm_step_ms: float  # mean wall time of an LLM engine step
    token2wav_batches: int
    token2wav_chunks_per_batch: float
    token2wav_batch_ms: float  # mean wall time of one batched call
    token2wav_launch_ms: float  # mean host time of queueing one call's device work
    token2wav_device_wait_ms: float  # mean time the thread then waited for a call's audio
    token2wav_wait_ms: float  # mean time a chunk waited for its call to start
    first_chunk_wait_ms: float  # the same for first-audio chunks only
    later_chunk_wait_ms: float  # and for the others
    calls_with_first_chunks: int  # token2wav calls that held first-audio chunks
    first_chunks_per_call: float  # mean first-audio chunks in those calls
    # Mean time from admission to the speech tokens of a listener's first audio, and to that audio. A
    # websocket context's later texts are left out; servers before 2026-11-28 (r30) counted their sessions
    # too, whose first chunks came while the first text played, so there both read low.
    first_tokens_ms: float
    first_chunk_ms: float
    # the same to that audio written to the websocket (NaN for a server without the metric)
    first_chunk_written_ms: float = math.nan
    # mean new streams whose first chunk had not come yet when such a call started (left for a later call)
    first_chunks_pending: float = math.nan
    later_chunks: int = 0  # chunks after a stream's first audio
    later_chunks_late: int = 0  # of them, audio ready after it was due though the tokens came in time
    later_chunks_tokens_late: int = 0  # of them, tokens that came after the chunk was due
    event_loop_lag_ms: float = math.nan  # how late the server's event loop ran its timers, on average
    event_loop_lag_p99_ms: float = math.nan  # the upper bound of the bucket holding the 99th percentile
    llm_prefill_calls: int = 0  # batched prefill calls of the LLM
    llm_prefill_rows_per_call: float = math.nan  # prompt chunks per such call
    text_ready_ms: float = math.nan  # mean time from admission to the text normalised and tokenised
    # mean time from an LLM submission (every segment's, not only first chunks') to its first token on the
    # host; NaN where the engine does not count it
    llm_first_token_ms: float = math.nan

    @staticmethod
    def between(before: dict[str, float], after: dict[str, float]) -> ServerFigures:
        def delta(name: str) -> float:
            return after.get(name, 0.0) - before.get(name, 0.0)

        def mean(total: str, count: str, scale: float = 1000.0) -> float:
            n = delta(count)
            return delta(total) / n * scale if n else math.nan

        def histogram_mean(name: str, scale: float = 1000.0) -> float:
            return mean(f"{name}_sum", f"{name}_count", scale)

        def histogram_quantile_bound(name: str, q: float, scale: float = 1000.0) -> float:
            prefix = f'{name}_bucket{{le="'
            total = delta(f"{name}_count")
            bounds = sorted((float(key[len(prefix):-2]), key) for key in after if key.startswith(prefix))
            reaching = (bound for bound, key in bounds if total and delta(key) >= q * total)
            return next(reaching, math.nan) * scale

        def waited(chunk: str) -> tuple[str, str]:  # the sum and count samples of one kind of chunk
            return (f'tts_token2wav_wait_seconds_sum{{chunk="{chunk}"}}',
                    f'tts_token2wav_wait_seconds_count{{chunk="{chunk}"}}')

        def later(outcome: str) -> int:
            return int(delta(f'tts_token2wav_later_chunks_total{{outcome="{outcome}"}}'))

        waited_s = sum(delta(waited(chunk)[0]) for chunk in ("first", "later"))
        chunks_waited = sum(delta(waited(chunk)[1]) for chunk in ("first", "later"))

        return ServerFigures(
            llm_steps=int(delta("tts_llm_steps_total")),
            llm_step_ms=mean("tts_llm_step_seconds_total", "tts_llm_steps_total"),
            token2wav_batches=int(delta("tts_token2wav_batch_seconds_count")),
            token2wav_chunks_per_batch=histogram_mean("tts_token2wav_batch_chunks", scale=1.0),
            token2wav_batch_ms=histogram_mean("tts_token2wav_batch_seconds"),
            token2wav_launch_ms=histogram_mean("tts_token2wav_launch_seconds"),
            token2wav_device_wait_ms=histogram_mean("tts_token2wav_device_wait_seconds"),
            token2wav_wait_ms=waited_s / chunks_waited * 1000.0 if chunks_waited else math.nan,
            first_chunk_wait_ms=mean(*waited("first")),
            later_chunk_wait_ms=mean(*waited("later")),
            calls_with_first_chunks=int(delta("tts_token2wav_batch_first_chunks_count")),
            first_chunks_per_call=histogram_mean("tts_token2wav_batch_first_chunks", scale=1.0),
            first_chunks_pending=histogram_mean("tts_token2wav_first_chunks_pending", scale=1.0),
            first_tokens_ms=histogram_mean("tts_first_chunk_tokens_seconds"),
            first_chunk_ms=histogram_mean("tts_first_chunk_latency_seconds"),
            first_chunk_written_ms=histogram_mean("tts_first_chunk_written_seconds"),
            later_chunks=sum(later(outcome) for outcome in ("on_time", "late", "tokens_late")),
            later_chunks_late=later("late"),
            later_chunks_tokens_late=later("tokens_late"),
            event_loop_lag_ms=histogram_mean("realtime_event_loop_lag_seconds"),
            event_loop_lag_p99_ms=histogram_quantile_bound("realtime_event_loop_lag_seconds", 0.99),
            llm_prefill_calls=int(delta("tts_llm_prefill_calls_total")),
            llm_prefill_rows_per_call=mean("tts_llm_prefill_rows_total", "tts_llm_prefill_calls_total",
                                           scale=1.0),
            text_ready_ms=histogram_mean("tts_text_prepare_seconds"),
            llm_first_token_ms=mean("tts_llm_first_token_seconds_total", "tts_llm_first_tokens_total"),
        )


async def scrape(http_url: str, names: Sequence[str] = (), client: httpx.AsyncClient | None = None
                 ) -> dict[str, float]:
    """The server's Prometheus samples (empty if /metrics does not answer): unlabelled ones by name,
    labelled ones as `name{label="value",...}` (labels sorted); only `names` (sample names) if given."""
    try:
        async with contextlib.AsyncExitStack() as stack:
            if client is None:
                client = await stack.enter_async_context(httpx.AsyncClient(timeout=10))
            text = (await client.get(f"{http_url}/metrics", params={"name[]": list(names)})).text
    except httpx.HTTPError:
        return {}
    return parse_samples(text)


def parse_samples(text: str) -> dict[str, float]:
    """The samples of a Prometheus text exposition, named as `scrape` names them (`sample_key`)."""
    return {sample_key(sample.name, sample.labels): sample.value
            for family in text_string_to_metric_families(text) for sample in family.samples}


def sample_key(name: str, labels: dict[str, str]) -> str:
    """How `scrape` names a sample: `name`, or `name{a="1",b="2"}` with its labels sorted."""
    if not labels:
        return name
    return name + "{" + ",".join(f'{key}="{value}"' for key, value in sorted(labels.items())) + "}"


# What `MemoryFigures` reads from the samples taken while a level runs.
SAMPLED_GAUGES = ("realtime_gpu_memory_allocated_bytes", "realtime_gpu_memory_used_bytes")


async def sample_metrics(http_url: str, into: list[dict[str, float]], period_s: float = 0.25) -> None:
    """Scrape the GPU memory gauges every `period_s` into `into` until cancelled. Only those: the whole
    exposition would cost the server's event loop milliseconds a time, and this client's loop as much
    to parse, beside the streams being timed."""
    async with httpx.AsyncClient(timeout=10) as client:
        while True:
            into.append(await scrape(http_url, SAMPLED_GAUGES, client))
            await asyncio.sleep(period_s)


__all__ = ["MemoryFigures", "ServerFigures", "parse_samples", "sample_key", "sample_metrics", "scrape"]
