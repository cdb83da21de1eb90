"""Where a token2wav call of first chunks spends its time, host and device, on one timeline.

    python3 benchmarks/first_chunk_timeline.py --models /tmp/m --batches 1 16 64 [--json out.json]

Warms the DiT token2wav up as the server does (CUDA graphs), then runs `--repeats` calls of N streams'
first chunks (15 + 3 tokens) and prints, as medians in ms after the call began: when the host called and
left each part's launch (the encoder graph, the solve graph, the vocoder graph, the launch as a whole, the
wait for the audio), and when the device began and ended each part (CUDA events recorded just before and
after each launch, timed against one recorded as the call began, on an idle device). The gaps between a
part's device end and the next part's device start are the device waiting for the host.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.profiled_kernels import kernel_table  # noqa: E402
from engines.config import PRE_LOOKAHEAD, SPEECH_CODEBOOK, ModelPaths  # noqa: E402
from engines.token2wav.base import ChunkJob  # noqa: E402
from engines.token2wav.flow_dit import DiTFlow  # noqa: E402
from engines.token2wav.torch_backend import TorchToken2Wav  # noqa: E402
from engines.voice import VoicePrompt  # noqa: E402

FIRST_HOP = 15
PARTS = ("encoder", "solve", "vocoder")


class Marks:
    """Host moments and device events of one call, by name."""

    def __init__(self) -> None:
        self.host: dict[str, float] = {}
        self.device: dict[str, torch.cuda.Event] = {}

    def mark(self, name: str) -> None:
        self.host[name] = time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        self.device[name] = event

    def timed(self, name: str, method: Callable[..., Any]) -> Callable[..., Any]:
        def call(*args: Any, **kwargs: Any) -> Any:
            self.mark(f"{name} in")
            result = method(*args, **kwargs)
            self.mark(f"{name} out")
            return result
        return call

    def figures(self) -> dict[str, float]:
        """ms after the call began: 'host …' from the host's clock, 'device …' from the events."""
        start_host, start_event = self.host["call in"], self.device["call in"]
        # The last events come after work the call queued without waiting for it (the streams' cache copies).
        torch.cuda.synchronize()
        out = {f"host {name}": (moment - start_host) * 1000 for name, moment in self.host.items()}
        out.update({f"device {name}": start_event.elapsed_time(event) for name, event in self.device.items()})
        return out


def timeline(t2w: TorchToken2Wav, speaker: Any, batch: int, tokens: torch.Tensor) -> dict[str, float]:
    """One call of `batch` streams' first chunks, instrumented; the streams are closed after it."""
    flow = t2w.flow
    assert isinstance(flow, DiTFlow) and flow.graphs is not None and flow.encoder_graphs is not None
    assert t2w.vocoder_graphs is not None
    marks = Marks()
    runners: dict[str, Any] = {"encoder": flow.encoder_graphs, "solve": flow.graphs}
    for part, runner in runners.items():
        runner.run = marks.timed(part, runner.run)
    vocoder = t2w.vocoder_graphs
    vocoder.vocode = marks.timed("vocoder", vocoder.vocode)  # type: ignore[method-assign]
    streams = [t2w.open_stream(speaker) for _ in range(batch)]
    piece = tokens[: FIRST_HOP + PRE_LOOKAHEAD]
    try:
        torch.cuda.synchronize()
        marks.mark("call in")
        launched = t2w.launch_chunks([ChunkJob(stream, piece, last=False) for stream in streams])
        marks.mark("launch out")
        launched.wait()
        marks.mark("wait out")
    finally:
        for runner in runners.values():
            del runner.run
        del vocoder.vocode
        for stream in streams:
            stream.close()
    return marks.figures()


def first_chunk_kernels(t2w: TorchToken2Wav, speaker: Any, batch: int, tokens: torch.Tensor,
                        calls: int = 5) -> str:
    """The kernels of `batch` streams' first-chunk call by device time per call (torch.profiler over
    `calls` calls)."""
    from torch.profiler import ProfilerActivity, profile

    piece = tokens[: FIRST_HOP + PRE_LOOKAHEAD]
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            streams = [t2w.open_stream(speaker) for _ in range(batch)]
            t2w.run_chunks([ChunkJob(stream, piece, last=False) for stream in streams])
            for stream in streams:
                stream.close()
    return kernel_table(prof, calls, f"{batch} streams' first chunks", top=40)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", type=Path, required=True, help="models directory (build_engines.py)")
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 16, 64])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--json", type=Path)
    parser.add_argument("--kernels", type=Path, help="text file for each batch's kernels by device time")
    args = parser.parse_args()

    device = torch.device("cuda")
    t2w = TorchToken2Wav.from_models_dir(args.models, "dit", device, cuda_graphs=True)
    speaker = t2w.prepare_speaker(VoicePrompt.load(ModelPaths(args.models).voices / "default.safetensors"))
    tokens = torch.randint(0, SPEECH_CODEBOOK, (FIRST_HOP + PRE_LOOKAHEAD,),
                           generator=torch.Generator().manual_seed(0))
    t2w.warmup(speaker, batches=args.batches)
    results: dict[str, dict[str, float]] = {}
    for batch in args.batches:
        timeline(t2w, speaker, batch, tokens)  # first use of the shapes outside the warm-up
        runs = [timeline(t2w, speaker, batch, tokens) for _ in range(args.repeats)]
        results[str(batch)] = {name: statistics.median(run[name] for run in runs) for name in runs[0]}

    print(f"\nfirst chunks ({FIRST_HOP}+{PRE_LOOKAHEAD} tokens), {torch.cuda.get_device_name(device)}, "
          f"torch {torch.__version__}; ms after the call began, medians of {args.repeats}")
    names = ["call in", *(f"{part} {side}" for part in PARTS for side in ("in", "out")), "launch out",
             "wait out"]
    print(f"{'moment':>14} " + " ".join(f"{f'{b}: host':>10} {'device':>8}" for b in args.batches))
    for name in names:
        cells = []
        for batch in args.batches:
            row = results[str(batch)]
            cells.append(f"{row.get(f'host {name}', float('nan')):>10.2f} "
                         f"{row.get(f'device {name}', float('nan')):>8.2f}")
        print(f"{name:>14} " + " ".join(cells))
    for batch in args.batches:
        row = results[str(batch)]
        spans = [f"{part} {row[f'device {part} out'] - row[f'device {part} in']:.2f}" for part in PARTS]
        print(f"device ms per part, {batch} streams: {', '.join(spans)}")
    if args.json is not None:
        args.json.write_text(json.dumps(results, indent=1))
    if args.kernels is not None:
        tables = [first_chunk_kernels(t2w, speaker, batch, tokens) for batch in args.batches]
        args.kernels.write_text("\n\n".join(tables) + "\n")


if __name__ == "__main__":
    main()
