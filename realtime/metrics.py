"""Prometheus metrics of one service instance (its own registry, so several apps can share a process)."""

from __future__ import annotations

import itertools
from collections.abc import Callable, Collection, Iterator

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from prometheus_client.registry import Collector

from engines.llm.base import LLMStats
from realtime.gc_pauses import PAUSE_BUCKETS, GcPauses
from realtime.placement import WorkerLoad

LATENCY_BUCKETS = (0.05, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 1.5, 2.0, 3.0, 5.0, 10.0)
RTF_BUCKETS = (0.05, 0.1, 0.2, 0.3, 0.5, 0.75, 1.0, 1.5, 2.0, 5.0)
BATCH_SECONDS_BUCKETS = (0.005, 0.01, 0.02, 0.03, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 1.0, 2.0)
HOST_SECONDS_BUCKETS = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5)
BATCH_CHUNKS_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
LOOP_LAG_BUCKETS = (0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0)


class Metrics:
    """The service's metrics; `render()` is the `/metrics` body."""

    content_type = CONTENT_TYPE_LATEST

    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self.first_chunk_latency = Histogram(
            "tts_first_chunk_latency_seconds",
            "Time from an admitted request to its listener's first audio (a websocket context's later texts, "
            "which follow audio already playing, are left out)",
            buckets=LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.first_chunk_written = Histogram(
            "tts_first_chunk_written_seconds",
            "Time from a websocket context's first admitted request to the context's first audio written to "
            "the socket (a context's later texts are left out: their first audio follows the audio before)",
            buckets=LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.text_prepared = Histogram(
            "tts_text_prepare_seconds",
            "Time from an admitted request to its text normalised, cut and tokenised (the front-end's share "
            "of the first chunk latency)",
            buckets=HOST_SECONDS_BUCKETS,
            registry=self.registry,
        )
        self.first_chunk_tokens = Histogram(
            "tts_first_chunk_tokens_seconds",
            "Time from an admitted request to the speech tokens of its listener's first audio (the LLM's "
            "share of tts_first_chunk_latency_seconds)",
            buckets=LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.real_time_factor = Histogram(
            "tts_real_time_factor",
            "Synthesis wall time divided by audio duration, per finished stream",
            buckets=RTF_BUCKETS,
            registry=self.registry,
        )
        self.event_loop_lag = Histogram(
            "realtime_event_loop_lag_seconds",
            "How late the event loop ran a timer due every 50 ms (realtime/loop_lag.py)",
            buckets=LOOP_LAG_BUCKETS,
            registry=self.registry,
        )
        self.active_streams = Gauge("tts_active_streams", "Streams being synthesised", registry=self.registry)
        self.token2wav_open_streams = Gauge(
            "tts_token2wav_open_streams",
            "token2wav streams open on the worker threads (their caches held)",
            registry=self.registry,
        )
        self.token2wav_warmups_running = Gauge(
            "tts_token2wav_warmups_running",
            "token2wav workers still warming up between calls (shapes not captured yet run eagerly)",
            registry=self.registry,
        )
        self.token2wav_warmup_step_seconds = Histogram(
            "tts_token2wav_warmup_step_seconds",
            "Wall time of one warm-up step run between calls (a call arriving meanwhile waits for it)",
            buckets=BATCH_SECONDS_BUCKETS,
            registry=self.registry,
        )
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
        self.token2wav_launch_seconds = Histogram(
            "tts_token2wav_launch_seconds",
            "Host time of queueing one token2wav call's device work (bookkeeping, copies, launches)",
            buckets=HOST_SECONDS_BUCKETS,
            registry=self.registry,
        )
        self.token2wav_device_wait_seconds = Histogram(
            "tts_token2wav_device_wait_seconds",
            "Time a token2wav thread waited for a launched call's audio (near 0: the host, not the device, "
            "was the slower side)",
            buckets=HOST_SECONDS_BUCKETS,
            registry=self.registry,
        )
        self.token2wav_batch_chunks = Histogram(
            "tts_token2wav_batch_chunks",
            "Chunks (one per stream) in one batched token2wav call",
            buckets=BATCH_CHUNKS_BUCKETS,
            registry=self.registry,
        )
        self.token2wav_batch_first_chunks = Histogram(
            "tts_token2wav_batch_first_chunks",
            "First-audio chunks in one batched token2wav call, observed for the calls that hold any",
            buckets=BATCH_CHUNKS_BUCKETS,
            registry=self.registry,
        )
        self.token2wav_first_chunks_pending = Histogram(
            "tts_token2wav_first_chunks_pending",
            "New streams whose first chunk had not come yet when a token2wav call of first chunks started "
            "(they wait for a later call: a burst's first audio split across calls)",
            buckets=(0, *BATCH_CHUNKS_BUCKETS),
            registry=self.registry,
        )
        self.token2wav_wait_seconds = Histogram(
            "tts_token2wav_wait_seconds",
            "Time from a chunk's submission to the start of the token2wav call that runs it, by chunk: "
            "first (a stream's first audio) or later",
            ["chunk"],
            buckets=BATCH_SECONDS_BUCKETS,
            registry=self.registry,
        )
        self.later_chunks = Counter(
            "tts_token2wav_later_chunks",
            "Chunks after a stream's first audio, by when their audio was ready against when the listener "
            "needed it: on_time, late (its tokens came in time; the token2wav queue and call made it late) "
            "or tokens_late (its tokens came after it was due)",
            ["outcome"],
            registry=self.registry,
        )
        self.first_chunk_hops = Counter(
            "tts_first_chunk_hops",
            "Streams started, by their first chunk's speech tokens (the light-load first chunk or the usual)",
            ["tokens"],
            registry=self.registry,
        )
        self.audio_seconds = Counter("tts_audio_seconds", "Audio produced", registry=self.registry)
        self.errors = Counter(
            "tts_errors", "Errors reported to clients, by code", ["code"], registry=self.registry
        )

    def track_gpu_memory_peak(self, read_peak_bytes: Callable[[], dict[str, int]]) -> None:
        """Report the peak GPU memory per device and in all (`realtime_gpu_memory_peak_bytes`, the
        benchmark's memory figure), read at every scrape from `{device: bytes}`.

        Registered only where there is a GPU; without one the metrics are absent.
        """
        self.registry.register(_PeakMemoryCollector(read_peak_bytes))

    def track_gpu_memory(self, read_allocated_bytes: Callable[[], int],
                         read_free_total_bytes: Callable[[], tuple[int, int]]) -> None:
        """Report, read at every scrape, `realtime_gpu_memory_allocated_bytes` (PyTorch tensors outside
        CUDA-graph pools: what streams add), `realtime_gpu_memory_used_bytes` (the device's memory in use
        by anyone: graph pools, allocator cache and CUDA context included) and
        `realtime_gpu_memory_total_bytes`: the benchmark's bytes per stream and headroom."""
        self.registry.register(_GaugeCollector(
            "realtime_gpu_memory_allocated_bytes", "GPU memory held by PyTorch tensors outside graph pools",
            lambda: float(read_allocated_bytes())))

        def used() -> float:
            free, total = read_free_total_bytes()
            return float(total - free)

        self.registry.register(_GaugeCollector(
            "realtime_gpu_memory_used_bytes", "GPU memory in use on the device", used))
        self.registry.register(_GaugeCollector(
            "realtime_gpu_memory_total_bytes", "Memory of the GPU",
            lambda: float(read_free_total_bytes()[1])))

    def track_llm(self, read_stats: Callable[[], list[LLMStats]]) -> None:
        """Report the LLM engines' requests, cache use and steps (summed over engines), read at every
        scrape."""
        self.registry.register(_LLMCollector(read_stats))

    def track_placement(self, read_loads: Callable[[], list[tuple[str, WorkerLoad]]]) -> None:
        """Report each token2wav worker's streams, capacity and health by device, and the free stream
        capacity in all (what an autoscaler scales on), read at every scrape."""
        self.registry.register(_PlacementCollector(read_loads))

    def track_connections(self, websockets: Callable[[], int], webrtc_sessions: Callable[[], int]) -> None:
        """Report the open agent websockets and WebRTC sessions, read at every scrape."""
        Gauge("tts_websocket_connections", "Agent websockets open", registry=self.registry).set_function(
            lambda: float(websockets())
        )
        Gauge("tts_webrtc_sessions", "WebRTC sessions (peer connections) open",
              registry=self.registry).set_function(lambda: float(webrtc_sessions()))

    def track_gc(self, pauses: GcPauses) -> None:
        """Report Python's garbage collection pauses by generation (`realtime_gc_pause_seconds`), read
        at every scrape: a collection stops every thread, the LLM's decode steps included."""
        self.registry.register(_GcPauseCollector(pauses))

    def error(self, code: str) -> None:
        self.errors.labels(code=code).inc()

    def chunk_waited(self, first: bool, seconds: float) -> None:
        """A chunk's wait from submission to the start of its token2wav call (`first`: first audio)."""
        self.token2wav_wait_seconds.labels(chunk="first" if first else "later").observe(seconds)

    def later_chunk_ready(self, due: float, submitted: float, ready: float) -> None:
        """A later chunk's audio was ready at `ready`; it was submitted at `submitted` and due at `due`
        (one clock)."""
        outcome = "on_time" if ready <= due else "tokens_late" if submitted > due else "late"
        self.later_chunks.labels(outcome=outcome).inc()

    def render(self, names: Collection[str] = ()) -> bytes:
        """The exposition of every metric, or of the samples named in `names` only (Prometheus'
        `name[]` query parameters: a frequent poller of a few gauges then costs the event loop little)."""
        if names:
            return generate_latest(self.registry.restricted_registry(names))
        return generate_latest(self.registry)


class _PeakMemoryCollector(Collector):
    """The peak device memory, read when scraped rather than polled."""

    def __init__(self, read_peak_bytes: Callable[[], dict[str, int]]) -> None:
        self._read = read_peak_bytes

    def describe(self) -> list[GaugeMetricFamily]:
        return list(self._families())

    def collect(self) -> Iterator[GaugeMetricFamily]:
        total, per_device = self._families()
        peaks = self._read()
        total.add_metric([], float(sum(peaks.values())))
        for device, peak in peaks.items():
            per_device.add_metric([device], float(peak))
        yield total
        yield per_device

    @staticmethod
    def _families() -> tuple[GaugeMetricFamily, GaugeMetricFamily]:
        caveat = "(allocations TensorRT makes itself are not counted)"
        return (
            GaugeMetricFamily("realtime_gpu_memory_peak_bytes",
                              f"Peak GPU memory held by PyTorch tensors since the start, all GPUs {caveat}"),
            GaugeMetricFamily("tts_gpu_memory_peak_bytes",
                              f"Peak GPU memory held by PyTorch tensors since the start, by GPU {caveat}",
                              labels=["device"]),
        )


class _GaugeCollector(Collector):
    """One gauge, read when scraped."""

    def __init__(self, name: str, documentation: str, read: Callable[[], float]) -> None:
        self._name, self._documentation, self._read = name, documentation, read

    def describe(self) -> list[GaugeMetricFamily]:
        return [GaugeMetricFamily(self._name, self._documentation)]

    def collect(self) -> Iterator[GaugeMetricFamily]:
        yield GaugeMetricFamily(self._name, self._documentation, value=self._read())


class _LLMCollector(Collector):
    """The LLM engine's figures, read from its stats when scraped."""

    def __init__(self, read_stats: Callable[[], list[LLMStats]]) -> None:
        self._read = read_stats

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        engines = self._read()
        stats = LLMStats(
            active=sum(s.active for s in engines),
            waiting=sum(s.waiting for s in engines),
            max_slots=sum(s.max_slots for s in engines),
            kv_tokens_used=sum(s.kv_tokens_used for s in engines),
            kv_tokens_total=sum(s.kv_tokens_total for s in engines),
            kv_bytes_total=sum(s.kv_bytes_total for s in engines),
            steps=sum(s.steps for s in engines),
            step_seconds=sum(s.step_seconds for s in engines),
            prefill_calls=sum(s.prefill_calls for s in engines),
            prefill_rows=sum(s.prefill_rows for s in engines),
            first_tokens=sum(s.first_tokens for s in engines),
            first_token_seconds=sum(s.first_token_seconds for s in engines),
        )
        yield GaugeMetricFamily("tts_llm_active_requests", "Requests holding an LLM slot", value=stats.active)
        yield GaugeMetricFamily("tts_llm_waiting_requests", "Requests waiting for an LLM slot",
                                value=stats.waiting)
        yield GaugeMetricFamily("tts_llm_kv_tokens_used", "KV cache positions in use",
                                value=stats.kv_tokens_used)
        yield GaugeMetricFamily("tts_llm_kv_tokens_total", "KV cache positions the engine holds",
                                value=stats.kv_tokens_total)
        yield GaugeMetricFamily("tts_llm_slots", "Requests the LLM engines batch at most",
                                value=stats.max_slots)
        yield GaugeMetricFamily("tts_llm_kv_bytes_total", "Device memory of the KV caches (all slots)",
                                value=stats.kv_bytes_total)
        yield CounterMetricFamily("tts_llm_steps", "LLM engine steps (batched decode and/or prefill)",
                                  value=stats.steps)
        yield CounterMetricFamily("tts_llm_step_seconds", "Wall time of the LLM engine's steps",
                                  value=stats.step_seconds)
        yield CounterMetricFamily("tts_llm_prefill_calls", "Batched prefill calls of the LLM engines",
                                  value=stats.prefill_calls)
        yield CounterMetricFamily("tts_llm_prefill_rows",
                                  "Prompt chunks the prefill calls read (per call: how a burst was grouped)",
                                  value=stats.prefill_rows)
        yield CounterMetricFamily("tts_llm_first_tokens", "Requests whose first speech token was decoded",
                                  value=stats.first_tokens)
        yield CounterMetricFamily("tts_llm_first_token_seconds",
                                  "Summed time from a request's submission to its first speech token on the "
                                  "host (waiting for a slot, prefill, the first decode step)",
                                  value=stats.first_token_seconds)


class _PlacementCollector(Collector):
    """The token2wav workers' loads, read when scraped."""

    def __init__(self, read_loads: Callable[[], list[tuple[str, WorkerLoad]]]) -> None:
        self._read = read_loads

    def collect(self) -> Iterator[GaugeMetricFamily]:
        loads = self._read()
        labels = ["worker", "device"]
        streams = GaugeMetricFamily("tts_token2wav_worker_streams", "Streams placed on a token2wav worker",
                                    labels=labels)
        capacity = GaugeMetricFamily("tts_token2wav_worker_capacity", "Most streams a token2wav worker takes",
                                     labels=labels)
        alive = GaugeMetricFamily("tts_token2wav_worker_alive", "1 while a token2wav worker's threads run",
                                  labels=labels)
        reserved = GaugeMetricFamily("tts_token2wav_memory_reserved_bytes",
                                     "Device bytes reserved for a token2wav worker's streams (their bounds)",
                                     labels=labels)
        budget = GaugeMetricFamily("tts_token2wav_memory_budget_bytes",
                                   "Device bytes a token2wav worker's streams may reserve (absent: no limit)",
                                   labels=labels)
        for index, (device, load) in enumerate(loads):
            streams.add_metric([str(index), device], load.streams)
            capacity.add_metric([str(index), device], load.capacity)
            alive.add_metric([str(index), device], float(load.alive))
            reserved.add_metric([str(index), device], load.reserved_bytes)
            if load.budget_bytes is not None:
                budget.add_metric([str(index), device], load.budget_bytes)
        yield from (streams, capacity, alive, reserved, budget)
        live = [load for _, load in loads if load.alive]
        total = sum(load.capacity for load in live)
        free = sum(max(0, load.capacity - load.streams) for load in live)
        yield GaugeMetricFamily(
            "tts_stream_capacity_free",
            "New streams the live token2wav workers can still take (0: new streams are refused as busy)",
            value=free,
        )
        yield GaugeMetricFamily(
            "tts_stream_capacity_used_ratio",
            "Share of the live workers' stream capacity in use, 0..1 (1 with no live worker): what an "
            "autoscaler targets",
            value=1.0 - free / total if total else 1.0,
        )


class _GcPauseCollector(Collector):
    """`GcPauses`' counts as a histogram per generation, read when scraped."""

    def __init__(self, pauses: GcPauses) -> None:
        self._pauses = pauses

    def collect(self) -> Iterator[HistogramMetricFamily]:
        family = HistogramMetricFamily(
            "realtime_gc_pause_seconds",
            "Python garbage collections by generation and how long each stopped every thread",
            labels=["generation"])
        for generation, (counts, seconds) in enumerate(zip(self._pauses.counts, self._pauses.seconds,
                                                           strict=True)):
            cumulative = list(itertools.accumulate(counts))
            bounds = [*(str(bound) for bound in PAUSE_BUCKETS), "+Inf"]
            family.add_metric([str(generation)], list(zip(bounds, cumulative, strict=True)), seconds)
        yield family
