"""The host's share of a token2wav call, without a GPU: the torch ops one batched call dispatches outside
its encoder, solve and vocoder (which CUDA graphs replay on a GPU), per call and per stream.

    python3 benchmarks/token2wav_host_ops.py [--models DIR] --batches 1 16 64 --hops 15 25 50

On a GPU every op the host dispatches costs microseconds of Python, dispatch and (for most) a kernel
launch, and a 64-stream call of later chunks spent 51–60 ms of host time against ~100 ms in all
(docs/benchmarks.md, thirty-third session). Here the encoder, the solver and the vocoder are replaced by
stand-ins that hand back preallocated outputs (as graphs would) without computing, so what the profiler
counts is the bookkeeping around them: the caches copied in and out per stream, the views, the noise
draws. Counts do not depend on the weights' size; the tiny synthetic models are built unless given.
"""

from __future__ import annotations

import argparse
import collections
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from engines.build.synthetic import build_random  # noqa: E402
from engines.config import PRE_LOOKAHEAD, SPEECH_CODEBOOK, ModelPaths  # noqa: E402
from engines.token2wav.base import ChunkJob  # noqa: E402
from engines.token2wav.batching import Buckets, EncodeShape, SolveShape  # noqa: E402
from engines.token2wav.cfm import RaggedInputs, RaggedOutputs  # noqa: E402
from engines.token2wav.flow_dit import DiTFlow  # noqa: E402
from engines.token2wav.graphs import EncoderInputs, EncoderLayout, EncoderOutputs, SolverLayout  # noqa: E402
from engines.token2wav.hift import HiFTGenerator, Vocoded  # noqa: E402
from engines.token2wav.torch_backend import TorchToken2Wav  # noqa: E402
from engines.voice import VoicePrompt  # noqa: E402


def zeros(name: str, size: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A buffer of a layout's (`name`, size, dtype): zeros on the CPU."""
    return torch.zeros(size, dtype=dtype)


class StandInSolver:
    """A solver with one set of input and output buffers per shape that computes nothing."""

    def __init__(self, flow: DiTFlow) -> None:
        self.layout = SolverLayout.of(flow.cfg, flow.dtype, flow.device)
        self.inputs: dict[SolveShape, RaggedInputs] = {}
        self.outputs: dict[SolveShape, RaggedOutputs] = {}

    def buffers(self, shape: SolveShape) -> RaggedInputs:
        if shape not in self.inputs:
            specs = self.layout.input_specs(shape).items()
            self.inputs[shape] = RaggedInputs(**{name: zeros(name, *spec) for name, spec in specs})
        return self.inputs[shape]

    def run(self, shape: SolveShape) -> RaggedOutputs:
        if shape not in self.outputs:
            specs = self.layout.output_specs(shape).items()
            self.outputs[shape] = RaggedOutputs(**{name: zeros(name, *spec) for name, spec in specs})
        return self.outputs[shape]


class StandInEncoder:
    """`StandInSolver` for the encoder."""

    def __init__(self, flow: DiTFlow) -> None:
        self.layout = EncoderLayout(flow.cfg.encoder, flow.cfg.output_size, flow.dtype, flow.device)
        self.inputs: dict[EncodeShape, EncoderInputs] = {}
        self.outputs: dict[EncodeShape, EncoderOutputs] = {}

    def buffers(self, shape: EncodeShape) -> EncoderInputs:
        return self.inputs.setdefault(shape, self.layout.inputs(shape, zeros))

    def run(self, shape: EncodeShape) -> EncoderOutputs:
        return self.outputs.setdefault(shape, self.layout.outputs(shape, zeros))


class StandInVocoder:
    """`VocoderGraphs` that returns silence of the right length without computing."""

    def __init__(self, hift: HiFTGenerator) -> None:
        self.hop = hift.hop_samples

    def final_bucket(self, frames: int, cached: int) -> int | None:
        return None

    def vocode(self, mel: torch.Tensor, cache_source: torch.Tensor | None, noise: torch.Tensor,
               frames: torch.Tensor | None = None) -> Vocoded:
        samples = mel.shape[2] * self.hop
        return Vocoded(torch.zeros(mel.shape[0], samples), torch.zeros(mel.shape[0], 1, samples))


def dispatched(event: Any) -> bool:
    """Whether a profiled event is an op the host called itself (not one an op called inside it, as
    `as_strided` under `slice`)."""
    parent = event.cpu_parent
    return bool(event.name.startswith("aten::") and (parent is None or not parent.name.startswith("aten::")))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", type=Path, help="models directory (default: build tiny synthetic ones)")
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 16, 64])
    parser.add_argument("--hops", type=int, nargs="+", default=[15, 25, 50])
    parser.add_argument("--top", type=int, default=8, help="ops listed per call")
    args = parser.parse_args()

    torch.set_num_threads(1)
    models = args.models or Path(tempfile.gettempdir()) / "cosyvoice-synthetic-tiny"
    if args.models is None:
        build_random(models, "tiny")
    t2w = TorchToken2Wav.from_models_dir(models, "dit", torch.device("cpu"))
    flow = t2w.flow
    if not isinstance(flow, DiTFlow):
        raise TypeError("the host ops are counted for the DiT flow")
    flow.use_bucketed_solver(StandInSolver(flow), Buckets(), StandInEncoder(flow))
    # The backend's graphs stand in for the protocol `launch_vocode_streams` takes; so does this.
    t2w.vocoder_graphs = StandInVocoder(t2w.hift)  # type: ignore[assignment]
    speaker = t2w.prepare_speaker(VoicePrompt.load(ModelPaths(models).voices / "default.safetensors"))
    tokens = torch.randint(0, SPEECH_CODEBOOK, (sum(args.hops) + PRE_LOOKAHEAD,),
                           generator=torch.Generator().manual_seed(0))

    with profile(activities=[ProfilerActivity.CPU]):  # the profiler's own start-up, outside the figures
        torch.zeros(1)
    print(f"{'streams':>7} {'chunk':>6} {'torch ops':>10} {'per stream':>11} {'ms (CPU)':>9}  most called")
    for batch in args.batches:
        for profiled in (False, True):  # the first pass meets every shape once
            streams = [t2w.open_stream(speaker) for _ in range(batch)]
            start = 0
            for hop in args.hops:
                jobs = [ChunkJob(stream, tokens[start : start + hop + PRE_LOOKAHEAD], last=False)
                        for stream in streams]
                start += hop
                if not profiled:
                    t2w.launch_chunks(jobs).wait()
                    continue
                began = time.perf_counter()
                with profile(activities=[ProfilerActivity.CPU]) as prof:
                    t2w.launch_chunks(jobs).wait()
                ms = (time.perf_counter() - began) * 1000
                counts = collections.Counter(event.name for event in prof.events() if dispatched(event))
                total = sum(counts.values())
                common = ", ".join(f"{name[6:]} {n}" for name, n in counts.most_common(args.top))
                chunk = f"{hop}+{PRE_LOOKAHEAD}"
                print(f"{batch:>7} {chunk:>6} {total:>10} {total / batch:>11.1f} {ms:>9.1f}  {common}")
            for stream in streams:
                stream.close()


if __name__ == "__main__":
    main()
