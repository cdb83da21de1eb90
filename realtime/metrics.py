"""Prometheus metrics of one service instance (its own registry, so several apps can share a process)."""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from prometheus_client.registry import Collector

from engines.llm.base import LLMStats

LATENCY_BUCKETS = (0.05, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 1.5, 2.0, 3.0, 5.0, 10.0)
RTF_BUCKETS = (0.05, 0.1, 0.2, 0.3, 0.5, 0.75, 1.0, 1.5, 2.0, 5.0)
BATCH_SECONDS_BUCKETS = (0.005, 0.01, 0.02, 0.03, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 1.0, 2.0)
BATCH_CHUNKS_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)


class Metrics:
    """The service's metrics; `render()` is the `/metrics` body."""

    content_type = CONTENT_TYPE_LATEST

    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self.first_chunk_latency = Histogram(
            "tts_first_chunk_latency_seconds",
            "Time from an admitted request to its first audio chunk",
            buckets=LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.first_chunk_tokens = Histogram(
            "tts_first_chunk_tokens_seconds",
            "Time from an admitted request to the speech tokens of its first chunk (the LLM's share of the "
            "first chunk latency)",
            buckets=LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.real_time_factor = Histogram(
            "tts_real_time_factor",
            "Synthesis wall time divided by audio duration, per finished stream",
            buckets=RTF_BUCKETS,
            registry=self.registry,
        )
        self.active_streams = Gauge("tts_active_streams", "Streams being synthesised", registry=self.registry)
        self.queue_depth = Gauge(
            "tts_token2wav_queue_depth",
            "Chunks waiting for the token2wav worker",
            registry=self.registry,
        )
        self.token2wav_batch_seconds = Histogram(
            "tts_token2wav_batch_seconds",
            "Wall time of one batched token2wav call (all its chunks, audio copied to the host)",
            buckets=BATCH_SECONDS_BUCKETS,
            registry=self.registry,
        )
        self.token2wav_batch_chunks = Histogram(
            "tts_token2wav_batch_chunks",
            "Chunks (one per stream) in one batched token2wav call",
            buckets=BATCH_CHUNKS_BUCKETS,
            registry=self.registry,
        )
        self.token2wav_wait_seconds = Histogram(
            "tts_token2wav_wait_seconds",
            "Time from a chunk's submission to the start of the token2wav call that runs it",
            buckets=BATCH_SECONDS_BUCKETS,
            registry=self.registry,
        )
        self.audio_seconds = Counter("tts_audio_seconds", "Audio produced", registry=self.registry)
        self.errors = Counter(
            "tts_errors", "Errors reported to clients, by code", ["code"], registry=self.registry
        )

    def track_gpu_memory_peak(self, read_peak_bytes: Callable[[], int]) -> None:
        """Report `realtime_gpu_memory_peak_bytes`, read at every scrape (the benchmark's memory figure).

        Registered only where there is a GPU; without one the metric is absent.
        """
        self.registry.register(_PeakMemoryCollector(read_peak_bytes))

    def track_llm(self, read_stats: Callable[[], LLMStats]) -> None:
        """Report the LLM engine's requests, cache use and steps, read at every scrape."""
        self.registry.register(_LLMCollector(read_stats))

    def error(self, code: str) -> None:
        self.errors.labels(code=code).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)


class _PeakMemoryCollector(Collector):
    """The peak device memory, read when scraped rather than polled."""

    def __init__(self, read_peak_bytes: Callable[[], int]) -> None:
        self._read = read_peak_bytes

    def describe(self) -> list[GaugeMetricFamily]:
        return [self._family()]

    def collect(self) -> Iterator[GaugeMetricFamily]:
        family = self._family()
        family.add_metric([], float(self._read()))
        yield family

    @staticmethod
    def _family() -> GaugeMetricFamily:
        return GaugeMetricFamily(
            "realtime_gpu_memory_peak_bytes",
            "Peak GPU memory held by PyTorch tensors since the start (allocations TensorRT makes itself "
            "are not counted)",
        )


class _LLMCollector(Collector):
    """The LLM engine's figures, read from its stats when scraped."""

    def __init__(self, read_stats: Callable[[], LLMStats]) -> None:
        self._read = read_stats

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        stats = self._read()
        yield GaugeMetricFamily("tts_llm_active_requests", "Requests holding an LLM slot", value=stats.active)
        yield GaugeMetricFamily("tts_llm_waiting_requests", "Requests waiting for an LLM slot",
                                value=stats.waiting)
        yield GaugeMetricFamily("tts_llm_kv_tokens_used", "KV cache positions in use",
                                value=stats.kv_tokens_used)
        yield GaugeMetricFamily("tts_llm_kv_tokens_total", "KV cache positions the engine holds",
                                value=stats.kv_tokens_total)
        yield CounterMetricFamily("tts_llm_steps", "LLM engine steps (batched decode and/or prefill)",
                                  value=stats.steps)
        yield CounterMetricFamily("tts_llm_step_seconds", "Wall time of the LLM engine's steps",
                                  value=stats.step_seconds)
