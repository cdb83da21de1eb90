"""Batched streaming token2wav: wall and launch time of one call over N streams' chunks.

    python benchmarks/token2wav_batch.py --size full --device cuda --batches 1 4 16 64
    python benchmarks/token2wav_batch.py --size tiny --device cpu --batches 1 4 --repeats 1

Builds (or reuses) synthetic checkpoints of the requested size, warms up (`TorchToken2Wav.warmup`: on
CUDA, captures the graphs of the schedule's shapes), then for each batch size N opens N streams of one
voice and times the calls of the exponential schedule with all N streams in step: every stream's first
chunk (15 + 3 tokens; `--hops 10 25 50`: 10 + 3, with the graphs `serve --first-chunk-tokens 10`
captures) in one call, then every stream's second chunk (25 + 3), and so on. Prints, per
call, the wall time (median over repeats), the part of it the host took to queue the call's device work
(`launch_chunks`; on a CPU the whole call), and the real-time factor: seconds of audio the call yields per
second of wall time, which is how many streams at that chunk size one GPU could keep playing.

With `--render TOKENS`, it also times offline rendering (what `realtime synth` asks of token2wav): N
streams' TOKENS tokens each, as one final chunk per stream, and as chunks of each `--render-hops` hop
(the last one final), all N streams in step; the table gives the total over a stream's calls.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from engines.build.synthetic import build_random  # noqa: E402
from engines.config import PRE_LOOKAHEAD, SAMPLE_RATE, SPEECH_CODEBOOK, TOKEN_RATE_HZ, ModelPaths  # noqa: E402
from engines.token2wav.base import ChunkJob, SpeakerState  # noqa: E402
from engines.token2wav.flow_dit import DiTFlow  # noqa: E402
from engines.token2wav.torch_backend import TorchToken2Wav  # noqa: E402
from engines.voice import VoicePrompt  # noqa: E402
from realtime.schedule import ChunkScheduler, EqualHops, graphed_hops  # noqa: E402


def time_schedule(t2w: TorchToken2Wav, speaker: SpeakerState, batch: int, hops: list[int],
                  tokens: torch.Tensor) -> list[tuple[float, float]]:
    """ms of each call, and of its launch (the host queueing the device work, as the server's
    `tts_token2wav_launch_seconds`): chunk k of `batch` streams at once, for every hop k; the streams
    then end. A launch includes any time the host waits for the driver's full queue of launches
    (CUDA's "Command Buffer Full"): close to the call's time it means a device-bound call, not host
    work (docs/benchmarks.md, thirty-fourth session)."""
    streams = [t2w.open_stream(speaker) for _ in range(batch)]
    times, start = [], 0
    for hop in hops:
        piece = tokens[start : start + hop + PRE_LOOKAHEAD]
        jobs = [ChunkJob(stream, piece, last=False) for stream in streams]
        began = time.perf_counter()
        launched = t2w.launch_chunks(jobs)
        queued = time.perf_counter()
        launched.wait()  # CPU audio: the device has finished
        times.append(((time.perf_counter() - began) * 1000, (queued - began) * 1000))
        start += hop
    for stream in streams:
        stream.close()
    return times


def time_render(t2w: TorchToken2Wav, speaker: SpeakerState, batch: int, hop: int | None,
                tokens: torch.Tensor) -> list[float]:
    """ms of each call rendering all of `tokens` for `batch` streams as `realtime synth` hands them over
    (realtime/schedule.py's chunks): one final chunk (hop None), or chunks of `hop` tokens (plus the
    lookahead) and a final chunk with the rest."""
    streams = [t2w.open_stream(speaker) for _ in range(batch)]
    schedule = ChunkScheduler(EqualHops(hop or len(tokens)))
    times = []
    while (chunk := schedule.next_chunk(len(tokens), ended=True)) is not None:
        piece = tokens[chunk.start : chunk.end]
        began = time.perf_counter()
        t2w.run_chunks([ChunkJob(stream, piece, last=chunk.last) for stream in streams])
        times.append((time.perf_counter() - began) * 1000)
    return times


def profile_call(t2w: TorchToken2Wav, speaker: SpeakerState, batch: int, hops: list[int], hop: int,
                 tokens: torch.Tensor, out: Path) -> None:
    """Write the top operators of one call of `batch` streams' chunk of `hop` tokens (one of `hops`,
    after the earlier ones) to `out`: as run (CPU time, i.e. Python and launch overhead), and on CUDA
    once more without graphs, by GPU time per kernel."""
    from torch.profiler import ProfilerActivity, profile, record_function

    import engines.token2wav.torch_backend as backend

    def labelled(label: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def run(*args: Any, **kwargs: Any) -> Any:
            with record_function(label):
                return fn(*args, **kwargs)
        return run

    # The flow's and the vocoder's share of the call, as two labelled ranges in the tables.
    flow = t2w.flow
    if not isinstance(flow, DiTFlow):
        raise TypeError("profiles are of the DiT flow")
    flow_chunks, vocode = flow.chunks, backend.launch_vocode_streams
    flow.chunks = labelled("token2wav: flow", flow_chunks)  # type: ignore[method-assign]
    backend.launch_vocode_streams = labelled("token2wav: vocoder", vocode)
    cuda = t2w.device.type == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    vocoder_graphs = t2w.vocoder_graphs
    graphs, encoder_graphs = flow.graphs, flow.encoder_graphs
    tables = []
    for graphed in (True, False) if cuda and graphs is not None else (True,):
        if not graphed:
            flow.use_bucketed_solver(None)
            t2w.vocoder_graphs = None
        for _ in range(2):  # the first call runs (and captures) every shape once; the second is kept
            streams = [t2w.open_stream(speaker) for _row in range(batch)]
            start = 0
            for earlier in hops[: hops.index(hop)]:  # the chunks before this one, unprofiled
                piece = tokens[start : start + earlier + PRE_LOOKAHEAD]
                t2w.run_chunks([ChunkJob(stream, piece, last=False) for stream in streams])
                start += earlier
            piece = tokens[start : start + hop + PRE_LOOKAHEAD]
            jobs = [ChunkJob(stream, piece, last=False) for stream in streams]
            with profile(activities=activities) as prof:
                t2w.run_chunks(jobs)
            for stream in streams:
                stream.close()
        sort = "self_cuda_time_total" if cuda and not graphed else "self_cpu_time_total"
        which = "first chunks" if hop == hops[0] else "chunks"
        title = f"{batch} {which} of {hop}+{PRE_LOOKAHEAD} tokens, {'graphs' if graphed else 'eager'}"
        table = prof.key_averages().table(sort_by=sort, row_limit=45, max_name_column_width=90)
        tables.append(f"{title}\n{table}")
    if graphs is not None:
        flow.use_bucketed_solver(graphs, encoder=encoder_graphs)
        t2w.vocoder_graphs = vocoder_graphs
    flow.chunks = flow_chunks  # type: ignore[method-assign]
    backend.launch_vocode_streams = vocode
    out.write_text("\n\n".join(tables))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", type=Path, help="models directory (default: build synthetic ones)")
    parser.add_argument("--size", choices=("tiny", "full"), default="tiny")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 4, 16, 64])
    parser.add_argument("--hops", type=int, nargs="+", default=[15, 25, 50, 100])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--eager", action="store_true", help="no CUDA graphs")
    parser.add_argument("--eager-vocoder", action="store_true", help="CUDA graphs for the flow only")
    parser.add_argument("--vocoder-dtype", choices=("float32", "bfloat16", "float16"), default="float32",
                        help="HiFT's decoder (hift.HiFTGenerator.use_decoder_dtype; float32: the reference)")
    parser.add_argument("--cudnn-benchmark", action="store_true",
                        help="let cuDNN time its convolution algorithms per shape (HiFT's convolutions)")
    parser.add_argument("--profile", type=Path, help="directory for operator profiles of some calls")
    parser.add_argument("--profile-hops", type=int, nargs="+",
                        help="the chunks (of --hops) to profile, at the smallest and largest batch "
                             "(default: the first)")
    parser.add_argument("--render", type=int, metavar="TOKENS",
                        help="also time rendering TOKENS tokens per stream offline")
    parser.add_argument("--render-hops", type=int, nargs="*", default=[100, 200],
                        help="chunk hops to render in besides one final chunk")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    if not set(args.profile_hops or ()) <= set(args.hops):
        parser.error(f"--profile-hops {args.profile_hops} must be among --hops {args.hops}")

    device = torch.device(args.device)
    torch.backends.cudnn.benchmark = args.cudnn_benchmark
    models = args.models or Path(tempfile.gettempdir()) / f"cosyvoice-synthetic-{args.size}"
    if args.models is None:
        build_random(models, args.size)
    # The service's graphs for a first chunk of --hops' first (`serve --first-chunk-tokens`).
    t2w = TorchToken2Wav.from_models_dir(models, "dit", device, cuda_graphs=not args.eager,
                                         vocoder_dtype=getattr(torch, args.vocoder_dtype),
                                         graph_hops=graphed_hops(args.hops[0]))
    if args.eager_vocoder:
        t2w.vocoder_graphs = None
    speaker = t2w.prepare_speaker(VoicePrompt.load(ModelPaths(models).voices / "default.safetensors"))
    generator = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, SPEECH_CODEBOOK, (max(sum(args.hops) + PRE_LOOKAHEAD, args.render or 0),),
                           generator=generator)

    began = time.perf_counter()
    t2w.warmup(speaker, batches=[1] if args.eager else args.batches)
    warmup_s = time.perf_counter() - began
    rows = []
    for batch in args.batches:
        time_schedule(t2w, speaker, batch, args.hops, tokens)  # first use of every kernel and shape
        runs = [time_schedule(t2w, speaker, batch, args.hops, tokens) for _ in range(args.repeats)]
        for hop, times in zip(args.hops, zip(*runs, strict=True), strict=True):
            ms = statistics.median(total for total, _ in times)
            launch_ms = statistics.median(launch for _, launch in times)
            audio_s = batch * hop / TOKEN_RATE_HZ
            rows.append({"batch": batch, "hop": hop, "ms": ms, "launch_ms": launch_ms,
                         "ms_per_stream": ms / batch, "realtime_x": audio_s / (ms / 1000)})

    renders = []
    for batch in args.batches if args.render else ():
        for hop in (None, *args.render_hops):
            text = tokens[: args.render]
            time_render(t2w, speaker, batch, hop, text)  # first use of every kernel and shape
            render_runs = [time_render(t2w, speaker, batch, hop, text) for _ in range(args.repeats)]
            ms = statistics.median(sum(run) for run in render_runs)
            calls = [statistics.median(times) for times in zip(*render_runs, strict=True)]
            renders.append({"batch": batch, "hop": hop, "ms": ms, "calls_ms": calls,
                            "realtime_x": batch * args.render / TOKEN_RATE_HZ / (ms / 1000)})

    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    mode = "eager" if args.eager or device.type != "cuda" else "CUDA graphs"
    if mode != "eager" and args.eager_vocoder:
        mode += " (flow only)"
    if args.cudnn_benchmark:
        mode += ", cuDNN benchmark"
    source = f"{args.size} synthetic" if args.models is None else f"{models}"
    print(f"\ntoken2wav launch_chunks + wait: {source} DiT flow ({t2w.flow.dtype}, {mode}), "
          f"HiFT decoder {t2w.hift.decoder_dtype}, "
          f"{name}, torch {torch.__version__}; warm-up {warmup_s:.1f} s; {SAMPLE_RATE} Hz")
    print(f"{'streams':>7} {'chunk (tokens)':>15} {'ms / call':>10} {'launch ms':>10} {'ms / stream':>12} "
          f"{'x real time':>12}")
    for row in rows:
        chunk = f"{'first ' if row['hop'] == args.hops[0] else ''}{row['hop']}+{PRE_LOOKAHEAD}"
        print(f"{row['batch']:>7} {chunk:>15} {row['ms']:>10.1f} {row['launch_ms']:>10.1f} "
              f"{row['ms_per_stream']:>12.2f} {row['realtime_x']:>12.1f}")
    if renders:
        print(f"\noffline render of {args.render} tokens per stream")
        print(f"{'streams':>7} {'chunks':>12} {'ms in all':>10} {'x real time':>12}  ms per call")
        for row in renders:
            chunks = "one" if row["hop"] is None else f"hops of {row['hop']}"
            per_call = " ".join(f"{ms:.1f}" for ms in row["calls_ms"])
            print(f"{row['batch']:>7} {chunks:>12} {row['ms']:>10.1f} {row['realtime_x']:>12.1f}  {per_call}")
    if device.type == "cuda":
        print(f"peak GPU memory: {torch.cuda.max_memory_allocated(device) / 2**30:.2f} GiB")
    if args.profile:
        args.profile.mkdir(parents=True, exist_ok=True)
        for batch in sorted({min(args.batches), max(args.batches)}):
            for hop in args.profile_hops or args.hops[:1]:
                profile_call(t2w, speaker, batch, args.hops, hop, tokens,
                             args.profile / f"profile_b{batch}_hop{hop}.txt")
    if args.json:
        report = {"device": name, "models": str(models), "mode": mode, "warmup_s": warmup_s, "rows": rows,
                  "render_tokens": args.render, "renders": renders}
        args.json.write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
