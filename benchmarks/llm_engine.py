"""Latency of the PyTorch LLM engine alone: decode step and first token, alone and under concurrent arrivals.

    python benchmarks/llm_engine.py --models /path/to/models --json out.json
    python benchmarks/llm_engine.py --models /path/to/models --profile prof.txt  # + profiler tables

Every request has a zero-shot prompt of 100-300 positions and a fixed output length (random weights
never stop on their own). Reported: batch-1 first token and decode step, first-token latency when
16 and 64 (`--bursts`) requests arrive at once, the decode step while they run, the replay time of
single CUDA graphs (device time only, from CUDA events), the first-audio estimate (first token + 17
steps) and, on CUDA, a lone request's first token step by step (`first_token_timeline`).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

# The engine package comes from PYTHONPATH when set (so another checkout can be measured), else this repo.
sys.path.append(str(Path(__file__).resolve().parents[1]))

from benchmarks.profiled_kernels import kernel_table  # noqa: E402
from engines.config import SPEECH_CODEBOOK  # noqa: E402
from engines.llm.base import LLMRequest, SamplingParams  # noqa: E402
from engines.llm.torch_engine import TorchLLMEngine  # noqa: E402

TEXT_VOCAB_USED = 2000  # text ids are drawn below this (valid in the tiny test vocabulary too)
FIRST_AUDIO_TOKENS = 18


def make_request(index: int, tokens: int) -> LLMRequest:
    """Request `index`: 30 prompt text ids, 20 target text ids, 50-240 prompt speech tokens."""
    speech_len = 50 + (index * 53) % 190
    return LLMRequest(
        request_id=f"bench-{index}",
        text_ids=[(977 * index + 31 * i) % TEXT_VOCAB_USED for i in range(20)],
        prompt_text_ids=[(613 * index + 17 * i) % TEXT_VOCAB_USED for i in range(30)],
        prompt_speech_tokens=[(389 * index + 7 * i) % SPEECH_CODEBOOK for i in range(speech_len)],
        sampling=SamplingParams(fixed_length=tokens, seed=index),
    )


@dataclass
class Trace:
    """When one request was submitted and when each of its tokens reached the consumer."""

    submitted: float
    arrivals: list[float]

    @property
    def first_token_ms(self) -> float:
        return (self.arrivals[0] - self.submitted) * 1000

    def step_ms_after(self, moment: float) -> float | None:
        """Mean time per token over the tokens that arrived after `moment`."""
        later = [t for t in self.arrivals if t > moment]
        if len(later) < 2:
            return None
        return (later[-1] - later[0]) * 1000 / (len(later) - 1)


async def run_burst(engine: TorchLLMEngine, count: int, tokens: int, first_index: int = 0) -> list[Trace]:
    """Submit `count` requests at once and follow every token."""

    async def follow(index: int) -> Trace:
        trace = Trace(time.perf_counter(), [])
        async for chunk in engine.submit(make_request(index, tokens)):
            now = time.perf_counter()
            trace.arrivals.extend([now] * len(chunk))
        assert len(trace.arrivals) == tokens
        return trace

    return list(await asyncio.gather(*(follow(first_index + i) for i in range(count))))


async def collect_tokens(engine: TorchLLMEngine, count: int, tokens: int) -> list[list[int]]:
    async def collect(index: int) -> list[int]:
        return [t async for chunk in engine.submit(make_request(index, tokens)) for t in chunk]

    return list(await asyncio.gather(*(collect(i) for i in range(count))))


def percentile(values: list[float], fraction: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(fraction * len(ordered)))]


async def measure(engine: TorchLLMEngine, tokens: int, bursts: tuple[int, ...]) -> dict[str, Any]:
    await run_burst(engine, 16, 8)  # warm-up
    await run_burst(engine, 1, 8)
    singles = [(await run_burst(engine, 1, tokens, first_index=100 + i))[0] for i in range(5)]
    figures: dict[str, Any] = {
        "batch1_first_token_ms": statistics.median(t.first_token_ms for t in singles),
        "batch1_step_ms": statistics.median(t.step_ms_after(t.arrivals[0]) or 0.0 for t in singles),
    }
    figures["batch1_first_audio_ms"] = (figures["batch1_first_token_ms"]
                                        + (FIRST_AUDIO_TOKENS - 1) * figures["batch1_step_ms"])
    for count in bursts:
        traces = await run_burst(engine, count, tokens, first_index=1000 * count)
        firsts = [t.first_token_ms for t in traces]
        all_started = max(t.arrivals[0] for t in traces)
        steps = [s for t in traces if (s := t.step_ms_after(all_started)) is not None]
        figures[f"burst{count}_first_token_ms"] = {
            "median": statistics.median(firsts), "p90": percentile(firsts, 0.9), "max": max(firsts)}
        figures[f"burst{count}_step_ms"] = statistics.median(steps) if steps else None
        figures[f"burst{count}_18th_token_ms"] = statistics.median(
            (t.arrivals[FIRST_AUDIO_TOKENS - 1] - t.submitted) * 1000 for t in traces)
    return figures


def first_token_timeline(loop: asyncio.AbstractEventLoop, engine: TorchLLMEngine,
                         repeats: int = 5) -> dict[str, float]:
    """Where a lone request's first token goes: host moments (ms after its submission, medians over
    `repeats` requests) of the runner's calls on the engine thread, the prefill's device time, and the
    token's arrival on the event loop."""
    runner: Any = engine._runner
    marks: list[tuple[str, float]] = []
    device_ms: list[float] = []

    def timed(name: str, method: Callable[..., Any]) -> Callable[..., Any]:
        def call(*args: Any, **kwargs: Any) -> Any:
            marks.append((f"{name} called", time.perf_counter()))
            result = method(*args, **kwargs)
            marks.append((f"{name} returned", time.perf_counter()))
            return result
        return call

    def timed_prefill(*args: Any, **kwargs: Any) -> Any:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        result = prefill(*args, **kwargs)
        end.record()
        end.synchronize()  # after the launch returned: the moments below include this wait
        device_ms.append(start.elapsed_time(end))
        return result

    def timed_read_back(*args: Any, **kwargs: Any) -> Any:
        readback = read_back(*args, **kwargs)
        readback.lists = timed("read-back lists", readback.lists)
        return readback

    begin, prefill, read_back = runner.begin, timed("prefill", runner.prefill), runner.read_back
    runner.begin, runner.prefill, runner.read_back = timed("begin", begin), timed_prefill, timed_read_back
    timelines: list[dict[str, float]] = []
    try:
        for index in range(repeats):
            marks.clear()
            trace = loop.run_until_complete(run_burst(engine, 1, 2, first_index=200 + index))[0]
            timeline: dict[str, float] = {}
            for name, moment in marks:  # the first of each: the first token's step
                timeline.setdefault(name, (moment - trace.submitted) * 1000)
            timeline["token on the loop"] = trace.first_token_ms
            timelines.append(timeline)
    finally:
        del runner.begin, runner.prefill, runner.read_back
    figures = {name: statistics.median(t[name] for t in timelines if name in t) for name in timelines[0]}
    figures["prefill device ms"] = statistics.median(device_ms)
    return figures


def replay_ms(graph: torch.cuda.CUDAGraph, repeats: int = 50) -> float:
    """Device time of one replay, from CUDA events around `repeats` back-to-back replays."""
    graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(repeats):
        graph.replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / repeats


def graph_times(engine: TorchLLMEngine) -> dict[str, float]:
    """Replay time of a few captured decode and prefill graphs of an idle engine (their outputs are
    ignored). Prefill graphs replay with every row on the scratch slot from position 0, none ending its
    prompt: they then write no live slot and sample nothing."""
    runner: Any = engine._runner
    if runner is None or not runner.decode_graphs:
        return {}
    times = {}
    for key in ((1, 256), (1, 512), (16, 512), (64, 512), (64, 1024), (128, 512), (128, 1024)):
        if key in runner.decode_graphs:
            times[f"decode{key}"] = replay_ms(runner.decode_graphs[key])
    runner.prefill_rows[1:].zero_()  # from position 0, no prompt ending (an earlier call's may reach far)
    runner.prefill_rows[0].fill_(runner.scratch_slot)
    kv_len = engine.config.prefill_graph_kv_len
    for rows, length in ((1, 192), (4, 192), (16, 192), (32, 192), (32, 256)):
        graph = runner.prefill_graphs.get((rows, length, kv_len))
        if graph is not None:
            times[f"prefill{(rows, length, kv_len)}"] = replay_ms(graph)
    return times


def graph_kernels(engine: TorchLLMEngine, out: Path, replays: int = 20) -> None:
    """Per captured prefill / decode graph (as `graph_times` replays them): its kernels by device time
    per replay, from torch.profiler over `replays` replays."""
    from torch.profiler import ProfilerActivity, profile

    runner: Any = engine._runner
    runner.prefill_rows[1:].zero_()
    runner.prefill_rows[0].fill_(runner.scratch_slot)
    kv_len = engine.config.prefill_graph_kv_len
    graphs = {f"prefill{key}": runner.prefill_graphs.get(key)
              for key in ((1, 64, kv_len), (1, 192, kv_len), (1, 256, kv_len), (16, 192, kv_len))}
    graphs.update({f"decode{key}": runner.decode_graphs.get(key) for key in ((1, 256), (16, 512))})
    sections = []
    for name, graph in graphs.items():
        if graph is None:
            continue
        graph.replay()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(replays):
                graph.replay()
            torch.cuda.synchronize()
        sections.append(kernel_table(prof, replays, f"{name} replay", top=25))
    out.write_text("\n\n".join(sections) + "\n")


def profile_tables(loop: asyncio.AbstractEventLoop, engine: TorchLLMEngine, tokens: int, out: Path) -> None:
    """torch.profiler tables (top kernels by device time, top ops by host time) for one request alone
    and for a burst of 64 up to their first audio's tokens, in one text file."""
    from torch.profiler import ProfilerActivity, profile

    scenarios: dict[str, Callable[[], Any]] = {
        "single request": lambda: run_burst(engine, 1, tokens, first_index=7),
        "burst of 64": lambda: run_burst(engine, 64, FIRST_AUDIO_TOKENS, first_index=500),
    }
    sections = []
    for name, scenario in scenarios.items():
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            loop.run_until_complete(scenario())
        for sort_by in ("self_cuda_time_total", "self_cpu_time_total"):
            table = prof.key_averages().table(sort_by=sort_by, row_limit=35, max_name_column_width=70)
            sections.append(f"== {name}, by {sort_by}\n{table}")
    out.write_text("\n".join(sections))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", type=Path, required=True,
                        help="models directory (scripts/build_engines.py)")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--slots", type=int, default=64)
    parser.add_argument("--context", type=int, default=2048)
    parser.add_argument("--tokens", type=int, default=120, help="speech tokens per request")
    parser.add_argument("--bursts", default="16,64", help="sizes of the simultaneous-arrival bursts")
    parser.add_argument("--json", type=Path)
    parser.add_argument("--profile", type=Path, help="text file for torch.profiler tables")
    parser.add_argument("--label", default="")
    parser.add_argument("--graph-kernels", type=Path,
                        help="text file for the kernels of single prefill / decode graph replays (CUDA)")
    parser.add_argument("--programmatic-launch", action=argparse.BooleanOptionalAction, default=True,
                        help="decode kernels launched with PDL (TorchLLMConfig.programmatic_launch)")
    parser.add_argument("--dump-tokens", type=Path,
                        help="instead: write the tokens of 6 seeded requests decoded in fp32 "
                             "(to compare engines)")
    args = parser.parse_args()

    loop = asyncio.new_event_loop()
    if args.dump_tokens is not None:
        engine = TorchLLMEngine.from_models_dir(args.models, device=args.device, max_slots=8,
                                                max_context=1024, dtype="float32")
        loop.run_until_complete(engine.start())
        traces = loop.run_until_complete(collect_tokens(engine, 6, args.tokens))
        loop.run_until_complete(engine.stop())
        args.dump_tokens.write_text(json.dumps(traces))
        return

    engine = TorchLLMEngine.from_models_dir(args.models, device=args.device, max_slots=args.slots,
                                            max_context=args.context,
                                            programmatic_launch=args.programmatic_launch)
    started = time.perf_counter()
    loop.run_until_complete(engine.start())
    figures: dict[str, Any] = {"label": args.label, "start_s": time.perf_counter() - started}
    bursts = tuple(int(count) for count in args.bursts.split(","))
    figures.update(loop.run_until_complete(measure(engine, args.tokens, bursts)))
    if args.profile is not None:
        profile_tables(loop, engine, 40, args.profile)
    if args.device.startswith("cuda"):
        figures["first_token_timeline_ms"] = first_token_timeline(loop, engine)
        figures["graph_replay_ms"] = graph_times(engine)
        if args.graph_kernels is not None:
            graph_kernels(engine, args.graph_kernels)
    loop.run_until_complete(engine.stop())
    print(json.dumps(figures, indent=1))
    if args.json is not None:
        args.json.write_text(json.dumps(figures, indent=1))


if __name__ == "__main__":
    main()
