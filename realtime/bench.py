"""Load benchmark: N concurrent agents' websocket streams against a server, measured on the client.

Each stream has its own socket (as a voice agent does; all are open before the clock starts), starts
a context with a fixed number of speech tokens per sentence (synthetic weights never stop on their own),
sends one text and waits for `done`; all streams of a level start in the same instant. Per stream we
record when the request went out, when each audio frame arrived and how much audio it carried; a
simulated player starts at the first byte and plays in real time, so an underrun is the player
catching up with the received audio before the end.

`realtime bench --url ws://127.0.0.1:8080/v1/ws` drives a running server; `--spawn --models DIR`
starts the server itself, once in the normal mode and once in the baseline mode (the design we
replace: one request at a time through the LLM, batch-1 token2wav), and prints both tables and their
ratio. Results also go to a JSON file.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import random
import statistics
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

import websockets
from websockets.asyncio.client import ClientConnection

from realtime.bench_metrics import MemoryFigures, ServerFigures, sample_metrics, scrape
from realtime.bench_server import spawned_server
from realtime.gpu_sampler import GpuFigures, GpuSampler, format_gpus
from realtime.protocol.native import parse_audio_frame

TEXTS = (
    "Thanks for calling, how can I help you today?",
    "Your order has shipped and should arrive on Thursday afternoon.",
    "I can book a table for four at seven thirty, does that work for you?",
    "The weather tomorrow will be sunny with a light breeze from the west.",
)
SAMPLE_RATE = 24000
BYTES_PER_SAMPLE = 2


@dataclass
class StreamResult:
    first_chunk_s: float = math.nan  # request sent → first audio byte
    sent_at: float = math.nan  # when the request went out (time.perf_counter)
    total_s: float = math.nan  # request sent → done
    audio_s: float = 0.0
    underruns: int = 0
    stall_s: float = 0.0  # total time the simulated player waited after it started
    # Each underrun: (seconds of audio played before it, how long the player waited)
    gaps: list[tuple[float, float]] = field(default_factory=list)
    error: str | None = None


@dataclass
class LevelResult:
    streams: int
    ok: int
    errors: int
    first_chunk_p50_ms: float
    first_chunk_p90_ms: float
    first_chunk_p99_ms: float
    total_p50_ms: float
    rtf_p50: float  # processing time / audio duration; < 1 is faster than real time
    underrun_streams: int
    underruns: int
    stall_max_ms: float  # the longest total wait of one stream's player
    throughput_audio_s_per_s: float
    wall_s: float
    peak_gpu_memory_gib: float | None = None
    error_codes: dict[str, int] = field(default_factory=dict)
    server: ServerFigures | None = None
    gpus: list[GpuFigures] = field(default_factory=list)  # per GPU while the level ran (nvidia-smi)
    memory: MemoryFigures | None = None
    # Underruns by where in the audio they came (seconds played before, to 0.1 s: the schedule's chunk
    # boundaries tell which chunk was late), with their waits' median and longest in ms.
    gaps_at: dict[str, UnderrunGaps] = field(default_factory=dict)
    # The clients' mean, beside the server's (a mean too): what the transport adds, whatever the spread.
    first_chunk_mean_ms: float = math.nan


@dataclass
class UnderrunGaps:
    count: int
    wait_p50_ms: float
    wait_max_ms: float

    @staticmethod
    def by_position(gaps: Sequence[tuple[float, float]]) -> dict[str, UnderrunGaps]:
        waits: dict[float, list[float]] = {}
        for played_s, wait_s in gaps:
            waits.setdefault(round(played_s, 1), []).append(wait_s * 1000)
        return {f"{at:.1f}": UnderrunGaps(len(ms), statistics.median(ms), max(ms))
                for at, ms in sorted(waits.items())}


def percentile(values: Sequence[float], q: float) -> float:
    if not values:
        return math.nan
    ordered = sorted(values)
    k = (len(ordered) - 1) * q
    lo, hi = math.floor(k), math.ceil(k)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (k - lo)


class Player:
    """A real-time player that starts at the first audio byte; counts the times it runs dry."""

    def __init__(self) -> None:
        self.start: float | None = None
        self.buffered_s = 0.0  # audio received, in seconds
        self.stall_s = 0.0
        self.underruns = 0
        self.gaps: list[tuple[float, float]] = []  # (audio played before, wait) per underrun

    def receive(self, now: float, seconds: float) -> None:
        if self.start is None:
            self.start = now
        else:
            played_until = self.start + self.stall_s + self.buffered_s
            if now > played_until:  # the player ran out before this chunk came
                self.underruns += 1
                self.gaps.append((self.buffered_s, now - played_until))
                self.stall_s += now - played_until
        self.buffered_s += seconds


def request_tokens(tokens: int, spread: float, index: int) -> int:
    """Speech tokens of request `index`: `tokens`, or with `spread` drawn uniformly within ±spread of it
    (seeded by the index, so both sides of an A/B get the same lengths): utterances, and so the final
    chunks that end them, of many lengths, as real traffic has."""
    if not spread:
        return tokens
    return max(1, round(tokens * random.Random(index).uniform(1 - spread, 1 + spread)))


async def run_stream(ws: ClientConnection, index: int, tokens: int, voice: str,
                     spread: float = 0.0) -> StreamResult:
    """Speak one text on an open socket and measure it."""
    result = StreamResult()
    context = f"s{index}"
    player = Player()
    try:
        await ws.send(json.dumps({"type": "start", "context_id": context, "voice": voice,
                                  "sample_rate": SAMPLE_RATE, "encoding": "pcm_s16le",
                                  "fixed_length": request_tokens(tokens, spread, index), "seed": index}))
        sent = result.sent_at = time.perf_counter()
        text = TEXTS[index % len(TEXTS)]
        await ws.send(json.dumps({"type": "text", "context_id": context, "text": text}))
        await ws.send(json.dumps({"type": "end", "context_id": context}))
        async for frame in ws:
            now = time.perf_counter()
            if isinstance(frame, bytes):
                _, _, payload = parse_audio_frame(frame)
                seconds = len(payload) / BYTES_PER_SAMPLE / SAMPLE_RATE
                if math.isnan(result.first_chunk_s) and payload:
                    result.first_chunk_s = now - sent
                if payload:
                    player.receive(now, seconds)
                result.audio_s += seconds
                continue
            event = json.loads(frame)
            if event["type"] == "error":
                result.error = event.get("code", "error")
                break
            if event["type"] == "done":
                result.total_s = now - sent
                break
        await ws.send(json.dumps({"type": "close"}))
    except (TimeoutError, OSError, websockets.WebSocketException) as exc:
        result.error = type(exc).__name__
    result.underruns = player.underruns
    result.stall_s = player.stall_s
    result.gaps = player.gaps
    return result


async def run_streams(url: str, streams: int, tokens: int, voice: str,
                      spread: float = 0.0) -> list[StreamResult]:
    """Open every socket first, then start all streams in the same instant.

    Voice agents keep their socket open across utterances, so the handshakes are not part of a
    request's latency (and would otherwise load the server while the first streams are timed).
    """
    sockets = await asyncio.gather(
        *(websockets.connect(url, max_size=None, open_timeout=30) for _ in range(streams)),
        return_exceptions=True,
    )
    try:
        return list(await asyncio.gather(*(
            run_stream(ws, i, tokens, voice, spread) if isinstance(ws, ClientConnection) else _failed(ws)
            for i, ws in enumerate(sockets)
        )))
    finally:
        await asyncio.gather(*(ws.close() for ws in sockets if isinstance(ws, ClientConnection)),
                             return_exceptions=True)


async def _failed(error: BaseException) -> StreamResult:
    return StreamResult(error=type(error).__name__)


def _outcomes(results: Sequence[StreamResult]) -> tuple[list[StreamResult], dict[str, int]]:
    """The streams that completed, and how many failed with each error code; a stream that failed after
    its audio began counts under "CODE after audio" (a listener heard it cut off, not refused)."""
    ok = [r for r in results if r.error is None and not math.isnan(r.total_s)]
    errors: dict[str, int] = {}
    for r in results:
        if r.error is not None:
            key = r.error if math.isnan(r.first_chunk_s) else f"{r.error} after audio"
            errors[key] = errors.get(key, 0) + 1
    return ok, errors


def http_base(url: str) -> str:
    return url.replace("ws://", "http://").replace("wss://", "https://").rsplit("/v1/", 1)[0]


async def run_level(url: str, streams: int, tokens: int, voice: str, spread: float = 0.0) -> LevelResult:
    http_url = http_base(url)
    before = await scrape(http_url)
    samples: list[dict[str, float]] = []
    sampler = asyncio.create_task(sample_metrics(http_url, samples))
    start = time.perf_counter()
    try:
        async with GpuSampler() as gpus:
            results = await run_streams(url, streams, tokens, voice, spread)
    finally:
        sampler.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await sampler
    wall = time.perf_counter() - start
    ok, errors = _outcomes(results)
    firsts = [r.first_chunk_s * 1000 for r in ok]
    after = await scrape(http_url)
    peak = after.get("realtime_gpu_memory_peak_bytes")
    return LevelResult(
        streams=streams,
        ok=len(ok),
        errors=len(results) - len(ok),
        first_chunk_p50_ms=percentile(firsts, 0.5),
        first_chunk_p90_ms=percentile(firsts, 0.9),
        first_chunk_p99_ms=percentile(firsts, 0.99),
        total_p50_ms=percentile([r.total_s * 1000 for r in ok], 0.5),
        rtf_p50=statistics.median([r.total_s / r.audio_s for r in ok if r.audio_s > 0]) if ok else math.nan,
        underrun_streams=sum(1 for r in ok if r.underruns),
        underruns=sum(r.underruns for r in ok),
        stall_max_ms=max((r.stall_s * 1000 for r in ok), default=0.0),
        gaps_at=UnderrunGaps.by_position([gap for r in ok for gap in r.gaps]),
        first_chunk_mean_ms=statistics.fmean(firsts) if firsts else math.nan,
        throughput_audio_s_per_s=sum(r.audio_s for r in ok) / wall,
        wall_s=wall,
        peak_gpu_memory_gib=None if peak is None else peak / 2**30,
        error_codes=errors,
        server=ServerFigures.between(before, after) if after else None,
        gpus=gpus.figures,
        memory=MemoryFigures.of(streams, before, samples, after) if after else None,
    )


@dataclass
class StaggeredResult:
    """Streams arriving as a Poisson process for `duration_s`, each one sentence of the bench.

    offered_streams: rate × audio seconds per request, the listeners served at once on average (Little's
    law); `fraction` of the burst capacity it was derived from.
    """

    fraction: float
    rate_per_s: float
    offered_streams: float
    duration_s: float
    arrivals: int
    ok: int
    errors: int
    first_chunk_p50_ms: float
    first_chunk_p90_ms: float
    first_chunk_p99_ms: float
    underrun_streams: int
    max_in_flight: int  # most requests between sent and done at once, as the client saw them
    error_codes: dict[str, int] = field(default_factory=dict)


async def run_staggered(url: str, fraction: float, capacity: int, duration_s: float, tokens: int,
                        voice: str, seed: int = 0, spread: float = 0.0) -> StaggeredResult:
    """Poisson arrivals at `fraction` × `capacity` concurrent listeners for `duration_s`; each arrival
    opens its own socket (timed from its request, as in `run_stream`) and closes it when done."""
    audio_s = tokens / 25
    rate = fraction * capacity / audio_s
    rng = random.Random(seed)
    in_flight = 0
    most = 0

    async def arrival(index: int) -> StreamResult:
        nonlocal in_flight, most
        try:
            async with websockets.connect(url, max_size=None, open_timeout=30) as ws:
                in_flight += 1
                most = max(most, in_flight)
                try:
                    return await run_stream(ws, index, tokens, voice, spread)
                finally:
                    in_flight -= 1
        except (TimeoutError, OSError, websockets.WebSocketException) as exc:
            return StreamResult(error=type(exc).__name__)

    tasks: list[asyncio.Task[StreamResult]] = []
    start = time.perf_counter()
    at = rng.expovariate(rate)
    while at < duration_s:
        await asyncio.sleep(max(0.0, start + at - time.perf_counter()))
        tasks.append(asyncio.create_task(arrival(len(tasks))))
        at += rng.expovariate(rate)
    results = await asyncio.gather(*tasks)
    ok, errors = _outcomes(results)
    firsts = [r.first_chunk_s * 1000 for r in ok]
    return StaggeredResult(
        fraction=fraction, rate_per_s=rate, offered_streams=rate * audio_s, duration_s=duration_s,
        arrivals=len(results), ok=len(ok), errors=len(results) - len(ok),
        first_chunk_p50_ms=percentile(firsts, 0.5), first_chunk_p90_ms=percentile(firsts, 0.9),
        first_chunk_p99_ms=percentile(firsts, 0.99), underrun_streams=sum(1 for r in ok if r.underruns),
        max_in_flight=most, error_codes=errors,
    )


def format_staggered(title: str, levels: Sequence[StaggeredResult]) -> str:
    head = (f"{'load':>5} {'rate/s':>7} {'offered':>8} {'arrivals':>8} {'err':>4} {'p50 first':>10} "
            f"{'p90 first':>10} {'p99 first':>10} {'underrun':>9} {'in flight':>9}")
    rows = [f"{lv.fraction:>5.0%} {lv.rate_per_s:>7.2f} {lv.offered_streams:>8.1f} {lv.arrivals:>8} "
            f"{lv.errors:>4} {lv.first_chunk_p50_ms:>8.0f}ms {lv.first_chunk_p90_ms:>8.0f}ms "
            f"{lv.first_chunk_p99_ms:>8.0f}ms {lv.underrun_streams:>9} {lv.max_in_flight:>9}"
            for lv in levels]
    return "\n".join([title, head, *rows])


def format_memory(levels: Sequence[LevelResult]) -> str:
    lines = ["GPU memory per level",
             f"{'streams':>7} {'before GiB':>10} {'busiest GiB':>11} {'MiB/stream':>10} {'KV MiB/slot':>11} "
             f"{'used GiB':>8} {'total GiB':>9} {'headroom GiB':>12} {'+streams':>8}"]
    gib, mib = 2**30, 2**20
    for lv in levels:
        m = lv.memory
        if m is None:
            continue
        lines.append(f"{lv.streams:>7} {m.allocated_before_bytes / gib:>10.2f} "
                     f"{m.allocated_max_bytes / gib:>11.2f} {m.stream_bytes / mib:>10.1f} "
                     f"{m.llm_kv_bytes_per_slot / mib:>11.1f} {m.used_max_bytes / gib:>8.2f} "
                     f"{m.total_bytes / gib:>9.2f} {m.headroom_bytes / gib:>12.2f} {m.headroom_streams:>8}")
    return "\n".join(lines)


async def largest_without_underrun(measure: Callable[[int], Awaitable[LevelResult]], low: int, high: int,
                                   repeats: int = 1) -> int:
    """Binary search for the most concurrent streams with no underrun and no error, in [low, high].

    A count passes only when `repeats` bursts of it in a row have neither: near the edge one burst passes
    or fails by tens of streams' chance (docs/benchmarks.md, ninth session). `measure(n)` runs a burst."""
    best = 0
    while low <= high:
        mid = (low + high) // 2
        if await _bursts_pass(measure, mid, repeats):
            best, low = mid, mid + 1
        else:
            high = mid - 1
    return best


async def _bursts_pass(measure: Callable[[int], Awaitable[LevelResult]], streams: int, repeats: int) -> bool:
    for attempt in range(1, repeats + 1):
        level = await measure(streams)
        tries = f" (burst {attempt} of {repeats})" if repeats > 1 else ""
        print(f"  search: {streams} streams{tries} -> {level.underrun_streams} underrun streams, "
              f"{level.errors} errors", flush=True)
        for line in format_level(level)[1:]:  # errors, underruns and the server's figures
            print(f"  {line}", flush=True)
        if level.underrun_streams or level.errors:
            return False
    return True


def format_table(title: str, levels: Sequence[LevelResult]) -> str:
    head = (f"{'streams':>7} {'ok':>4} {'err':>4} {'p50 first':>10} {'p90 first':>10} {'p99 first':>10} "
            f"{'p50 total':>10} {'RTF':>6} {'underrun':>9} {'audio s/s':>10} {'GPU GiB':>8}")
    return "\n".join([title, head, *(line for lv in levels for line in format_level(lv))])


def format_level(lv: LevelResult) -> list[str]:
    """A level's row of the table, and the server's figures under it when it reported them."""
    gpu = f"{lv.peak_gpu_memory_gib:8.2f}" if lv.peak_gpu_memory_gib is not None else f"{'-':>8}"
    lines = [
        f"{lv.streams:>7} {lv.ok:>4} {lv.errors:>4} "
        f"{lv.first_chunk_p50_ms:>8.0f}ms {lv.first_chunk_p90_ms:>8.0f}ms "
        f"{lv.first_chunk_p99_ms:>8.0f}ms {lv.total_p50_ms:>8.0f}ms {lv.rtf_p50:>6.3f} "
        f"{lv.underrun_streams:>9} {lv.throughput_audio_s_per_s:>10.1f} {gpu}"
    ]
    if lv.error_codes:
        codes = ", ".join(f"{n} {code}" for code, n in sorted(lv.error_codes.items()))
        lines.append(f"{'':>7} errors: {codes}")
    if lv.gaps_at:
        gaps = ", ".join(f"{g.count} after {at} s (wait p50 {g.wait_p50_ms:.0f} / max {g.wait_max_ms:.0f} ms)"
                         for at, g in lv.gaps_at.items())
        lines.append(f"{'':>7} underruns: {gaps}")
    if lv.server is not None:
        sv = lv.server
        lines.append(
            f"{'':>7} server: {sv.llm_steps} LLM steps of {sv.llm_step_ms:.2f} ms (prefill in "
            f"{sv.llm_prefill_calls} calls of {sv.llm_prefill_rows_per_call:.1f} prompts); "
            f"{sv.token2wav_batches} token2wav calls of {sv.token2wav_chunks_per_batch:.1f} chunks, "
            f"{sv.token2wav_batch_ms:.1f} ms each (launch {sv.token2wav_launch_ms:.1f} ms on the host, then "
            f"{sv.token2wav_device_wait_ms:.1f} ms waiting for the device), chunks waited "
            f"{sv.token2wav_wait_ms:.1f} ms "
            f"(first {sv.first_chunk_wait_ms:.1f}, later {sv.later_chunk_wait_ms:.1f}); first chunks in "
            f"{sv.calls_with_first_chunks} calls of {sv.first_chunks_per_call:.1f} "
            f"(at each {sv.first_chunks_pending:.1f} new streams' still to come); "
            f"first chunk: text ready at {sv.text_ready_ms:.1f} ms, first token "
            f"{sv.llm_first_token_ms:.1f} ms after its submission, tokens at {sv.first_tokens_ms:.0f} ms, "
            f"audio at {sv.first_chunk_ms:.0f} ms, written at {sv.first_chunk_written_ms:.0f} ms "
            f"(the clients' at {lv.first_chunk_mean_ms:.0f} ms); "
            f"later chunks ready after due {sv.later_chunks_late} of {sv.later_chunks} "
            f"(and {sv.later_chunks_tokens_late} whose tokens came after due); "
            f"longest stall {lv.stall_max_ms:.0f} ms; event loop late {sv.event_loop_lag_ms:.1f} ms on "
            f"average, p99 ≤ {sv.event_loop_lag_p99_ms:g} ms"
        )
    if lv.gpus:
        lines.append(f"{'':>7} {format_gpus(lv.gpus)}")
    return lines


def format_ratio(ours: Sequence[LevelResult], base: Sequence[LevelResult]) -> str:
    lines = ["baseline / ours (higher = we are better)",
             f"{'streams':>7} {'p50 first':>10} {'p99 first':>10} {'throughput':>11}"]
    by_streams = {b.streams: b for b in base}
    for a in ours:
        b = by_streams.get(a.streams)
        if b is None:
            continue
        lines.append(f"{a.streams:>7} {b.first_chunk_p50_ms / a.first_chunk_p50_ms:>9.1f}x "
                     f"{b.first_chunk_p99_ms / a.first_chunk_p99_ms:>9.1f}x "
                     f"{a.throughput_audio_s_per_s / max(b.throughput_audio_s_per_s, 1e-9):>10.1f}x")
    return "\n".join(lines)


@dataclass
class Measured:
    """One server's results: the burst levels, the burst capacity found, the staggered loads."""

    levels: list[LevelResult]
    best: int | None = None
    staggered: list[StaggeredResult] = field(default_factory=list)

    def report(self) -> dict[str, object]:
        return {"levels": [asdict(r) for r in self.levels], "max_streams_without_underrun": self.best,
                "staggered": [asdict(r) for r in self.staggered]}


async def run_levels(url: str, levels: Sequence[int], tokens: int, voice: str, search: bool,
                     search_max: int, staggered: Sequence[float] = (), staggered_s: float = 30.0,
                     capacity: int | None = None, search_repeats: int = 1, spread: float = 0.0) -> Measured:
    await run_level(url, 1, tokens, voice)  # warm-up: first requests pay for lazy initialisation
    measured = Measured([])
    for n in levels:
        result = await run_level(url, n, tokens, voice, spread)
        print("\n".join(format_level(result)), flush=True)
        measured.levels.append(result)
    if search:
        results = measured.levels
        clean = [r.streams for r in results if r.underrun_streams == 0 and r.errors == 0]
        dirty = [r.streams for r in results if r.underrun_streams or r.errors]
        low = max(clean, default=1)
        high = min(dirty, default=search_max) - (1 if dirty else 0)
        measured.best = await largest_without_underrun(
            lambda n: run_level(url, n, tokens, voice, spread), low, max(low, high), search_repeats)
        print(f"  largest burst with no underrun: {measured.best}", flush=True)
    base = capacity or measured.best
    for fraction in staggered if base else ():
        assert base is not None
        load = await run_staggered(url, fraction, base, staggered_s, tokens, voice, spread=spread)
        print(format_staggered("", [load]).splitlines()[-1], flush=True)
        measured.staggered.append(load)
    return measured


@dataclass(frozen=True)
class BenchOptions:
    """What `realtime bench` was asked to do."""

    streams: tuple[int, ...] = (1, 4, 16, 64, 128)
    tokens: int = 250  # speech tokens per request: 10 s of audio
    tokens_spread: float = 0.0  # requests' tokens uniform within ±this fraction of `tokens`
    voice: str = "default"
    url: str | None = None  # a running server; otherwise spawn one from `models`
    models: Path | None = None
    server_args: tuple[str, ...] = ()
    baseline: bool = True
    baseline_streams: tuple[int, ...] | None = None  # the baseline's levels (default: `streams`)
    search: bool = True
    search_max: int = 320
    search_repeats: int = 1  # bursts in a row a searched count must pass
    staggered: tuple[float, ...] = ()  # Poisson loads, as fractions of the burst capacity
    staggered_s: float = 30.0  # arrivals per staggered load
    capacity: int | None = None  # the capacity staggered loads refer to (default: the search's)
    json_path: Path = Path("bench-results/bench.json")

    def __post_init__(self) -> None:
        if not self.streams or min(self.streams) < 1:
            raise ValueError(f"stream counts must be positive, got {self.streams}")
        baseline = self.baseline_streams
        if baseline is not None and (not baseline or min(baseline) < 1):
            raise ValueError(f"baseline stream counts must be positive, got {self.baseline_streams}")
        if self.tokens < 1:
            raise ValueError(f"tokens must be positive, got {self.tokens}")
        if not 0 <= self.tokens_spread < 1:
            raise ValueError(f"tokens_spread is a fraction in [0, 1), got {self.tokens_spread}")
        if self.search_repeats < 1:
            raise ValueError(f"search_repeats must be positive, got {self.search_repeats}")
        if any(not 0 < f <= 4 for f in self.staggered):
            raise ValueError(f"staggered loads are fractions of capacity in (0, 4], got {self.staggered}")
        if self.staggered and not self.search and self.capacity is None:
            raise ValueError("staggered loads need the capacity: search for it or give --capacity")
        if self.staggered_s <= 0:
            raise ValueError(f"staggered_s must be positive, got {self.staggered_s}")


def run(options: BenchOptions) -> int:
    """Run the benchmark, print the tables and write the JSON report."""
    o = options
    report: dict[str, object] = {"tokens_per_request": o.tokens, "tokens_spread": o.tokens_spread,
                                 "audio_s_per_request": o.tokens / 25,
                                 "date": time.strftime("%Y-%m-%d %H:%M:%S")}

    def measure(url: str) -> Measured:
        return asyncio.run(run_levels(url, o.streams, o.tokens, o.voice, o.search, o.search_max,
                                      o.staggered, o.staggered_s, o.capacity, o.search_repeats,
                                      o.tokens_spread))

    if o.url:
        ours = measure(o.url)
        report["server"] = ours.report()
        print(format_table("\nserver", ours.levels))
    else:
        # Every stream is one socket from this one client: the spawned server's per-client limits must
        # admit them all at once (the level's streams connect together).
        sockets = str(2 * max(o.search_max, *o.streams))
        room = ("--max-connections-per-client", sockets, "--rate-burst", sockets, "--rate-limit", sockets)
        server_args = (*room, *o.server_args)
        with spawned_server(o.models, server_args) as url:
            ours = measure(url)
        report["ours"] = ours.report()
        print(format_table("\nours", ours.levels))
        if o.baseline:
            with spawned_server(o.models, (*server_args, "--baseline")) as url:
                base = asyncio.run(run_levels(url, o.baseline_streams or o.streams, o.tokens, o.voice, False,
                                              o.search_max, spread=o.tokens_spread))
            report["baseline"] = base.report()
            print(format_table("\nbaseline (no cross-request batching)", base.levels))
            print(format_ratio(ours.levels, base.levels))
    print(format_memory(ours.levels))
    if ours.staggered:
        print(format_staggered("\nstaggered arrivals (Poisson)", ours.staggered))
    if ours.best is not None:
        print(f"largest concurrency with no underrun: {ours.best}")
    o.json_path.parent.mkdir(parents=True, exist_ok=True)
    o.json_path.write_text(json.dumps(report, indent=2))
    print(f"\nwrote {o.json_path}")
    return 0
