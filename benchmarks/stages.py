"""Wall time of each pipeline stage for one utterance, engines only (no server, no sockets).

    python benchmarks/stages.py --size full --device cuda --tokens 250
    python benchmarks/stages.py --models /path/to/models --device cpu

Builds (or reuses) synthetic checkpoints of the requested size, then times: loading, voice prompt
extraction, speaker preparation, LLM time to first token and decode rate (fixed output length: random
weights never stop on their own), token2wav per streaming chunk (exponential schedule) and offline.
Prints a table and, with --json, writes the figures.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from engines.build.synthetic import build_random  # noqa: E402
from engines.config import (  # noqa: E402
    SAMPLE_RATE,
    SAMPLES_PER_TOKEN,
    SPEECH_CODEBOOK,
    TOKEN_RATE_HZ,
    ModelPaths,
    read_manifest,
)
from engines.llm.base import LLMRequest, SamplingParams  # noqa: E402
from engines.llm.torch_engine import TorchLLMEngine  # noqa: E402
from engines.text import TextFrontend  # noqa: E402
from engines.token2wav.base import ChunkJob  # noqa: E402
from engines.token2wav.torch_backend import TorchToken2Wav  # noqa: E402
from engines.voice import VoicePrompt  # noqa: E402
from engines.voice_encoder import VoiceEncoder  # noqa: E402
from realtime.schedule import ChunkScheduler, ScheduleKind, make_policy  # noqa: E402

TEXT = "The quick brown fox jumps over the lazy dog, and then it runs far away into the quiet forest."


class Timer:
    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.rows: list[tuple[str, float, str]] = []

    def sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    @contextmanager
    def stage(self, name: str, note: str = "") -> Iterator[None]:
        self.sync()
        start = time.perf_counter()
        yield
        self.sync()
        self.rows.append((name, (time.perf_counter() - start) * 1000, note))

    def add(self, name: str, ms: float, note: str = "") -> None:
        self.rows.append((name, ms, note))


def repeat_ms(timer: Timer, fn: Callable[[], Any], repeats: int) -> list[float]:
    times = []
    for _ in range(repeats):
        timer.sync()
        start = time.perf_counter()
        fn()
        timer.sync()
        times.append((time.perf_counter() - start) * 1000)
    return times


async def time_llm(engine: TorchLLMEngine, request: LLMRequest) -> tuple[float, float, int]:
    """(ms to first token, ms for all tokens, token count)."""
    start = time.perf_counter()
    first = None
    count = 0
    async for tokens in engine.submit(request):
        if first is None:
            first = (time.perf_counter() - start) * 1000
        count += len(tokens)
    return first or 0.0, (time.perf_counter() - start) * 1000, count


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--models", type=Path, help="models directory (default: build synthetic ones)")
    parser.add_argument("--size", choices=("tiny", "full"), default="tiny")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--tokens", type=int, default=250, help="speech tokens per utterance (10 s = 250)")
    parser.add_argument("--variant", choices=("dit", "unet"), default="dit")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()

    device = torch.device(args.device)
    models = args.models or Path(tempfile.gettempdir()) / f"cosyvoice-synthetic-{args.size}"
    timer = Timer(device)
    if args.models is None:
        with timer.stage("build synthetic checkpoints", f"{args.size}, skipped if present"):
            build_random(models, args.size)
    paths = ModelPaths(models)
    size = read_manifest(models)["size"]

    with timer.stage("load text front end"):
        frontend = TextFrontend(paths.text_tokenizer)
    with timer.stage("load LLM engine", "incl. CUDA graph capture" if device.type == "cuda" else ""):
        engine = TorchLLMEngine.from_models_dir(models, device=args.device, max_slots=8)
    with timer.stage(f"load token2wav ({args.variant})"):
        t2w = TorchToken2Wav.from_models_dir(models, args.variant, device)
    with timer.stage("voice prompt extraction", "speech tokenizer + CAMPPlus ONNX, CPU"):
        encoder = VoiceEncoder(paths.speech_tokenizer, paths.campplus)
        clip = paths.voices / "default.wav"
        voice = encoder.encode(clip.read_bytes(), "a synthetic reference clip")
    del voice
    voice = VoicePrompt.load(paths.voices / "default.safetensors")
    with timer.stage("prepare speaker", f"{voice.num_tokens} prompt tokens"):
        speaker = t2w.prepare_speaker(voice)

    text_ids = frontend.encode(TEXT)
    sampling = SamplingParams(fixed_length=args.tokens, seed=0)
    request = LLMRequest("bench", text_ids, frontend.encode(voice.prompt_text),
                         voice.speech_tokens.tolist(), sampling)

    async def llm_runs() -> list[tuple[float, float, int]]:
        with timer.stage("LLM start (load + warm-up)"):
            await engine.start()
        results = [await time_llm(engine, request) for _ in range(args.repeats)]
        await engine.stop()
        return results

    llm = asyncio.run(llm_runs())
    ttft = statistics.median(r[0] for r in llm)
    total = statistics.median(r[1] for r in llm)
    count = llm[0][2]
    timer.add("LLM first token (prefill)", ttft, f"prompt {len(request.prompt_speech_tokens)} speech tokens")
    timer.add("LLM per decode step", (total - ttft) / max(1, count - 1), f"batch 1, {count} tokens")
    timer.add("LLM all tokens", total, f"{count / (total / 1000):.0f} tokens/s = "
              f"{count / TOKEN_RATE_HZ / (total / 1000):.1f}x real time")

    tokens = torch.randint(0, SPEECH_CODEBOOK, (args.tokens,))

    def stream_once() -> list[float]:
        scheduler = ChunkScheduler(make_policy(ScheduleKind.EXPONENTIAL))
        stream = t2w.open_stream(speaker)
        per_chunk = []
        while (chunk := scheduler.next_chunk(args.tokens, ended=True)) is not None:
            timer.sync()
            start = time.perf_counter()
            t2w.run_chunk(ChunkJob(stream, tokens[chunk.start:chunk.end], chunk.last))
            timer.sync()
            per_chunk.append((time.perf_counter() - start) * 1000)
        stream.close()
        return per_chunk

    stream_once()  # warm-up
    runs = [stream_once() for _ in range(args.repeats)]
    chunks = [statistics.median(c) for c in zip(*runs, strict=True)]
    for i, ms in enumerate(chunks):
        timer.add(f"token2wav chunk {i}", ms, "first chunk: 15+3 tokens" if i == 0 else "")
    speed = args.tokens / TOKEN_RATE_HZ / (sum(chunks) / 1000)
    timer.add("token2wav streaming total", sum(chunks), f"{speed:.1f}x real time")
    offline = statistics.median(repeat_ms(timer, lambda: t2w.offline(speaker, tokens), args.repeats))
    audio_s = args.tokens * SAMPLES_PER_TOKEN / SAMPLE_RATE
    timer.add("token2wav offline", offline, f"{args.tokens} tokens = {audio_s:.1f} s")
    step = (total - ttft) / max(1, count - 1)
    timer.add("first audio (LLM 18 tokens + chunk 0)", ttft + 17 * step + chunks[0], "estimate, batch 1")

    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    print(f"\nstage timings: {size} synthetic models, {args.variant} flow, {name}, torch {torch.__version__}")
    print(f"{'stage':<42}{'ms':>10}  note")
    for stage, ms, note in timer.rows:
        print(f"{stage:<42}{ms:>10.1f}  {note}")
    if device.type == "cuda":
        print(f"peak GPU memory: {torch.cuda.max_memory_allocated(device) / 2**30:.2f} GiB")
    if args.json:
        args.json.write_text(json.dumps({"device": name, "size": size, "variant": args.variant,
                                         "rows": timer.rows}, indent=2))


if __name__ == "__main__":
    main()
