"""How much the LLM and token2wav slow each other on one GPU: the LLM's decode step and token2wav's call
time, each alone and then together, as the service runs them (the LLM on its engine thread's
high-priority stream, token2wav on a thread of its own with a normal stream).

    python3 benchmarks/contention.py --models /tmp/cosyvoice-synthetic-tiny --device cpu --llm-streams 4 \
        --token2wav-rows 2 --tokens 24 --repeats 1                     # the mechanics, on a CPU
    bash benchmarks/on_device.sh python3 benchmarks/contention.py --models /tmp/m --llm-streams 16 64 128 \
        --token2wav-rows 16 64 --json $OUT/contention.json

For each LLM burst size B (B requests submitted at once, a fixed number of tokens each) and token2wav rows
R (R streams' chunks of the exponential schedule in step: first chunk, then the later hops, over and
over): the LLM alone (median decode step once all B have their first token, and the median time to a
request's 18th token: what a first chunk waits for), token2wav alone (median ms per call of each chunk),
then both at once (token2wav's calls loop while the burst decodes; its calls counted are those whose
midpoint falls inside the burst). At 64-128 streams the server's LLM steps are 2-3.4 ms against
~0.6 ms alone at one stream, and its token2wav calls take 20-30 % longer than the engine's alone
(docs/benchmarks.md, thirty-fifth session): this shows how much of that is the two sharing the device.
Prints a table; timings go to no test.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import statistics
import sys
import threading
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.llm_engine import FIRST_AUDIO_TOKENS, Trace, run_burst  # noqa: E402
from benchmarks.token2wav_batch import time_schedule  # noqa: E402
from engines.config import PRE_LOOKAHEAD, SPEECH_CODEBOOK, ModelPaths  # noqa: E402
from engines.llm.torch_engine import TorchLLMEngine  # noqa: E402
from engines.token2wav.base import SpeakerState  # noqa: E402
from engines.token2wav.torch_backend import TorchToken2Wav  # noqa: E402
from engines.voice import VoicePrompt  # noqa: E402


def llm_figures(traces: list[Trace]) -> dict[str, float]:
    """Median decode step once every request has its first token, and median ms to the 18th token."""
    all_started = max(trace.arrivals[0] for trace in traces)
    steps = [step for trace in traces if (step := trace.step_ms_after(all_started)) is not None]
    return {
        "step_ms": statistics.median(steps) if steps else float("nan"),
        "first_audio_tokens_ms": statistics.median(
            (trace.arrivals[FIRST_AUDIO_TOKENS - 1] - trace.submitted) * 1000 for trace in traces),
    }


class Token2WavLoop:
    """token2wav calls of `rows` streams' chunks (`hops`, in step) on a thread of its own, over and over
    while inside `with`; every call's start, end (perf_counter seconds) and hop."""

    def __init__(self, t2w: TorchToken2Wav, speaker: SpeakerState, rows: int, hops: list[int],
                 tokens: torch.Tensor) -> None:
        self._args = (t2w, speaker, rows, hops, tokens)
        self.calls: list[tuple[float, float, int]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="token2wav-loop", daemon=True)
        self.failure: BaseException | None = None

    def _run(self) -> None:
        t2w, speaker, rows, hops, tokens = self._args
        stream = (torch.cuda.stream(torch.cuda.Stream(t2w.device)) if t2w.device.type == "cuda"
                  else contextlib.nullcontext())
        try:
            with stream:
                while not self._stop.is_set():
                    began = time.perf_counter()
                    times = time_schedule(t2w, speaker, rows, hops, tokens)
                    # time_schedule's calls run back to back: rebuild each one's moments from its length.
                    for hop, (ms, _) in zip(hops, times, strict=True):
                        self.calls.append((began, began + ms / 1000, hop))
                        began += ms / 1000
        except BaseException as exc:  # noqa: BLE001 - raised by __exit__ on the caller's thread
            self.failure = exc

    def __enter__(self) -> Token2WavLoop:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        if self.failure is not None:
            raise RuntimeError("the token2wav loop failed") from self.failure

    def call_ms(self, hops: list[int], since: float = 0.0, until: float = float("inf")) -> dict[int, float]:
        """Median ms per call of each hop among the calls whose midpoint is inside [since, until]."""
        inside: dict[int, list[float]] = {hop: [] for hop in hops}
        for began, ended, hop in self.calls:
            if since <= (began + ended) / 2 <= until:
                inside[hop].append((ended - began) * 1000)
        return {hop: statistics.median(times) if times else float("nan") for hop, times in inside.items()}


def measure(event_loop: asyncio.AbstractEventLoop, engine: TorchLLMEngine, t2w: TorchToken2Wav,
            speaker: SpeakerState, llm_streams: int, rows: int, args: argparse.Namespace,
            tokens: torch.Tensor) -> dict[str, Any]:
    hops: list[int] = args.hops
    index = 1000 * llm_streams + 10 * rows  # fresh request seeds for every run

    def burst() -> list[Trace]:
        nonlocal index
        index += llm_streams
        return event_loop.run_until_complete(run_burst(engine, llm_streams, args.tokens, first_index=index))

    alone = [llm_figures(burst()) for _ in range(args.repeats)]
    t2w_alone = Token2WavLoop(t2w, speaker, rows, hops, tokens)
    with t2w_alone:
        while len(t2w_alone.calls) < len(hops) * args.repeats and t2w_alone.failure is None:
            time.sleep(0.01)
    together, t2w_together = [], Token2WavLoop(t2w, speaker, rows, hops, tokens)
    windows = []
    with t2w_together:
        while len(t2w_together.calls) < len(hops) and t2w_together.failure is None:
            time.sleep(0.01)  # one whole schedule first: calls of every hop under way
        for _ in range(args.repeats):
            began = time.perf_counter()
            together.append(llm_figures(burst()))
            windows.append((began, time.perf_counter()))
    t2w_shared: dict[int, list[float]] = {hop: [] for hop in hops}
    for began, ended in windows:
        for hop, ms in t2w_together.call_ms(hops, began, ended).items():
            t2w_shared[hop].append(ms)
    return {
        "llm_streams": llm_streams, "token2wav_rows": rows,
        "llm_alone": {key: statistics.median(run[key] for run in alone) for key in alone[0]},
        "llm_together": {key: statistics.median(run[key] for run in together) for key in together[0]},
        "token2wav_alone_ms": t2w_alone.call_ms(hops),
        "token2wav_together_ms": {hop: statistics.median(times) if times else float("nan")
                                  for hop, times in t2w_shared.items()},
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", type=Path, required=True,
                        help="models directory (scripts/build_engines.py)")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--llm-streams", type=int, nargs="+", default=[16, 64, 128])
    parser.add_argument("--token2wav-rows", type=int, nargs="+", default=[16, 64])
    parser.add_argument("--hops", type=int, nargs="+", default=[15, 25, 50])
    parser.add_argument("--tokens", type=int, default=200, help="speech tokens per LLM request")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--context", type=int, default=2048)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    if args.tokens < FIRST_AUDIO_TOKENS + 2:
        parser.error(f"--tokens must be at least {FIRST_AUDIO_TOKENS + 2}")

    device = torch.device(args.device)
    event_loop = asyncio.new_event_loop()
    engine = TorchLLMEngine.from_models_dir(args.models, device=args.device,
                                            max_slots=max(args.llm_streams), max_context=args.context)
    started = time.perf_counter()
    event_loop.run_until_complete(engine.start())
    llm_start_s = time.perf_counter() - started
    t2w = TorchToken2Wav.from_models_dir(args.models, "dit", device, cuda_graphs=device.type == "cuda")
    speaker = t2w.prepare_speaker(VoicePrompt.load(ModelPaths(args.models).voices / "default.safetensors"))
    started = time.perf_counter()
    t2w.warmup(speaker, batches=args.token2wav_rows)
    t2w_warmup_s = time.perf_counter() - started
    generator = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, SPEECH_CODEBOOK, (sum(args.hops) + PRE_LOOKAHEAD,), generator=generator)
    event_loop.run_until_complete(run_burst(engine, 4, 8))  # the LLM's first use of its shapes

    results = []
    try:
        for llm_streams in args.llm_streams:
            for rows in args.token2wav_rows:
                results.append(measure(event_loop, engine, t2w, speaker, llm_streams, rows, args, tokens))
    finally:
        event_loop.run_until_complete(engine.stop())

    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    print(f"\nLLM and token2wav together: {args.models}, {name}, torch {torch.__version__}; LLM start "
          f"{llm_start_s:.1f} s, token2wav warm-up {t2w_warmup_s:.1f} s; {args.tokens} tokens per request, "
          f"medians of {args.repeats}")
    print(f"{'LLM':>4} {'t2w':>4} {'step ms alone':>14} {'together':>9} {'18 tokens ms alone':>19} "
          f"{'together':>9}  token2wav ms per call alone → together, by hop")
    for row in results:
        llm_alone, llm_together = row["llm_alone"], row["llm_together"]
        alone_ms, together_ms = row["token2wav_alone_ms"], row["token2wav_together_ms"]
        calls = "  ".join(f"{hop}: {alone_ms[hop]:.1f} → {together_ms[hop]:.1f}" for hop in args.hops)
        print(f"{row['llm_streams']:>4} {row['token2wav_rows']:>4} {llm_alone['step_ms']:>14.2f} "
              f"{llm_together['step_ms']:>9.2f} {llm_alone['first_audio_tokens_ms']:>19.1f} "
              f"{llm_together['first_audio_tokens_ms']:>9.1f}  {calls}")
    if args.json:
        report = {"device": name, "models": str(args.models), "tokens": args.tokens, "repeats": args.repeats,
                  "llm_start_s": llm_start_s, "token2wav_warmup_s": t2w_warmup_s, "rows": results}
        args.json.write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
